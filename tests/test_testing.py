"""The launcher itself (`mtdeepep.utils.testing`): results by rank, the failing rank's traceback, deadlines, restart
after a broken case, hand-rolled processes that die or hang, and ranks forked (not spawned) with the caller's
environment."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from mtdeepep.utils.testing import START_METHOD_ENV, RankFailure, RankPool, run_processes, run_ranks, start_counts

pytestmark = pytest.mark.timeout(120)


def _sum_of_ranks(ctx, offset):
    value = torch.tensor([ctx.rank + offset])
    dist.all_reduce(value, group=ctx.group)
    ctx.cache["calls"] = ctx.cache.get("calls", 0) + 1
    return value.item(), ctx.cache["calls"], os.getpid()


def _fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("bad input on rank 1")
    return "ok"


def _hangs_on_rank_0(ctx):
    if ctx.rank == 0:
        time.sleep(60)


def _exits_on_rank_1(ctx):
    if ctx.rank == 1:
        os._exit(3)


@pytest.mark.slow  # slow: pool start and a failing case
def test_pool_runs_cases_and_reports_the_failing_rank():
    with RankPool(2, timeout_s=30) as pool:
        first = pool.run(_sum_of_ranks, 10)
        assert [r[:2] for r in first] == [(21, 1), (21, 1)]
        with pytest.raises(RankFailure, match=r"(?s)--- rank 1 ---.*ValueError: bad input on rank 1") as info:
            pool.run(_fails_on_rank_1)
        assert "--- rank 0 ---" not in str(info.value)
        again = pool.run(_sum_of_ranks, 0)  # the same processes go on, with their cache
        assert [r[:2] for r in again] == [(1, 2), (1, 2)] and [r[2] for r in again] == [r[2] for r in first]


@pytest.mark.slow  # slow: pool restarts
def test_a_broken_case_fails_then_the_pool_restarts():
    with RankPool(2, timeout_s=2) as pool:
        for case, message in [(_hangs_on_rank_0, r"timed out after 2 s; no result from ranks \[0\]"),
                              (_exits_on_rank_1, r"exit codes \{1: 3\}")]:  # fmt: skip
            pids = pool.pids
            start = time.monotonic()
            with pytest.raises(RankFailure, match=message):
                pool.run(case)
            assert time.monotonic() - start < 15
            assert [r[0] for r in pool.run(_sum_of_ranks, 0)] == [1, 1]
            assert set(pool.pids).isdisjoint(pids)


def _rank_and_size(rank, world_size, group, extra):
    return rank, world_size, group.size(), extra


@pytest.mark.slow  # slow: one-shot spawns
def test_run_ranks_passes_rank_size_group_and_args():
    assert run_ranks(_rank_and_size, 2, ("x",), timeout_s=60) == [(0, 2, 2, "x"), (1, 2, 2, "x")]


def _send_then_die(proc):
    proc.send(("before", proc.rank))
    if proc.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return "done"


def _raises(proc):
    raise RuntimeError(f"process {proc.rank} broke")


def _hangs(proc):
    time.sleep(60)


@pytest.mark.slow  # slow: many one-shot spawns
def test_run_processes_collects_values_exit_codes_and_failures():
    finished = run_processes(_send_then_die, 2, timeout_s=60)
    assert finished.values == {0: [("before", 0), "done"], 1: [("before", 1)]}
    assert finished.exitcodes == [0, -signal.SIGKILL] and len(set(finished.pids)) == 2
    with pytest.raises(RankFailure, match="RuntimeError: process 0 broke"):
        run_processes(_raises, 1, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"processes \[0\] did not finish within 1 s"):
        run_processes(_hangs, 1, timeout_s=1)
    assert time.monotonic() - start < 15


def _environment_of(proc, names):
    return {name: os.environ.get(name) for name in names}


def test_ranks_are_forked_with_the_callers_environment(monkeypatch, tmp_path):
    """A variable set (or removed) after the fork server started reaches the forked ranks, which are still forked;
    only one that the server's preloaded modules read at import (torch's, ...) makes the launch spawn, counted with
    its name. Before: any difference from the server's environment spawned silently, ~2.5 s of CPU per rank."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    names = ("MTDEEPEP_TEST_PROBE", "TORCH_MTDEEPEP_TEST_PROBE")
    run_processes(_environment_of, 1, (names,), timeout_s=60)  # the fork server runs from here on
    before = start_counts()
    monkeypatch.setenv("MTDEEPEP_TEST_PROBE", "forked")
    # What a torch.compile in the caller leaves behind (tests/models/test_dsv3_compile.py spawned every later launch
    # of a full run): variables torch reads when it uses them, not at import.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "1")
    finished = run_processes(_environment_of, 2, (names,), timeout_s=60)
    assert finished.values == {
        r: [{"MTDEEPEP_TEST_PROBE": "forked", "TORCH_MTDEEPEP_TEST_PROBE": None}] for r in (0, 1)
    }
    after = start_counts()
    assert after.get("forkserver", 0) == before.get("forkserver", 0) + 2, (before, after)
    assert {k: v for k, v in after.items() if k.startswith("spawn")} == {
        k: v for k, v in before.items() if k.startswith("spawn")
    }
    monkeypatch.setenv("TORCH_MTDEEPEP_TEST_PROBE", "1")
    monkeypatch.delenv("MTDEEPEP_TEST_PROBE")
    finished = run_processes(_environment_of, 1, (names,), timeout_s=60)
    assert finished.values == {0: [{"MTDEEPEP_TEST_PROBE": None, "TORCH_MTDEEPEP_TEST_PROBE": "1"}]}
    why = "spawn: the fork server's import-time variables differ: TORCH_MTDEEPEP_TEST_PROBE"
    assert start_counts().get(why, 0) == after.get(why, 0) + 1, start_counts()


def _prints(proc, text):
    print(f"{text} from rank {proc.rank}", flush=True)
    print(f"{text} on stderr from rank {proc.rank}", file=sys.stderr, flush=True)


def test_forked_ranks_print_to_the_callers_streams(monkeypatch, capfd):
    """A forked rank writes to its caller's standard output and error as they are at the launch, not to the fork
    server's (those of the moment it started: under pytest, the capture file of whichever test started it; before,
    a rank's prints missed the test that launched it and tests reading them through capfd failed)."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    with capfd.disabled():  # the fork server (if this starts it) gets other streams than the launches below
        run_processes(_prints, 1, ("warm-up",), timeout_s=60)
    before = start_counts().get("forkserver", 0)
    run_processes(_prints, 2, ("hello",), timeout_s=60)
    assert start_counts().get("forkserver", 0) == before + 2  # forked, not spawned
    out, err = capfd.readouterr()
    assert "hello from rank 0" in out and "hello from rank 1" in out, out
    assert "hello on stderr from rank 1" in err, err
