"""The suite's one rank-pool factory: every multi-process test reaches its rank processes through a fixture made here.

The launcher itself is `mtdeepep.utils.testing.RankPool` (spawned ranks, gloo on 127.0.0.1, a deadline on every
call); a pool starts once per test module and world size, at first use, and runs all the module's cases, because a
spawn costs seconds on this machine. What differs between folders is only the settings, named here:

- `comm_timeout_s`: the process group's and mtdeepep's own timeout inside the ranks (`MTDEEPEP_TIMEOUT_S`), one
  intra-op thread per rank. Set it below `deadline_s`, so that a stuck collective reports its own error (naming the
  rank or phase) before the pool's deadline kills the ranks with their stacks dumped.
- `device="cuda"`: the ranks share GPU 0 and pick mtdeepep's CUDA executor (`MTDEEPEP_DEVICE=cuda`).
- `world_size`: the fixture is that one pool instead of a `pools[world_size]` mapping.
- `engine="triton"`: the ranks pick the Triton executor (`MTDEEPEP_ENGINE=triton`) under Triton's interpreter
  (`TRITON_INTERPRET=1`, set before anything imports Triton).
"""

from __future__ import annotations

import pytest

from mtdeepep.utils.testing import RankPools


def pool_settings(*, deadline_s: float | None = None, comm_timeout_s: float | None = None,
                  pg_timeout_s: float | None = None, threads: int | None = None, start_timeout_s: float | None = None,
                  device: str | None = None, engine: str | None = None) -> dict:  # fmt: skip
    """The keyword arguments of `RankPools` for these settings (see the module docstring)."""
    settings: dict = {}
    env: dict[str, str] = {}
    if deadline_s is not None:
        settings["timeout_s"] = deadline_s
    if start_timeout_s is not None:
        settings["start_timeout_s"] = start_timeout_s
    if comm_timeout_s is not None:
        if deadline_s is not None and comm_timeout_s >= deadline_s:
            raise ValueError(f"comm_timeout_s ({comm_timeout_s}) must be below the deadline ({deadline_s})")
        # The ranks' own errors come first: gloo's and mtdeepep's timeouts end before the pool's deadline.
        settings["threads"] = 1
        settings["pg_timeout_s"] = comm_timeout_s
        env.update(GLOO_SOCKET_IFNAME="lo", MTDEEPEP_TIMEOUT_S=str(comm_timeout_s))
    if pg_timeout_s is not None:
        settings["pg_timeout_s"] = pg_timeout_s
    if threads is not None:
        settings["threads"] = threads
    if device is not None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        env["MTDEEPEP_DEVICE"] = device
    if engine is not None:
        env["MTDEEPEP_ENGINE"] = engine
        if engine == "triton" and device != "cuda":  # CPU tensors: Triton's interpreter
            env["TRITON_INTERPRET"] = "1"
    if env:
        settings["env"] = env
    return settings


def world_size_params(*sizes: int, quick: int = 2) -> list:
    """`sizes` as pytest (fixture) parameters, all but `quick` marked slow: on 2 cores a 4-rank pool costs a spawn
    and oversubscribed cases, so the edit-test loop (`-m 'not slow'`) runs 2 ranks; the whole suite runs them all."""
    return [pytest.param(n, marks=[] if n == quick else [pytest.mark.slow]) for n in sizes]


def pool_fixture(*, world_size: int | None = None, **settings):
    """A module-scoped fixture of rank pools with `settings` (the keywords of `pool_settings`): `fixture[n]` is the
    module's pool of `n` ranks, or the one pool of `world_size` ranks when it is given. Assign it to the fixture's
    name in a conftest or test module: `ep_pools = pool_fixture(comm_timeout_s=30, deadline_s=60)`."""
    kwargs = pool_settings(**settings)

    @pytest.fixture(scope="module")
    def rank_pools_fixture():
        pools = RankPools(**kwargs)
        try:
            yield pools if world_size is None else pools[world_size]
        finally:
            pools.close()

    return rank_pools_fixture
