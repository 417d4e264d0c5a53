"""The clients' rank processes: 2 ranks, started once per test module and running all its cases."""

from __future__ import annotations

from ..ranks import pool_fixture

# The module's `RankPool` of 2 ranks (gloo on 127.0.0.1); a case may run 180 s.
pool = pool_fixture(world_size=2, deadline_s=180)
