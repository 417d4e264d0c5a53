"""The MoE layer with expert parallelism over mtdeepep's CUDA executor ('flex' dispatcher), 2 and 4 ranks sharing
GPU 0, against the single-process layer on the host (moe_ep_cases.py). Skipped, with one reason, without a CUDA
device or without mtdeepep's CUDA executor."""

from __future__ import annotations

import pytest

from . import moe_ep_cases as cases
from .gpu import rank_ids, skip_unless_cuda

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(300)]


@pytest.mark.parametrize("world_size", [2, 4], ids=rank_ids)
@pytest.mark.parametrize("hidden", [32, 256])
def test_flex_layer_matches_single_process(cuda_pools, world_size, hidden):
    cuda_pools[world_size].run(cases.flex_layer_matches_single_process, hidden)
