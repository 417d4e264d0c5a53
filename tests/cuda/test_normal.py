"""Normal mode on the GPU (cases in normal_cases.py): 2 and 4 rank processes share GPU 0, control over gloo, data
over CUDA IPC. Skipped, with one reason, without a CUDA device or without mtdeepep's CUDA executor."""

from __future__ import annotations

import pytest

from . import normal_cases as cases
from .gpu import ROUTINGS, rank_ids, skip_unless_cuda

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(600)]

WORLD_SIZES = (2, 4)
TIMEOUT_S = 3.0  # the buffers' timeout in the timeout cases


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_layout_matches_reference(cuda_pools, world_size, routing):
    cuda_pools[world_size].run(cases.layout_matches_reference, routing)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype_name", sorted(cases.DTYPES))
def test_dispatch_combine_match_reference(cuda_pools, world_size, routing, dtype_name):
    cuda_pools[world_size].run(cases.dispatch_combine_match_reference, dtype_name, routing)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fp8_dispatch_with_scales(cuda_pools, world_size, routing):
    cuda_pools[world_size].run(cases.fp8_dispatch_with_scales, routing)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize(
    "case",
    [
        cases.expert_alignment_rounds_counts,
        cases.num_worst_tokens_pads_outputs,
        cases.combine_accumulates_in_fp32,
        cases.combine_adds_bias,
        cases.async_and_previous_event,
        cases.sm_counts_agree,
        cases.device_mismatch_raises_value_error,
        cases.num_worst_tokens_too_small_raises_on_every_rank,
        cases.small_region_raises_on_every_rank,
    ],
    ids=lambda case: case.__name__,
)
def test_case(cuda_pools, world_size, case):
    cuda_pools[world_size].run(case)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
def test_rounds_with_a_peer_ahead(cuda_pools, world_size):
    """The race case with the ranks as processes (time-sliced on one GPU: fewer rounds than test_local_ranks.py, where
    the ranks run concurrently)."""
    assert cuda_pools[world_size].run(cases.rounds_with_a_peer_ahead, 50) == [50] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("layout_in_graph", [True, False], ids=["layout-captured", "layout-eager"])
def test_cuda_graph_dispatch_combine(cuda_pools, world_size, layout_in_graph):
    cuda_pools[world_size].run(cases.cuda_graph_dispatch_combine, layout_in_graph)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
def test_missing_rank_in_dispatch_times_out(cuda_pools, world_size):
    outcomes = cuda_pools[world_size].run(cases.missing_rank_in_dispatch_times_out, TIMEOUT_S)
    assert outcomes == ["timeout [1]", "skipped"] + ["timeout [1]"] * (world_size - 2)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("async_finish", [False, True], ids=["sync", "async"])
def test_missing_rank_in_combine_times_out(cuda_pools, world_size, async_finish):
    outcomes = cuda_pools[world_size].run(cases.missing_rank_in_combine_times_out, TIMEOUT_S, async_finish)
    assert outcomes == ["skipped"] + ["timeout [0]"] * (world_size - 1)
