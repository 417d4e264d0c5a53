"""Forward+backward throughput of the MoE layer at expert-parallel 1, 2 and 4: the 'flex' dispatcher (mtdeepep)
against the 'alltoall' baseline, and grouped vs padded-batch vs loop experts.

Setting (modest, for a small CPU; every size is a flag): hidden 1024, expert FFN 512, 16 experts, top-4 softmax
routing, 2048 tokens per rank, float32, dropless, no shared expert. One process per EP rank (torch.multiprocessing
spawn, gloo on 127.0.0.1, joined with a timeout); EP 1 is one process with a one-rank group, so 'flex' still goes
through an `mtdeepep.Buffer` (one rank) and 'alltoall' through its single-process path.

Variants (table rows): every dispatcher with grouped experts, then the 'flex' dispatcher with every other expert
implementation ('padded' = one `torch.bmm` over experts padded to the largest count, dropless; 'loop' = one matmul
per expert). `--grid` runs every (dispatcher, experts) pair instead. All variants hold the same weights and see the
same tokens; before timing, each variant's output and input gradient are compared with the first variant's.

Timing: one iteration = parameter grads set to None, `out = layer(x)`, `out.backward(grad_out)`; a gloo barrier
before every iteration so all ranks start together; variants alternate iteration by iteration (drifts of a noisy
machine hit them alike); each rank's median over `--iters` iterations after `--warmup`. The table shows the slowest
rank's median and tokens/s = tokens of all ranks / that time. Every rank runs `max(1, cores // ranks)` intra-op
threads (EP 4 on 2 cores oversubscribes: ranks take turns).

Run (about 2 minutes on a 2-core machine):

    .venv/bin/python bench/moe_layer.py                    # EP 1, 2, 4; table + bench/results/moe_layer.json
    .venv/bin/python bench/moe_layer.py --ep 2 --tokens 512 --iters 3

Legend: T tokens per rank, H hidden, F expert FFN hidden, E experts, K top-k, R ranks (EP size).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    RESULTS_DIR,
    add_config_arguments,
    config_from_args,
    environment,
    make_parser,
    num_cores,
    parse_int_list,
    print_table,
    run_ranks,
    save_results,
    slowest_rank,
    threads_per_rank,
    time_variants,
    train_step,
)

from moe import MoEConfig, MoELayer

DISPATCHERS = ("alltoall", "flex")
EXPERT_IMPLS = ("grouped", "padded", "loop")


@dataclass(frozen=True)
class BenchConfig:
    tokens: int = 2048
    hidden: int = 1024
    ffn: int = 512
    experts: int = 16
    topk: int = 4
    dispatchers: tuple[str, ...] = DISPATCHERS
    expert_impls: tuple[str, ...] = EXPERT_IMPLS
    grid: bool = False
    iters: int = 5
    warmup: int = 1
    seed: int = 0

    def variants(self) -> list[tuple[str, str]]:
        """(dispatcher, experts) pairs: each dispatcher with the first expert implementation, then the last
        dispatcher with each other implementation (or every pair with `grid`)."""
        if self.grid:
            return [(d, e) for d in self.dispatchers for e in self.expert_impls]
        first = [(d, self.expert_impls[0]) for d in self.dispatchers]
        return first + [(self.dispatchers[-1], e) for e in self.expert_impls[1:]]


def variant_name(dispatcher: str, experts: str) -> str:
    return f"{dispatcher}/{experts}"


# ---------------------------------------------------------------------------------------------------------------
# One rank


def build_layer(cfg: BenchConfig, dispatcher: str, experts: str, group: dist.ProcessGroup) -> MoELayer:
    """The same router and expert weights for every variant (same seed; each rank holds its own experts)."""
    config = MoEConfig(
        hidden_size=cfg.hidden,
        num_moe_experts=cfg.experts,
        moe_ffn_hidden_size=cfg.ffn,
        moe_router_topk=cfg.topk,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=experts != "loop",
        moe_padded_batch_gemm=experts == "padded",
    )
    torch.manual_seed(cfg.seed)
    return MoELayer(config, ep_group=group)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def bench_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Builds every variant, checks them against the first one, then times them interleaved."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    x_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    grad_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    layers = {variant_name(d, e): build_layer(cfg, d, e, group) for d, e in cfg.variants()}

    # Parity (also the first warm-up): every rank runs every variant once, in the same order.
    parity, reference, dropped = {}, None, {}
    for name, layer in layers.items():
        out_TH, x_grad_TH = train_step(layer, x_TH, grad_TH)
        if reference is None:
            reference = (out_TH, x_grad_TH)
        parity[name] = {
            "output_rel_err": relative_error(out_TH, reference[0]),
            "x_grad_rel_err": relative_error(x_grad_TH, reference[1]),
        }
        dropped[name] = layer.metrics.num_dropped_tokens
    del reference

    fns = {name: (lambda layer=layer: train_step(layer, x_TH, grad_TH)) for name, layer in layers.items()}
    return {**time_variants(fns, cfg.iters, cfg.warmup, group), "parity": parity, "dropped": dropped}


# ---------------------------------------------------------------------------------------------------------------
# Report


def summarize(cfg: BenchConfig, num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant: the slowest rank's median time and the group's tokens/s."""
    rows = []
    baseline = variant_name(*cfg.variants()[0])
    for dispatcher, experts in cfg.variants():
        name = variant_name(dispatcher, experts)
        seconds = [r["seconds"][name] for r in per_rank]
        slowest = slowest_rank(seconds)
        rows.append(
            {
                "ep": num_ranks,
                "dispatcher": dispatcher,
                "experts": experts,
                "time_ms": seconds[slowest] * 1e3,
                "slowest_rank": slowest,
                "tokens_per_s": cfg.tokens * num_ranks / seconds[slowest],
                "per_rank_ms": [s * 1e3 for s in seconds],
                "samples_ms": [[s * 1e3 for s in r["samples"][name]] for r in per_rank],
                "parity_vs_" + baseline: [r["parity"][name] for r in per_rank],
                "dropped_slots": [r["dropped"][name] for r in per_rank],
            }
        )
    base_ms = rows[0]["time_ms"]
    for row in rows:
        row["speedup_vs_" + baseline] = base_ms / row["time_ms"]
    return rows


TABLE_HEADERS = ("EP", "dispatcher", "experts", "fwd+bwd ms", "tokens/s", "vs first row")


def table_row(row: dict[str, Any]) -> list[str]:
    speedup = next(v for k, v in row.items() if k.startswith("speedup_vs_"))
    return [
        str(row["ep"]),
        row["dispatcher"],
        row["experts"],
        f"{row['time_ms']:.1f}",
        f"{row['tokens_per_s']:.0f}",
        f"{speedup:.2f}x",
    ]


def worst_parity(rows: list[dict[str, Any]]) -> float:
    return max(
        max(p["output_rel_err"], p["x_grad_rel_err"])
        for row in rows
        for key, per_rank in row.items()
        if key.startswith("parity_vs_")
        for p in per_rank
    )


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def _choices(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values or any(v not in allowed for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {allowed}, got {text!r}")
    return values


def parse_args() -> argparse.Namespace:
    defaults = BenchConfig()
    parser = make_parser(__doc__)
    parser.add_argument("--ep", default="1,2,4", help="comma-separated expert-parallel sizes (default: 1,2,4)")
    helps = {
        "tokens": "tokens per rank",
        "ffn": "expert FFN hidden size",
        "experts": "routed experts in total",
        "iters": "timed iterations per variant",
        "warmup": "untimed iterations per variant",
    }
    add_config_arguments(parser, defaults, ("tokens", "hidden", "ffn", "experts", "topk"), helps)
    parser.add_argument(
        "--dispatchers",
        type=lambda s: _choices(s, DISPATCHERS),
        default=defaults.dispatchers,
        help="comma-separated, the first is the baseline (default: alltoall,flex)",
    )
    parser.add_argument(
        "--expert-impls",
        type=lambda s: _choices(s, EXPERT_IMPLS),
        default=defaults.expert_impls,
        help="comma-separated (default: grouped,padded,loop)",
    )
    parser.add_argument("--grid", action="store_true", help="every (dispatcher, experts) pair")
    add_config_arguments(parser, defaults, ("iters", "warmup", "seed"), helps)
    parser.add_argument("--timeout", type=float, default=400, help="seconds allowed per EP size")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "moe_layer.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cfg = config_from_args(BenchConfig, args)
    ep_sizes = parse_int_list(args.ep)
    rows, wall = [], {}
    for num_ranks in ep_sizes:
        start = time.perf_counter()
        per_rank = run_ranks(bench_rank, num_ranks, (cfg,), timeout_s=args.timeout)
        wall[num_ranks] = time.perf_counter() - start
        rows.extend(summarize(cfg, num_ranks, per_rank))

    threads = {n: threads_per_rank(n) for n in ep_sizes}
    print(
        f"T={cfg.tokens} per rank, H={cfg.hidden}, F={cfg.ffn}, E={cfg.experts}, K={cfg.topk}, float32, dropless; "
        f"{num_cores()} cores, threads per rank {threads}; median of {cfg.iters} iterations after {cfg.warmup} "
        f"warm-up(s); slowest rank"
    )
    worst = worst_parity(rows)
    print_table(
        TABLE_HEADERS,
        [table_row(row) for row in rows],
        "'vs first row' = time of the first row of the same EP size / this row's time. Parity with the first "
        f"variant (output and input grad, every rank): worst relative error {worst:.1e}",
    )
    save_results(
        args.json,
        {
            "config": asdict(cfg),
            "threads_per_rank": threads,
            "wall_seconds_per_ep": wall,
            "environment": environment(),
            "rows": rows,
        },
    )
    if worst > 1e-4:
        raise SystemExit(f"parity check failed: relative error {worst:.1e} > 1e-4")


if __name__ == "__main__":
    main()
