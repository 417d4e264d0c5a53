"""Low-latency mode on the GPU: 2 and 4 rank processes share GPU 0. The cases both executors share are the
conformance cases (tests/conformance/low_latency_cases.py) with the GPU placement, at upstream's size and with a
skewed routing too; the GPU's own case is in low_latency_cases.py. Skipped, with one reason, without a CUDA device or
without mtdeepep's CUDA executor."""

from __future__ import annotations

import pytest

from ..conformance import low_latency_cases as shared
from ..conformance.common import ROUTINGS
from . import low_latency_cases as cases
from .gpu import rank_ids, skip_unless_cuda
from .normal_cases import topology

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(600)]

WORLD_SIZES = (2, 4)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", list(shared.FP8_MODES))
def test_dispatch_matches_reference(cuda_pools, world_size, routing, mode):
    cuda_pools[world_size].run(shared.dispatch_matches_reference, topology(world_size), mode, routing, "upstream")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8-pow2"])
def test_combine_matches_reference(cuda_pools, world_size, routing, mode):
    cuda_pools[world_size].run(shared.combine_matches_reference, topology(world_size), (mode,), routing, "upstream")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
def test_async_and_hooks(cuda_pools, world_size):
    cuda_pools[world_size].run(shared.async_and_hooks, topology(world_size), "upstream")


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=rank_ids)
def test_missing_rank_times_out(cuda_pools, world_size):
    outcomes = cuda_pools[world_size].run(cases.missing_rank_times_out, 3.0)
    assert outcomes == ["timeout [1]", "skipped"] + ["timeout [1]"] * (world_size - 2)
