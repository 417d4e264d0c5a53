"""The one launcher for multi-process tests: rank processes start once per test module and run many cases.

`RankPool(world_size)` spawns `world_size` processes (torch.multiprocessing, spawn) that join a gloo group on
127.0.0.1 with a free port, then wait for cases. `pool.run(case, *args)` runs `case(ctx, *args)` on every rank
and returns the per-rank results, or raises with each failing rank's traceback. Every wait has a deadline: a
case that hangs kills the pool and fails the test instead of hanging the suite.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RankContext:
    """What a case sees inside a rank process. `cache` survives between cases of the same pool."""

    rank: int
    world_size: int
    group: dist.ProcessGroup
    cache: dict[str, Any] = field(default_factory=dict)


def _worker(rank: int, world_size: int, port: int, tasks, results, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ctx = RankContext(rank, world_size, dist.group.WORLD)
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, function_name, args = task
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            results.put((rank, True, function(ctx, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, timeout_s: float = 120.0) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        threads = max(1, (os.cpu_count() or 1) // world_size)
        port = free_port()
        self.processes = [
            context.Process(
                target=_worker, args=(rank, world_size, port, self.tasks[rank], self.results, threads), daemon=True
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def run(self, case, *args, timeout_s: float | None = None) -> list[Any]:
        """Runs `case(ctx, *args)` on every rank; returns the results ordered by rank."""
        for task_queue in self.tasks:
            task_queue.put((case.__module__, case.__name__, args))
        deadline = timeout_s or self.timeout_s
        outcomes: dict[int, tuple[bool, Any]] = {}
        waited = 0.0
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
                continue
            except queue.Empty:
                waited += 1.0
            dead = [r for r, p in enumerate(self.processes) if not p.is_alive() and r not in outcomes]
            if dead or waited > deadline:
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                self.close(force=True)
                reason = f"exited (ranks {dead})" if dead else f"timed out after {deadline} s"
                raise AssertionError(f"{case.__name__}: rank processes {reason}; no result from ranks {missing}")
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if failures:
            raise AssertionError(f"{case.__name__} failed:\n" + "\n".join(failures))
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for task_queue in self.tasks:
                task_queue.put(None)
            for process in self.processes:
                process.join(timeout=30)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
