"""The GPU tests' cases on the CPU executor, in CI: the shared cases with the GPU topology and the GPU tests' parameters
(upstream's sizes, skewed routing), and the GPU's own cases that do not need the device itself. `gpu.run_on_cpu` makes
the GPU placement's device moves no-ops, so each case's inputs, references, bounds and expected outcomes are checked,
through the GPU placement's code path, against an executor that is tested on its own (tests/conformance). A GPU failure
of the same case is then the GPU executor's, not the test's. Cases that need the device itself (CUDA graphs, SM counts,
device checks, the FP8/grouped GEMMs) are not here. 2 ranks of the suite's CPU pools (`rank_pools`), and 4 for the
timeouts: with 3 or more ranks every waiter but the first is stopped by a peer, and must still name the rank that did
not arrive (the expected outcomes of the GPU runs at 4 ranks are these). About a minute and a half.
"""

from __future__ import annotations

import signal

import pytest

from mtdeepep.utils.testing import run_processes

from ..conformance import low_latency_cases as shared_ll
from ..conformance import normal_cases as shared
from ..conformance.placement import CUDA
from . import low_latency_cases as ll
from . import moe_ep_cases, process_cases
from . import normal_cases as normal
from .gpu import run_on_cpu
from .normal_cases import topology

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 1.5  # the buffers' timeout in the timeout cases
GPU_2 = topology(2)  # the GPU tests' topology of 2 ranks (its placement on the CPU executor here)

# (test id, case, arguments): the shared cases with the GPU topology and the GPU tests' parameters.
CASES = [
    ("layout_matches_reference", shared.layout_matches_reference, (GPU_2, "skewed")),
    ("dispatch_combine_match_reference", shared.combine_matches_reference, (GPU_2, ("bfloat16",), "skewed",
                                                                            "upstream")),
    ("fp8_dispatch_with_scales", shared.fp8_dispatch_passes_through, (GPU_2, "uniform", "upstream")),
    *[(case.__name__, case, (GPU_2,)) for case in (
        shared.expert_alignment_rounds_counts, shared.num_worst_tokens_pads_outputs,
        shared.combine_accumulates_in_fp32, shared.combine_adds_bias, shared.async_and_previous_event,
        shared.num_worst_tokens_too_small_raises_on_every_rank,
    )],
    ("rounds_with_a_peer_ahead", normal.rounds_with_a_peer_ahead, (40,)),
    ("dispatch_matches_reference", shared_ll.dispatch_matches_reference, (GPU_2, "fp8-ue8m0", "skewed", "upstream")),
    ("combine_matches_reference", shared_ll.combine_matches_reference, (GPU_2, ("fp8-pow2",), "uniform", "upstream")),
    ("async_and_hooks", shared_ll.async_and_hooks, (GPU_2, "upstream")),
    ("flex_layer_matches_single_process", moe_ep_cases.flex_layer_matches_single_process, (32,)),
]  # fmt: skip


@pytest.mark.parametrize("case, args", [pytest.param(c, a, id=name) for name, c, a in CASES])
def test_case_on_cpu(rank_pools, case, args):
    rank_pools[2].run(run_on_cpu, case, *args)


@pytest.mark.slow  # slow: timeout cases at 2 and 4 ranks
@pytest.mark.parametrize("world_size", [2, 4])
def test_timeouts_on_cpu(rank_pools, world_size):
    pool = rank_pools[world_size]
    topo = topology(world_size)
    outcomes = pool.run(run_on_cpu, shared.bad_input_on_one_rank_times_out_the_others, topo, TIMEOUT_S)
    assert outcomes == shared.bad_input_outcomes(topo)
    for async_finish in (False, True):
        outcomes = pool.run(run_on_cpu, shared.missing_rank_in_combine_times_out, topo, TIMEOUT_S, async_finish)
        assert outcomes == shared.missing_in_combine_outcomes(topo)
    outcomes = pool.run(run_on_cpu, ll.missing_rank_times_out, TIMEOUT_S)
    assert outcomes == ["timeout [1]", "skipped"] + ["timeout [1]"] * (world_size - 2)


@pytest.mark.slow  # slow: a SIGKILLed peer
def test_killed_peer_on_cpu():
    finished = run_processes(process_cases.killed_peer_on_cpu, 2, (TIMEOUT_S,), timeout_s=120)
    assert finished.exitcodes == [0, -signal.SIGKILL], finished.exitcodes
    ((kind, named, seconds, usable, _),) = finished.values[0]
    assert kind in ("CommTimeoutError", "CommError") and named == [process_cases.VICTIM] and usable, (kind, named)
    assert seconds < 2 * TIMEOUT_S + 2


def test_torchtitan_on_cpu(rank_pools):
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed")
    from ..clients import client_cases

    rank_pools[2].run(run_on_cpu, client_cases.torchtitan_training_round_trip, "bfloat16", CUDA)
