"""The Triton executor's cases run in rank processes that pick it (`MTDEEPEP_ENGINE=triton`) under Triton's
interpreter (`TRITON_INTERPRET=1`): `rank_pools` here overrides the suite's."""

from __future__ import annotations

import pytest

from ..ranks import pool_fixture

rank_pools = pool_fixture(engine="triton", deadline_s=240)


@pytest.fixture
def pool(rank_pools, topology):
    return rank_pools[topology.world_size]
