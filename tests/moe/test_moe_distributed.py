"""Expert parallelism over gloo: EP 2 and EP 4 against EP 1, every dispatcher, the global aux loss; the 'flex'
(mtdeepep) cases also on a one-rank group (a real `mtdeepep.Buffer` with a single rank).

The rank processes start once per world size (a module-scoped fixture, `torch.multiprocessing` spawn, gloo on
127.0.0.1) and run every case of `moe_dist_cases.CASES`; each case is its own pytest test and reports every
rank's traceback on failure. Every wait has a deadline, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import queue
import socket
import time

import pytest
import torch.multiprocessing as mp
from moe_dist_cases import CASES, worker

pytestmark = pytest.mark.timeout(300)

START_TIMEOUT_S = 90
CASE_TIMEOUT_S = 60  # longer than the process group's 30 s timeout, so stuck collectives report first
JOIN_TIMEOUT_S = 20


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class World:
    """`size` rank processes that run named cases on request."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list = []
        self.broken: str | None = None
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(self.size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(target=worker, args=(r, self.size, port, self.tasks[r], self.results), daemon=True)
            for r in range(self.size)
        ]
        for p in self.procs:
            p.start()
        self.broken = None
        errors = self._collect("__ready__", START_TIMEOUT_S)
        if errors:
            self.broken = "start-up failed"
            pytest.fail(f"EP{self.size} world failed to start:\n" + "\n".join(errors))

    def _collect(self, name: str, timeout: float) -> list[str]:
        """Wait for every rank's report on `name`; returns error strings (tracebacks, timeouts, dead ranks)."""
        pending, errors = set(range(self.size)), []
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            dead = [r for r in pending if not self.procs[r].is_alive()]
            if left <= 0 or dead:
                # Drain what already arrived before declaring the rest missing.
                try:
                    got_name, rank, err = self.results.get(timeout=1)
                except queue.Empty:
                    reason = "died" if dead else f"no report within {timeout:.0f} s"
                    errors += [f"rank {r}: {reason}" for r in sorted(pending)]
                    self.broken = f"case {name!r} did not finish on ranks {sorted(pending)}"
                    return errors
            else:
                try:
                    got_name, rank, err = self.results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
            if got_name != name:
                errors.append(f"rank {rank}: late report for {got_name!r}")
                continue
            pending.discard(rank)
            if err is not None:
                errors.append(f"rank {rank}:\n{err}")
        return errors

    def run(self, name: str) -> None:
        if self.broken is not None:  # an earlier case left the world unusable: start a fresh one
            self.close()
            self._start()
        for q in self.tasks:
            q.put(name)
        errors = self._collect(name, CASE_TIMEOUT_S)
        if errors:
            if self.broken is None and any("Timeout" in e or "timed out" in e for e in errors):
                self.broken = f"case {name!r} timed out in a collective"
            pytest.fail(f"case {name!r} failed on EP{self.size}:\n" + "\n".join(errors), pytrace=False)

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=JOIN_TIMEOUT_S)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        stuck = [p.pid for p in self.procs if p.is_alive()]
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []
        assert not stuck, f"rank processes {stuck} did not exit"


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def world(request):
    w = World(request.param)
    yield w
    w.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_case(world, case):
    world.run(case)


@pytest.fixture(scope="module")
def world1():
    w = World(1)
    yield w
    w.close()


@pytest.mark.parametrize("case", sorted(name for name in CASES if "flex" in name))
def test_flex_on_one_rank_group(world1, case):
    world1.run(case)
