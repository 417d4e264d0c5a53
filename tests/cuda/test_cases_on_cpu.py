"""The GPU cases on the CPU executor, in CI: `gpu.run_on_cpu` makes the device moves no-ops, so each case's inputs,
references, bounds and expected outcomes are checked against an executor that is tested on its own (tests/
conformance). A GPU failure of the same case is then the GPU executor's, not the test's. Cases that need the device
itself (CUDA graphs, SM counts, events ordering a sleeping stream, device checks, the FP8/grouped GEMMs) are not
here. 2 ranks of the suite's CPU pools (`rank_pools`), and 4 for the timeouts: with 3 or more ranks every waiter
but the first is stopped by a peer, and must still name the rank that did not arrive (the expected outcomes of the
GPU runs at 4 ranks are these). About a minute and a half.
"""

from __future__ import annotations

import signal

import pytest

from mtdeepep.utils.testing import run_processes

from . import low_latency_cases as ll
from . import moe_ep_cases, process_cases
from . import normal_cases as normal
from .gpu import run_on_cpu

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 1.5  # the buffers' timeout in the timeout cases

CASES = [
    (normal.layout_matches_reference, ("skewed",)),
    (normal.dispatch_combine_match_reference, ("bfloat16", "skewed")),
    (normal.fp8_dispatch_with_scales, ("uniform",)),
    (normal.expert_alignment_rounds_counts, ()),
    (normal.num_worst_tokens_pads_outputs, ()),
    (normal.combine_accumulates_in_fp32, ()),
    (normal.combine_adds_bias, ()),
    (normal.async_and_previous_event, ()),
    (normal.num_worst_tokens_too_small_raises_on_every_rank, ()),
    (normal.rounds_with_a_peer_ahead, (40,)),
    (ll.dispatch_matches_reference, ("fp8-ue8m0", "skewed")),
    (ll.combine_matches_reference, ("fp8-pow2", "uniform")),
    (ll.async_and_hooks, ()),
    (moe_ep_cases.flex_layer_matches_single_process, (32,)),
]


@pytest.mark.parametrize("case, args", [pytest.param(c, a, id=c.__name__) for c, a in CASES])
def test_case_on_cpu(rank_pools, case, args):
    rank_pools[2].run(run_on_cpu, case, *args)


@pytest.mark.parametrize("world_size", [2, 4])
def test_timeouts_on_cpu(rank_pools, world_size):
    pool = rank_pools[world_size]
    others = world_size - 2
    outcomes = pool.run(run_on_cpu, normal.missing_rank_in_dispatch_times_out, TIMEOUT_S)
    assert outcomes == ["timeout [1]", "skipped"] + ["timeout [1]"] * others
    for async_finish in (False, True):
        outcomes = pool.run(run_on_cpu, normal.missing_rank_in_combine_times_out, TIMEOUT_S, async_finish)
        assert outcomes == ["skipped"] + ["timeout [0]"] * (world_size - 1)
    assert (
        pool.run(run_on_cpu, ll.missing_rank_times_out, TIMEOUT_S)
        == ["timeout [1]", "skipped"] + ["timeout [1]"] * others
    )


def test_killed_peer_on_cpu():
    finished = run_processes(process_cases.killed_peer_on_cpu, 2, (TIMEOUT_S,), timeout_s=120)
    assert finished.exitcodes == [0, -signal.SIGKILL], finished.exitcodes
    ((kind, named, seconds, usable, _),) = finished.values[0]
    assert kind in ("CommTimeoutError", "CommError") and named == [process_cases.VICTIM] and usable, (kind, named)
    assert seconds < 2 * TIMEOUT_S + 2


def test_torchtitan_on_cpu(rank_pools):
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed")
    from . import client_cases

    rank_pools[2].run(run_on_cpu, client_cases.torchtitan_training_round_trip, "bfloat16")
