"""Rank pools for the expert-parallel cases of moe_dist_cases.py: one intra-op thread per rank, and process-group
and mtdeepep timeouts (30 s) shorter than a case's deadline (60 s), so a stuck collective reports its own error
first."""

from __future__ import annotations

from ..ranks import pool_fixture

TIMEOUT_S = 30

# `ep_pools[n]`: the module's pool of `n` expert-parallel ranks.
ep_pools = pool_fixture(comm_timeout_s=TIMEOUT_S, deadline_s=2 * TIMEOUT_S)
