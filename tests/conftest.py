"""Fixtures shared by the whole suite: rank pools of the one launcher (`mtdeepep.utils.testing`)."""

from __future__ import annotations

import os

# Before any CUDA use: the GPU tests run ranks as threads of one process (tests/cuda/test_local_ranks.py), whose
# kernels wait for each other; CUDA's lazy module loading would synchronise the context at a kernel's first launch
# and stop them all until the timeout (mtdeepep.utils.local_ranks). No effect without a GPU.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest  # noqa: E402

from mtdeepep.utils.testing import RankPools


@pytest.fixture(scope="module")
def rank_pools():
    """`rank_pools[n]`: the module's pool of `n` rank processes (spawned once, at first use; gloo on 127.0.0.1)."""
    pools = RankPools()
    yield pools
    pools.close()
