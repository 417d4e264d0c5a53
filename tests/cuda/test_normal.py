"""Normal mode on the GPU: 2 and 4 rank processes share GPU 0, control over gloo, data over CUDA IPC. The cases both
executors share are the conformance cases (tests/conformance/normal_cases.py) with the GPU placement, at upstream's
sizes and with a skewed routing too; the GPU's own cases are in normal_cases.py. Skipped, with one reason, without a
CUDA device or without mtdeepep's CUDA executor."""

from __future__ import annotations

import os

import pytest

from ..conformance import normal_cases as shared
from ..conformance.common import ROUTINGS
from . import normal_cases as cases
from .gpu import rank_ids, skip_unless_cuda
from .normal_cases import topology

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(600)]

WORLD_SIZES = (2, 4)
TIMEOUT_S = 3.0  # the buffers' timeout in the timeout cases
DTYPE_NAMES = ("bfloat16", "float32")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_layout_matches_reference(cuda_pools, world_size, routing):
    cuda_pools[world_size].run(shared.layout_matches_reference, topology(world_size), routing)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_dispatch_combine_match_reference(cuda_pools, world_size, routing, dtype_name):
    cuda_pools[world_size].run(shared.combine_matches_reference, topology(world_size), (dtype_name,), routing,
                               "upstream")  # fmt: skip


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_fp8_dispatch_with_scales(cuda_pools, world_size, routing):
    cuda_pools[world_size].run(shared.fp8_dispatch_passes_through, topology(world_size), routing, "upstream")


SHARED_CASES = [
    shared.expert_alignment_rounds_counts,
    shared.num_worst_tokens_pads_outputs,
    shared.combine_accumulates_in_fp32,
    shared.combine_adds_bias,
    shared.async_and_previous_event,
    shared.num_worst_tokens_too_small_raises_on_every_rank,
]
# A region too small for an operation's rows: the CUDA executor refuses it on every rank (one round); the Triton
# executor moves it in rounds, as the CPU one does (seen on the H200, 2026-11-28), so it runs the rounds case.
GPU_CASES = [cases.sm_counts_agree, cases.device_mismatch_raises_value_error]
if os.environ.get("MTDEEPEP_ENGINE", "cuda") == "cuda":
    GPU_CASES.append(cases.small_region_raises_on_every_rank)
else:
    SHARED_CASES.append(shared.small_buffer_moves_in_rounds)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("case", SHARED_CASES + GPU_CASES, ids=lambda case: case.__name__)
def test_case(cuda_pools, world_size, case):
    if case in SHARED_CASES:
        cuda_pools[world_size].run(case, topology(world_size))
    else:
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
    """Rank 1 refuses its input and never joins the dispatch: the others time out naming it."""
    topo = topology(world_size)
    outcomes = cuda_pools[world_size].run(shared.bad_input_on_one_rank_times_out_the_others, topo, TIMEOUT_S)
    assert outcomes == shared.bad_input_outcomes(topo)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("async_finish", [False, True], ids=["sync", "async"])
def test_missing_rank_in_combine_times_out(cuda_pools, world_size, async_finish):
    topo = topology(world_size)
    outcomes = cuda_pools[world_size].run(shared.missing_rank_in_combine_times_out, topo, TIMEOUT_S, async_finish)
    assert outcomes == shared.missing_in_combine_outcomes(topo)
