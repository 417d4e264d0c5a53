"""Helpers shared by the benchmarks: start ranks, time collectives, measure memcpy, save results.

Every benchmark runs its ranks as processes of this host (torch.multiprocessing, spawn), joined by gloo on
127.0.0.1. Timing convention: before every iteration all ranks meet at a gloo barrier, so they start the
operation together; each rank times its own call with `time.perf_counter`, and the median over iterations is
that rank's time.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def num_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_rank(num_ranks: int) -> int:
    return max(1, num_cores() // num_ranks)


def parse_int_list(text: str) -> list[int]:
    """'2,4' -> [2, 4]."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, num_ranks: int, port: int, timeout_s: float) -> dist.ProcessGroup:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=num_ranks,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


def _rank_entry(rank: int, worker: Callable, num_ranks: int, port: int, args: tuple, results) -> None:
    """Runs `worker(rank, num_ranks, group, *args)` in a fresh process and sends its return value home."""
    torch.set_num_threads(threads_per_rank(num_ranks))
    group = init_gloo(rank, num_ranks, port, timeout_s=300)
    try:
        results.put((rank, worker(rank, num_ranks, group, *args)))
    finally:
        dist.destroy_process_group()


def run_ranks(worker: Callable, num_ranks: int, args: tuple = (), timeout_s: float = 600) -> list[Any]:
    """Runs `worker(rank, num_ranks, group, *args)` on `num_ranks` spawned processes; returns their results by rank.

    Each rank uses `max(1, cores // num_ranks)` intra-op threads. `worker` must be a module-level function and
    its result picklable. Raises if a rank fails or the ranks do not finish within `timeout_s`.
    """
    results = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        _rank_entry, args=(worker, num_ranks, free_port(), args, results), nprocs=num_ranks, join=False,
        start_method="spawn",
    )  # fmt: skip
    by_rank: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    done = False
    while not done:
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{num_ranks} ranks did not finish within {timeout_s:.0f} s")
        done = context.join(timeout=1.0)  # raises if a rank failed
        _drain(results, by_rank)
    _drain(results, by_rank)
    missing = sorted(set(range(num_ranks)) - set(by_rank))
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result")
    return [by_rank[r] for r in range(num_ranks)]


def _drain(results, by_rank: dict[int, Any]) -> None:
    while True:
        try:
            rank, value = results.get(timeout=0.1)
        except queue.Empty:
            return
        by_rank[rank] = value


def time_interleaved(
    fns: dict[str, Callable[[], Any]], iters: int, warmup: int, group: dist.ProcessGroup
) -> dict[str, list[float]]:
    """Seconds per call of every function in `fns`, alternating them iteration by iteration.

    Each call is preceded by a barrier of `group`, so every rank starts it together; the call's result is freed
    after the clock stops (for every function alike). Alternating makes slow drifts of a noisy machine hit all
    functions equally. The first `warmup` iterations are not recorded.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for iteration in range(warmup + iters):
        for name, fn in fns.items():
            dist.barrier(group=group)
            start = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - start
            del result
            if iteration >= warmup:
                times[name].append(elapsed)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def memcpy_seconds(num_bytes: int, iters: int, warmup: int = 2) -> float:
    """Median time of one single-threaded `copy_` of `num_bytes` between two pre-faulted uint8 tensors."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.zeros(num_bytes, dtype=torch.uint8)
        samples = []
        for iteration in range(warmup + iters):
            start = time.perf_counter()
            dst.copy_(src)
            if iteration >= warmup:
                samples.append(time.perf_counter() - start)
        return median(samples)
    finally:
        torch.set_num_threads(previous)


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9


def environment() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "cores": num_cores(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table; a column is right-aligned when its cells are numbers (optionally ending in x or %)."""
    columns = list(zip(headers, *rows))
    widths = [max(len(str(cell)) for cell in column) for column in columns]
    numeric = [all(_is_number(cell) for cell in column[1:]) for column in columns]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(cell).rjust(width) if right else str(cell).ljust(width)
            for cell, width, right in zip(cells, widths, numeric)
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def _is_number(cell: str) -> bool:
    try:
        float(str(cell).rstrip("x%"))
        return True
    except ValueError:
        return False
