"""Helpers shared by the benchmarks: time collectives, measure memcpy, save results.

Every benchmark runs its ranks with the one launcher, `mtdeepep.utils.testing.run_ranks`: processes of this host
(spawn) joined by gloo on 127.0.0.1, each with `max(1, cores // ranks)` intra-op threads, a deadline on the whole
run and the failing rank's traceback. Timing convention: before every iteration all ranks meet at a gloo barrier,
so they start the operation together; each rank times its own call with `time.perf_counter`, and the median over
iterations is that rank's time.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mtdeepep.utils.testing import num_cores, run_ranks, threads_per_rank

__all__ = ["num_cores", "run_ranks", "threads_per_rank"]  # re-exported: the benchmarks import them from here

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_int_list(text: str) -> list[int]:
    """'2,4' -> [2, 4]."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


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
