"""`pool`: the module's rank pool for the test's `topology` parameter (see `topology.py`)."""

from __future__ import annotations

import pytest


@pytest.fixture
def pool(rank_pools, topology):
    return rank_pools[topology.world_size]
