"""The GPU cases with the ranks as threads of one process (`mtdeepep.utils.local_ranks`): each rank its own CUDA
engine and stream, the peer tables filled with device pointers instead of IPC handles, so the same kernels run
truly concurrently on the one GPU (processes sharing a GPU are time-sliced). This is where memory-ordering bugs can
show: the many-rounds race case runs here at every world size. No process is spawned: these run in seconds.

Skipped, with one reason, without a CUDA device; on a CUDA build of torch without mtdeepep's CUDA executor they
fail (see `mtdeepep.utils.testing.cuda_skip_reason`). The cases needing processes stay in the other modules: CUDA
graphs (capture is per process), the MoE layer over a process group, torchtitan, a killed peer.
"""

from __future__ import annotations

import pytest

from ..conformance import low_latency_cases as shared_ll
from ..conformance import normal_cases as shared
from ..conformance.common import ROUTINGS
from . import low_latency_cases as ll
from . import normal_cases as normal
from .gpu import rank_ids, skip_unless_cuda
from .normal_cases import topology

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(300)]

WORLD_SIZES = (2, 4, 8)  # of the cases
RACE_WORLD_SIZES = (2, 3, 4, 8)
TIMEOUT_S = 3.0  # the buffers' timeout in the timeout cases
ROUNDS = 200  # rounds of the race case


@pytest.fixture(scope="module")
def local_ranks():
    """`local_ranks[n]`: n ranks in this process (made at first use, closed at the module's end)."""
    from mtdeepep.utils.local_ranks import LocalRanks

    made: dict[int, LocalRanks] = {}

    class Ranks(dict):
        def __missing__(self, n: int) -> LocalRanks:
            made[n] = self[n] = LocalRanks(n, device=0, timeout_s=30)
            return made[n]

    yield Ranks()
    for ranks in made.values():
        ranks.close()


# (test id, case, arguments, shared): a shared case is a conformance case, run with the GPU topology first.
NORMAL_CASES = [
    *[(f"layout_matches_reference-{r}", shared.layout_matches_reference, (r,), True) for r in ROUTINGS],
    *[(f"dispatch_combine_match_reference-{d}-{r}", shared.combine_matches_reference, ((d,), r, "upstream"), True)
      for d in ("bfloat16", "float32") for r in ROUTINGS],
    ("fp8_dispatch_with_scales-skewed", shared.fp8_dispatch_passes_through, ("skewed", "upstream"), True),
    *[(case.__name__, case, (), True) for case in (
        shared.expert_alignment_rounds_counts, shared.num_worst_tokens_pads_outputs,
        shared.combine_accumulates_in_fp32, shared.combine_adds_bias, shared.async_and_previous_event,
    )],
    (normal.sm_counts_agree.__name__, normal.sm_counts_agree, (), False),
    (normal.device_mismatch_raises_value_error.__name__, normal.device_mismatch_raises_value_error, (), False),
    ("num_worst_tokens_too_small_raises_on_every_rank", shared.num_worst_tokens_too_small_raises_on_every_rank, (),
     True),
    (normal.small_region_raises_on_every_rank.__name__, normal.small_region_raises_on_every_rank, (), False),
]  # fmt: skip
LOW_LATENCY_CASES = [
    *[(f"dispatch_matches_reference-{m}-uniform", shared_ll.dispatch_matches_reference, (m, "uniform", "upstream"),
       True) for m in shared_ll.FP8_MODES],
    ("dispatch_matches_reference-fp8-skewed", shared_ll.dispatch_matches_reference, ("fp8", "skewed", "upstream"),
     True),
    *[(f"combine_matches_reference-{m}-skewed", shared_ll.combine_matches_reference, ((m,), "skewed", "upstream"),
       True) for m in ("bf16", "fp8-pow2")],
    ("async_and_hooks", shared_ll.async_and_hooks, ("upstream",), True),
]  # fmt: skip


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("name, case, args, is_shared", [pytest.param(*c, id=c[0]) for c in NORMAL_CASES +
                                                          LOW_LATENCY_CASES])  # fmt: skip
def test_case(local_ranks, world_size, name, case, args, is_shared):
    if is_shared:
        args = (topology(world_size), *args)
    local_ranks[world_size].run(case, *args)


@pytest.mark.parametrize("world_size", RACE_WORLD_SIZES, ids=rank_ids)
def test_rounds_with_a_peer_ahead(local_ranks, world_size):
    assert local_ranks[world_size].run(normal.rounds_with_a_peer_ahead, ROUNDS) == [ROUNDS] * world_size


# The poison semantics: with 3 or more ranks every waiter must name the rank that did not arrive, also those stopped
# by the first waiter's timeout (they raise CommTimeoutError naming it, not "rank 0 failed").
@pytest.mark.parametrize("world_size", (2, 3, 4), ids=rank_ids)
def test_missing_rank_in_dispatch_times_out(local_ranks, world_size):
    """Rank 1 refuses its input and never joins the dispatch: every other rank names it."""
    topo = topology(world_size)
    outcomes = local_ranks[world_size].run(shared.bad_input_on_one_rank_times_out_the_others, topo, TIMEOUT_S)
    assert outcomes == shared.bad_input_outcomes(topo)


@pytest.mark.parametrize("world_size", (2, 4), ids=rank_ids)
@pytest.mark.parametrize("async_finish", [False, True], ids=["sync", "async"])
def test_missing_rank_in_combine_times_out(local_ranks, world_size, async_finish):
    topo = topology(world_size)
    outcomes = local_ranks[world_size].run(shared.missing_rank_in_combine_times_out, topo, TIMEOUT_S, async_finish)
    assert outcomes == shared.missing_in_combine_outcomes(topo)


@pytest.mark.parametrize("world_size", (2, 4), ids=rank_ids)
def test_low_latency_missing_rank_times_out(local_ranks, world_size):
    outcomes = local_ranks[world_size].run(ll.missing_rank_times_out, TIMEOUT_S)
    assert outcomes == ["timeout [1]", "skipped"] + ["timeout [1]"] * (world_size - 2)


def test_exported_memory_is_whole_2mib_granules(local_ranks):
    """CUDA IPC shares a whole allocation: the memory a rank exports is allocated in whole 2 MiB granules, also for a
    small region (a low-latency buffer's ~72 KB normal region), never sharing a granule with unrelated memory."""
    for num_nvl_bytes in (0, 72 << 10, (3 << 20) + 5):
        for buffer in local_ranks[2].buffers(num_nvl_bytes=num_nvl_bytes):
            assert buffer._engine.buffer.nvl_alloc_bytes % (2 << 20) == 0, num_nvl_bytes
            assert buffer._engine.buffer.nvl_alloc_bytes >= num_nvl_bytes
