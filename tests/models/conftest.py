"""Rank pools for the model's expert-parallel cases: one intra-op thread per rank, process-group and mtdeepep
timeouts (30 s) shorter than a case's deadline, so a stuck collective reports its own error first."""

from __future__ import annotations

import pytest

from mtdeepep.utils.testing import RankPools

TIMEOUT_S = 30


@pytest.fixture(scope="module")
def ep_pools():
    """`ep_pools[n]`: the module's pool of `n` expert-parallel ranks."""
    pools = RankPools(
        timeout_s=4 * TIMEOUT_S, threads=1, pg_timeout_s=TIMEOUT_S,
        env={"GLOO_SOCKET_IFNAME": "lo", "MTDEEPEP_TIMEOUT_S": str(TIMEOUT_S)},
    )  # fmt: skip
    yield pools
    pools.close()
