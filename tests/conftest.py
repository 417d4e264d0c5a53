"""Fixtures shared by the whole suite: rank pools of the one launcher (`mtdeepep.utils.testing`)."""

from __future__ import annotations

import pytest

from mtdeepep.utils.testing import RankPools


@pytest.fixture(scope="module")
def rank_pools():
    """`rank_pools[n]`: the module's pool of `n` rank processes (spawned once, at first use; gloo on 127.0.0.1)."""
    pools = RankPools()
    yield pools
    pools.close()
