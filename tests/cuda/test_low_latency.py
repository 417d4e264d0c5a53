"""Low-latency mode on the GPU (cases in low_latency_cases.py): 2 and 4 rank processes share GPU 0. Skipped, with
one reason, without a CUDA device or without mtdeepep's CUDA executor."""

from __future__ import annotations

import pytest

from . import low_latency_cases as cases
from .gpu import ROUTINGS, rank_ids, skip_unless_cuda

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(600)]

WORLD_SIZES = (2, 4)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", list(cases.FP8_MODES))
def test_dispatch_matches_reference(cuda_pools, world_size, routing, mode):
    cuda_pools[world_size].run(cases.dispatch_matches_reference, mode, routing)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-pow2"])
def test_combine_matches_reference(cuda_pools, world_size, routing, mode):
    cuda_pools[world_size].run(cases.combine_matches_reference, mode, routing)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
def test_async_and_hooks(cuda_pools, world_size):
    cuda_pools[world_size].run(cases.async_and_hooks)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
def test_missing_rank_times_out(cuda_pools, world_size):
    outcomes = cuda_pools[world_size].run(cases.missing_rank_times_out, 3.0)
    assert outcomes == ["timeout [1]", "skipped"] + ["timeout [1]"] * (world_size - 2)
