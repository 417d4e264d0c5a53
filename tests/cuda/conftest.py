"""Fixtures of the GPU tests (see gpu.py): `cuda_pools`, rank processes that share the one GPU, started once per
module and world size through the one launcher. mtdeepep's timeout in the ranks (`gpu.TIMEOUT_S`) and the process
group's are shorter than a case's deadline, so a stuck kernel reports its own `CommTimeoutError` first, and a hung
rank is killed at the deadline with its stack dumped."""

from __future__ import annotations

import pytest

from mtdeepep.utils.testing import RankPools

from .gpu import TIMEOUT_S


@pytest.fixture(scope="module")
def cuda_pools():
    """`cuda_pools[n]`: the module's pool of `n` rank processes on GPU 0 (spawned at first use)."""
    pools = RankPools(
        timeout_s=4 * TIMEOUT_S, start_timeout_s=120, threads=2, pg_timeout_s=2 * TIMEOUT_S,
        env={"GLOO_SOCKET_IFNAME": "lo", "MTDEEPEP_TIMEOUT_S": str(TIMEOUT_S), "MTDEEPEP_DEVICE": "cuda"},
    )  # fmt: skip
    yield pools
    pools.close()
