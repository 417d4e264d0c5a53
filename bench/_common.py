"""Helpers shared by the benchmarks: the config fields they share (`BenchConfig`, `MoELayerBenchConfig`) and the
parser built from a config (`config_parser`), random routing, the gloo all-to-all of the baselines, timing (one
rank's medians, the slowest rank's row), memcpy, the table and the JSON results.

Every benchmark runs its ranks with the one launcher, `mtdeepep.utils.testing.run_ranks`: processes of this host
(spawn) joined by gloo on 127.0.0.1, each with `max(1, cores // ranks)` intra-op threads, a deadline on the whole
run and the failing rank's traceback. Timing convention: before every iteration all ranks meet at a gloo barrier,
so they start the operation together; each rank times its own call with `time.perf_counter`, and the median over
iterations is that rank's time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mtdeepep.utils.testing import num_cores, run_ranks, threads_per_rank

__all__ = ["num_cores", "run_ranks", "threads_per_rank"]  # re-exported: the benchmarks import them from here

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def environment_variables(values: dict[str, str]):
    """Set `values` in os.environ (inherited by processes started meanwhile), then restore it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass(frozen=True)
class BenchConfig:
    """What the dispatch and MoE-layer benchmarks share: `tokens` per rank of `hidden` channels, each routed to `topk`
    experts, timed over `iters` calls after `warmup` untimed ones. The defaults are upstream DeepEP's normal-mode
    benchmark (4096 x 7168, top-8). A benchmark subclasses it with its own fields (the experts among them: some count
    them in all, some per rank) and redeclares the defaults its setting changes."""

    tokens: int = 4096
    hidden: int = 7168
    topk: int = 8
    iters: int = 10
    warmup: int = 2


@dataclass(frozen=True)
class MoELayerBenchConfig(BenchConfig):
    """One small MoE layer on the CPU (bench/moe_layer.py, moe_replication.py, moe_recompute.py): 2048 tokens per
    rank, hidden 1024, top-4 of 16 experts, expert FFN hidden 512, float32."""

    tokens: int = 2048
    hidden: int = 1024
    topk: int = 4
    iters: int = 5
    warmup: int = 1
    ffn: int = 512
    experts: int = 16
    seed: int = 0


# Other spellings of some options, kept because commands and scripts use them: the DeepEP-style benchmarks called
# their fields `num_tokens`, `num_experts` and `num_topk`.
OPTION_ALIASES = {"tokens": ("--num-tokens",), "experts": ("--num-experts",), "topk": ("--num-topk",)}

# Help texts of the common options (a benchmark's `helps` override them).
COMMON_HELP = {
    "tokens": "tokens per rank",
    "hidden": "hidden size",
    "topk": "experts per token",
    "experts": "routed experts in all",
    "ffn": "expert FFN hidden size",
    "iters": "timed iterations per operation",
    "warmup": "untimed iterations per operation",
    "seed": "seed of the inputs",
}


def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of the benchmark's docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_config_arguments(
    parser: argparse.ArgumentParser,
    defaults: Any,
    names: Iterable[str] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """One option `--field-name` per field of the dataclass `defaults` in `names` (default: all, in order), typed
    and defaulted from it (plus its `OPTION_ALIASES`); `helps` gives some of them a help text (over
    `COMMON_HELP`)."""
    helps = {**COMMON_HELP, **(helps or {})}
    for name in names if names is not None else [f.name for f in fields(defaults)]:
        default = getattr(defaults, name)
        flags = (f"--{name.replace('_', '-')}", *OPTION_ALIASES.get(name, ()))
        parser.add_argument(*flags, dest=name, type=type(default), default=default, help=helps.get(name))


def add_rank_counts(
    parser: argparse.ArgumentParser, default: str, flag: str = "--num-ranks", what: str = "rank counts"
):
    """The option of the rank counts (or EP sizes) a benchmark runs, comma-separated: a list of ints."""
    parser.add_argument(flag, type=parse_int_list, default=parse_int_list(default),
                        help=f"comma-separated {what} (default: {default})")  # fmt: skip


def add_json_option(parser: argparse.ArgumentParser, name: str, *aliases: str, help: str | None = None) -> None:
    """`--json PATH` (and `aliases`), where the results go: `bench/results/NAME.json` by default."""
    parser.add_argument("--json", *aliases, dest="json", type=Path, default=RESULTS_DIR / f"{name}.json", help=help)


def config_parser(
    doc: str,
    defaults: Any,
    names: Iterable[str] | None = None,
    helps: Mapping[str, str] | None = None,
    results: str | None = None,
    ranks: str | None = None,
) -> argparse.ArgumentParser:
    """A benchmark's parser (`make_parser`): `--num-ranks` when `ranks` gives its default (`add_rank_counts`), the
    options of the config dataclass `defaults` (`add_config_arguments`), then `--json` when `results` names the
    results file (`add_json_option`). The benchmark adds its own options, then `config_from_args` builds its config."""
    parser = make_parser(doc)
    if ranks is not None:
        add_rank_counts(parser, ranks)
    add_config_arguments(parser, defaults, names, helps)
    if results is not None:
        add_json_option(parser, results)
    return parser


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass `cls` with every field that `args` holds taken from it (the others keep their defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


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


def medians(samples: Mapping[str, Any]) -> dict[str, Any]:
    """The same (nested) dict with every list of samples replaced by its median."""
    return {key: medians(value) if isinstance(value, Mapping) else median(value) for key, value in samples.items()}


def time_variants(
    fns: dict[str, Callable[[], Any]], iters: int, warmup: int, group: dist.ProcessGroup
) -> dict[str, dict[str, Any]]:
    """`time_interleaved`, then a barrier: `{"seconds": {name: median}, "samples": {name: [seconds]}}`."""
    samples = time_interleaved(fns, iters, warmup, group)
    dist.barrier(group=group)
    return {"seconds": medians(samples), "samples": samples}


@dataclass
class OpCase:
    """One timed operation: each implementation as a closure, the bytes that count, the parity check's result."""

    op: str
    num_bytes: Any  # what the benchmark counts: a number of bytes, or a dict of them
    fns: dict[str, Callable[[], Any]]
    parity: dict[str, Any]


def time_cases(cases: Sequence[OpCase], iters: int, warmup: int, group: dist.ProcessGroup) -> dict[str, Any]:
    """Times each case's implementations interleaved (case after case), then a barrier. One rank's result:
    `{"bytes": {op: ...}, "seconds": {op: {impl: median}}, "samples": {op: {impl: [seconds]}}, "parity": {op: ...}}`."""
    samples = {case.op: time_interleaved(case.fns, iters, warmup, group) for case in cases}
    dist.barrier(group=group)
    return {
        "bytes": {case.op: case.num_bytes for case in cases},
        "seconds": medians(samples),
        "samples": samples,
        "parity": {case.op: case.parity for case in cases},
    }


def slowest_rank(seconds: Sequence[float]) -> int:
    """The rank with the largest median time (the first of them on a tie)."""
    return max(range(len(seconds)), key=seconds.__getitem__)


def slowest_gbps(bytes_per_rank: Sequence[int], seconds: Sequence[float], slowest: int) -> dict[str, float]:
    return {"gbps": gbps(bytes_per_rank[slowest], seconds[slowest])}


UNIT_SCALE = {"ms": 1e3, "us": 1e6}


def slowest_rank_timing(
    per_rank: Sequence[dict[str, Any]],
    op: str,
    impl: str,
    unit: str = "ms",
    rates: Callable[[Sequence[Any], Sequence[float], int], dict[str, float]] = slowest_gbps,
) -> dict[str, Any]:
    """One implementation's numbers for one op, from the ranks' `time_cases` results: the slowest rank, its median
    time in `unit`, `rates(bytes per rank, seconds per rank, slowest rank)`, every rank's median and samples."""
    scale = UNIT_SCALE[unit]
    seconds = [r["seconds"][op][impl] for r in per_rank]
    slowest = slowest_rank(seconds)
    return {
        "slowest_rank": slowest,
        f"time_{unit}": seconds[slowest] * scale,
        **rates([r["bytes"][op] for r in per_rank], seconds, slowest),
        f"per_rank_{unit}": [s * scale for s in seconds],
        f"samples_{unit}": [[s * scale for s in r["samples"][op][impl]] for r in per_rank],
    }


def combine_parity(rows: Sequence[dict[str, Any]], inexact: str) -> str:
    """'bit-exact' when every rank's combine matched the baseline bit for bit, else `inexact` with the worst diff."""
    combines = [parity for row in rows if row["op"].startswith("combine") for parity in row["parity"]]
    if all(parity["bit_exact"] for parity in combines):
        return "bit-exact"
    return f"{inexact} (max |diff| {max(parity['max_abs_diff'] for parity in combines):g})"


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


def random_routing(
    num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int, skewed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random activations and routing: `(x [T, H] bfloat16, topk_idx [T, K] int64, topk_weights [T, K] float32)`,
    each token taking the top-k of random expert scores, weighted by the softmax of those scores. `skewed`: the
    scores scaled by a factor falling from 4 to 1/4 across the experts (the first experts take most tokens)."""
    gen = torch.Generator().manual_seed(seed)
    x_TH = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    scores_TE = torch.rand(num_tokens, num_experts, generator=gen)
    if skewed:
        scores_TE = scores_TE * torch.logspace(2, -2, num_experts, base=2.0)
    top_scores_TK, topk_idx_TK = scores_TE.topk(num_topk, dim=1)
    return x_TH, topk_idx_TK, top_scores_TK.softmax(dim=1)


def exchange_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single of 2-D rows of any dtype (moved as bytes: gloo has no float8)."""
    out = rows.new_empty((sum(recv_splits), rows.size(1)))
    dist.all_to_all_single(
        out.view(torch.uint8), rows.contiguous().view(torch.uint8), recv_splits, send_splits, group=group
    )
    return out


def train_step(layer: torch.nn.Module, x_TH: torch.Tensor, grad_TH: torch.Tensor, optimizer=None):
    """One forward + backward (+ the optimizer's step) of an MoE layer, its parameter grads set to None first;
    returns `(output [T, H], input grad [T, H])`, both float32."""
    for param in layer.parameters():
        param.grad = None
    x_in = x_TH.detach().requires_grad_()
    out_TH = layer(x_in)
    out_TH.backward(grad_TH)
    if optimizer is not None:
        optimizer.step()
    return out_TH.detach(), x_in.grad


def save_results(path: Path, payload: dict[str, Any]) -> None:
    """Writes the JSON and says where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def save_run(path: Path, args: argparse.Namespace, **payload: Any) -> None:
    """Writes a run's JSON (`save_results`): its command-line arguments as strings, then `payload` in order, then
    the `environment()`."""
    save_results(path, {"args": {k: str(v) for k, v in vars(args).items()}, **payload, "environment": environment()})


def add_pipeline_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a pipeline benchmark's training run (bench/pipeline.py, bench/dualpipe_overlap.py): its
    micro-batches, their shape, the steps timed after the warm-up ones, the seed."""
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)


def parse_choices(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'), each one of `allowed` (else argparse's error for an option's type)."""
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values or any(v not in allowed for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {allowed}, got {text!r}")
    return values


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *notes: str) -> None:
    """The table, then the notes under it, a line each."""
    print(format_table(headers, rows))
    for note in notes:
        print(note)


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


def short_run(doc: dict[str, Any], **training: Any) -> dict[str, Any]:
    """A train.py config document (either layout) as a short benchmark run's, in the trainer's tables: `training`
    into [training], one warm-up step ([optimizer]) and no checkpoint but the last ([checkpoint]). The keys go to
    their own tables: train.py refuses a key given in [training] and in its table (an [optimizer] warmup_steps)."""
    # imported here: the communication benchmarks share this module and need not load the trainer
    from moe.trainer.train.training_config import split_moved

    doc, _ = split_moved(doc)
    doc["training"].update(training)
    doc.setdefault("optimizer", {})["warmup_steps"] = 1
    doc.setdefault("checkpoint", {})["checkpoint_every"] = 0
    return doc
