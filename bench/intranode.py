"""Intranode dispatch/combine bandwidth of mtdeepep's CPU shared-memory executor, against two baselines.

Setting (upstream DeepEP's intranode benchmark): 4096 tokens per rank, hidden 7168, top-8 of 256 experts
with random routing (per token, the top-8 of random scores), at 2 and 4 ranks of this host. Three operations:

- dispatch bf16: `get_dispatch_layout` + `dispatch(x, topk_idx, topk_weights, ...)`, x bfloat16 `[T, H]`;
- dispatch fp8:  the same with x the pair `(float8_e4m3fn [T, H], float32 scales [T, H/128])` of
  `per_token_cast_to_fp8`;
- combine bf16:  `combine(recv_x, handle)`: the bf16 rows a dispatch received go back and are summed per token.

Bandwidth, as upstream: GB/s = bytes of `recv_x` this rank received (FP8: the e4m3 rows plus their scales) / time;
combine counts the same bytes as the bf16 dispatch. Timing: a gloo barrier before every call so all ranks start
together, `perf_counter` around the call, median over `--iters` iterations; the table shows the *slowest rank*
(largest median time) and that rank's GB/s. Every rank runs `max(1, cores // ranks)` intra-op threads.

Baselines, measured in the same processes, iteration by iteration alternating with mtdeepep:

- all-to-all: what a user writes without the library, on `torch.distributed.all_to_all_single` over gloo.
  Dispatch: derive each token's destination ranks from `topk_idx` (once per rank owning one of its experts, as
  mtdeepep), permute the rows by destination, exchange the counts, then all-to-all x (and for parity the
  local expert ids and weights). Combine: the reverse all-to-all, then `index_add_` into `[T, H]` in FP32.
  Both are checked once against mtdeepep's outputs before timing (same rows, same combined sums).
- memcpy: one core copying the same number of bytes between two pre-faulted tensors (`copy_` with one
  thread), on rank 0 while the other ranks wait at a barrier, interleaved iteration by iteration with the two
  implementations. The JSON also holds the per-core bandwidth while every rank copies at once.

Run (1-2 minutes on a 2-core machine):

    .venv/bin/python bench/intranode.py                      # 2 and 4 ranks, table + bench/results/intranode.json
    .venv/bin/python bench/intranode.py --num-ranks 2 --plot # also bench/results/intranode.png

`--thp` (diagnostic) lets torch back large tensors with 2 MiB pages, in every rank, for all implementations alike;
`bench/intranode_phases.py` times mtdeepep's pieces and counts the page faults each one takes.

Legend: T tokens per rank, H hidden, K top-k, E experts, R ranks, S rows a rank sends, N rows it receives.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _common as common
import torch
import torch.distributed as dist
from _common import (
    RESULTS_DIR,
    OpCase,
    combine_parity,
    config_from_args,
    config_parser,
    environment,
    exchange_rows,
    gbps,
    memcpy_seconds,
    num_cores,
    print_table,
    random_routing,
    run_ranks,
    save_results,
    slowest_rank_timing,
    threads_per_rank,
    time_cases,
)

import mtdeepep as deep_ep
from mtdeepep.utils.fp8 import per_token_cast_to_fp8

OPS = ("dispatch bf16", "dispatch fp8", "combine bf16")
IMPLS = ("mtdeepep", "all-to-all")


@dataclass(frozen=True)
class BenchConfig(common.BenchConfig):
    experts: int = 256
    nvl_bytes: int = 1 << 30
    seed: int = 0


# ---------------------------------------------------------------------------------------------------------------
# Inputs


@dataclass
class RankInputs:
    x_TH: torch.Tensor  # bfloat16
    x_fp8: tuple[torch.Tensor, torch.Tensor]  # (float8_e4m3fn [T, H], float32 [T, H/128])
    topk_idx_TK: torch.Tensor  # int64
    topk_weights_TK: torch.Tensor  # float32


def make_inputs(cfg: BenchConfig, rank: int) -> RankInputs:
    """Random activations and random routing: each token picks the top-k of random expert scores."""
    x_TH, topk_idx_TK, topk_weights_TK = random_routing(
        cfg.tokens, cfg.hidden, cfg.experts, cfg.topk, cfg.seed * 1000 + rank
    )
    return RankInputs(x_TH, per_token_cast_to_fp8(x_TH), topk_idx_TK, topk_weights_TK)


def payload_bytes(x: torch.Tensor | tuple[torch.Tensor, ...]) -> int:
    parts = x if isinstance(x, tuple) else (x,)
    return sum(t.numel() * t.element_size() for t in parts)


# ---------------------------------------------------------------------------------------------------------------
# Baseline: torch.distributed.all_to_all_single over gloo


@dataclass
class A2ARoute:
    """What the all-to-all dispatch leaves for its combine."""

    token_S: torch.Tensor  # source token of each sent row; rows grouped by destination rank, token order within
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank


def a2a_route(topk_idx_TK: torch.Tensor, num_experts: int, group: dist.ProcessGroup) -> tuple[A2ARoute, torch.Tensor]:
    """Each token once per rank owning one of its experts; returns the route and each sent row's destination."""
    num_ranks = group.size()
    valid_TK = topk_idx_TK >= 0
    rank_TK = torch.where(valid_TK, topk_idx_TK // (num_experts // num_ranks), num_ranks)
    in_rank_TR = torch.zeros(topk_idx_TK.size(0), num_ranks + 1, dtype=torch.bool)
    in_rank_TR.scatter_(1, rank_TK, True)
    dest_S, token_S = in_rank_TR[:, :num_ranks].t().nonzero(as_tuple=True)
    send_counts_R = torch.bincount(dest_S, minlength=num_ranks)
    recv_counts_R = torch.empty_like(send_counts_R)
    dist.all_to_all_single(recv_counts_R, send_counts_R, group=group)
    return A2ARoute(token_S, send_counts_R.tolist(), recv_counts_R.tolist()), dest_S


def a2a_dispatch(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    topk_idx_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
) -> tuple[Any, torch.Tensor, torch.Tensor, A2ARoute]:
    """Returns `(recv_x, recv_topk_idx, recv_topk_weights, route)` laid out exactly as mtdeepep's dispatch."""
    route, dest_S = a2a_route(topk_idx_TK, num_experts, group)
    experts_per_rank = num_experts // group.size()
    send = lambda rows: exchange_rows(rows.index_select(0, route.token_S), route.send_splits, route.recv_splits, group)
    recv_x = tuple(send(part) for part in x) if isinstance(x, tuple) else send(x)
    expert_SK = topk_idx_TK.index_select(0, route.token_S)
    local_SK = expert_SK - (dest_S * experts_per_rank).unsqueeze(1)
    is_local_SK = (expert_SK >= 0) & (local_SK >= 0) & (local_SK < experts_per_rank)
    local_SK = torch.where(is_local_SK, local_SK, -1)
    weights_SK = torch.where(is_local_SK, topk_weights_TK.index_select(0, route.token_S), 0.0)
    recv_idx = exchange_rows(local_SK, route.send_splits, route.recv_splits, group)
    recv_weights = exchange_rows(weights_SK, route.send_splits, route.recv_splits, group)
    return recv_x, recv_idx, recv_weights, route


def a2a_combine(y_NH: torch.Tensor, route: A2ARoute, num_tokens: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sends the rows back (reverse all-to-all) and sums each token's rows in FP32."""
    back_SH = exchange_rows(y_NH, route.recv_splits, route.send_splits, group)
    acc_TH = torch.zeros(num_tokens, y_NH.size(1), dtype=torch.float32)
    acc_TH.index_add_(0, route.token_S, back_SH.float())
    return acc_TH.to(y_NH.dtype)


# ---------------------------------------------------------------------------------------------------------------
# mtdeepep


def deepep_dispatch(buffer: deep_ep.Buffer, x, inputs: RankInputs, num_experts: int):
    """Layout + dispatch, as a training step calls them (with upstream's `num_tokens_per_rdma_rank`: None on one
    node, the tokens per node when the buffer spans nodes)."""
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(inputs.topk_idx_TK, num_experts)
    return buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=inputs.topk_idx_TK, topk_weights=inputs.topk_weights_TK,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Sanity check: the baseline computes exactly what mtdeepep computes


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_dispatch_parity(name: str, ours: tuple, theirs: tuple) -> None:
    recv_x, recv_idx, recv_weights = ours[:3]
    base_x, base_idx, base_weights = theirs[:3]
    parts = zip(recv_x, base_x) if isinstance(recv_x, tuple) else [(recv_x, base_x)]
    if not all(_same_bytes(a, b) for a, b in parts):
        raise AssertionError(f"{name}: mtdeepep and the all-to-all baseline received different rows")
    if not (torch.equal(recv_idx, base_idx) and torch.equal(recv_weights, base_weights)):
        raise AssertionError(f"{name}: mtdeepep and the all-to-all baseline received different top-k ids/weights")


def check_combine_parity(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, Any]:
    """Both sum in FP32 and round once to bf16; allow one bf16 ulp where the summation order differs."""
    torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=0.0)
    return {
        "bit_exact": bool(torch.equal(ours, theirs)),
        "max_abs_diff": float((ours.float() - theirs.float()).abs().max()),
    }


# ---------------------------------------------------------------------------------------------------------------
# One rank


# The bytes an op counts, from `(x dispatched, recv_x received)`: here the received bytes; internode.py counts more.
CountBytes = Callable[[Any, Any], Any]


def recv_bytes(x, recv_x) -> int:
    return payload_bytes(recv_x)


def dispatch_case(op: str, buffer: deep_ep.Buffer, x, inputs: RankInputs, cfg, group, count: CountBytes) -> OpCase:
    a2a_args = (inputs.topk_idx_TK, inputs.topk_weights_TK, cfg.experts, group)
    ours = deepep_dispatch(buffer, x, inputs, cfg.experts)
    check_dispatch_parity(op, ours, a2a_dispatch(x, *a2a_args))
    fns = {
        "mtdeepep": lambda: deepep_dispatch(buffer, x, inputs, cfg.experts),
        "all-to-all": lambda: a2a_dispatch(x, *a2a_args),
    }
    return OpCase(op, count(x, ours[0]), fns, {"identical": True})


def combine_case(buffer: deep_ep.Buffer, inputs: RankInputs, cfg, group, count: CountBytes) -> OpCase:
    """Combines the bf16 rows a dispatch received (both implementations get the same rows); counts the bytes of
    that dispatch."""
    recv_x, _, _, _, handle, _ = deepep_dispatch(buffer, inputs.x_TH, inputs, cfg.experts)
    route = a2a_dispatch(inputs.x_TH, inputs.topk_idx_TK, inputs.topk_weights_TK, cfg.experts, group)[3]
    parity = check_combine_parity(buffer.combine(recv_x, handle)[0], a2a_combine(recv_x, route, cfg.tokens, group))
    fns = {
        "mtdeepep": lambda: buffer.combine(recv_x, handle),
        "all-to-all": lambda: a2a_combine(recv_x, route, cfg.tokens, group),
    }
    return OpCase("combine bf16", count(inputs.x_TH, recv_x), fns, parity)


def op_cases(buffer: deep_ep.Buffer, inputs: RankInputs, cfg, group, count: CountBytes = recv_bytes) -> list[OpCase]:
    """The three operations of `OPS`, each checked once against the all-to-all baseline. `cfg` is this module's
    `BenchConfig` or internode.py's (both have `tokens` and `experts`)."""
    return [
        dispatch_case("dispatch bf16", buffer, inputs.x_TH, inputs, cfg, group, count),
        dispatch_case("dispatch fp8", buffer, inputs.x_fp8, inputs, cfg, group, count),
        combine_case(buffer, inputs, cfg, group, count),
    ]


def bench_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Checks parity once per operation, times mtdeepep and the all-to-all baseline, then memcpy."""
    inputs = make_inputs(cfg, rank)
    buffer = deep_ep.Buffer(group, num_nvl_bytes=cfg.nvl_bytes, explicitly_destroy=True)
    try:
        cases = op_cases(buffer, inputs, cfg, group)
        for case in cases:
            case.fns["memcpy"] = memcpy_on_rank0(rank, case.num_bytes)
        result = time_cases(cases, cfg.iters, cfg.warmup, group)
    finally:
        buffer.destroy()
    return {**result, "memcpy": measure_memcpy(rank, group, result["bytes"], cfg)}


def memcpy_on_rank0(rank: int, num_bytes: int) -> Callable[[], Any]:
    """One single-threaded copy of `num_bytes` between pre-faulted tensors on rank 0 (the other ranks idle):
    timed interleaved with the implementations, so load that drifts during the run hits it alike."""
    if rank != 0:
        return lambda: None
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)

    def copy() -> None:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        dst.copy_(src)
        torch.set_num_threads(previous)

    return copy


def measure_memcpy(rank: int, group: dist.ProcessGroup, recv_bytes: dict[str, int], cfg: BenchConfig):
    """Single-core memcpy seconds for each op's byte count: rank 0 alone, then every rank at once."""
    sizes = sorted(set(recv_bytes.values()))
    alone: dict[int, float] = {}
    dist.barrier(group=group)
    if rank == 0:
        alone = {size: memcpy_seconds(size, cfg.iters) for size in sizes}
    dist.barrier(group=group)
    together = {size: memcpy_seconds(size, cfg.iters) for size in sizes}
    dist.barrier(group=group)
    return {
        op: {"bytes": size, "alone_s": alone.get(size), "concurrent_s": together[size]}
        for op, size in recv_bytes.items()
    }


# ---------------------------------------------------------------------------------------------------------------
# Report


def rates(bytes_per_rank: Sequence[int], seconds: Sequence[float], slowest: int) -> dict[str, float]:
    """The slowest rank's GB/s, and the mean over ranks of each rank's GB/s."""
    return {
        "gbps": gbps(bytes_per_rank[slowest], seconds[slowest]),
        "mean_gbps": sum(gbps(b, s) for b, s in zip(bytes_per_rank, seconds)) / len(seconds),
    }


def summarize(num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op: the slowest rank's numbers, plus per-rank means for the JSON."""
    rows = []
    for op in OPS:
        row: dict[str, Any] = {"num_ranks": num_ranks, "op": op}
        for impl in IMPLS:
            row[impl] = slowest_rank_timing(per_rank, op, impl, "ms", rates)
        copy0 = per_rank[0]["memcpy"][op]
        concurrent = [gbps(r["memcpy"][op]["bytes"], r["memcpy"][op]["concurrent_s"]) for r in per_rank]
        row["memcpy"] = {
            "bytes": copy0["bytes"],
            "gbps": gbps(per_rank[0]["bytes"][op], per_rank[0]["seconds"][op]["memcpy"]),
            "after_run_gbps": gbps(copy0["bytes"], copy0["alone_s"]),
            "concurrent_gbps": min(concurrent),
            "concurrent_gbps_per_rank": concurrent,
        }
        row["speedup"] = row["all-to-all"]["time_ms"] / row["mtdeepep"]["time_ms"]
        row["fraction_of_memcpy"] = row["mtdeepep"]["gbps"] / row["memcpy"]["gbps"]
        row["fraction_of_concurrent_memcpy"] = row["mtdeepep"]["gbps"] / row["memcpy"]["concurrent_gbps"]
        row["recv_bytes_per_rank"] = [r["bytes"][op] for r in per_rank]
        row["parity"] = [r["parity"][op] for r in per_rank]
        rows.append(row)
    return rows


TABLE_HEADERS = (
    "ranks", "op", "mtdeepep GB/s", "time ms", "all-to-all GB/s", "speedup", "memcpy GB/s", "of memcpy",
    "memcpy-all GB/s", "of memcpy-all",
)  # fmt: skip
TABLE_NOTE = (
    "GB/s = recv_x bytes of the slowest rank / its median time; speedup = all-to-all time / mtdeepep time.\n"
    "memcpy: 1 thread copying the same bytes on rank 0 while the other ranks wait, interleaved with the runs;\n"
    "memcpy-all: the same copy on every rank at once (slowest rank), i.e. one core's share of the memory\n"
    "bandwidth while all ranks run."
)


def table_row(row: dict[str, Any]) -> list[str]:
    return [
        str(row["num_ranks"]),
        row["op"],
        f"{row['mtdeepep']['gbps']:.2f}",
        f"{row['mtdeepep']['time_ms']:.1f}",
        f"{row['all-to-all']['gbps']:.2f}",
        f"{row['speedup']:.2f}x",
        f"{row['memcpy']['gbps']:.2f}",
        f"{100 * row['fraction_of_memcpy']:.0f}%",
        f"{row['memcpy']['concurrent_gbps']:.2f}",
        f"{100 * row['fraction_of_concurrent_memcpy']:.0f}%",
    ]


def parity_line(rows: list[dict[str, Any]]) -> str:
    return (
        "parity with the all-to-all baseline (checked once on every rank): dispatched rows, top-k ids and weights "
        f"identical; combined output {combine_parity(rows, 'within one bf16 ulp')}"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['num_ranks']} ranks\n{row['op']}" for row in rows]
    series = {
        "mtdeepep": [row["mtdeepep"]["gbps"] for row in rows],
        "all-to-all (gloo)": [row["all-to-all"]["gbps"] for row in rows],
        "memcpy (1 core, alone)": [row["memcpy"]["gbps"] for row in rows],
        "memcpy (per rank, all copying)": [row["memcpy"]["concurrent_gbps"] for row in rows],
    }
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(rows) + 2), 4.5))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))], values, width, label=name)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("GB/s per rank (slowest rank)")
    ax.set_title("Intranode dispatch/combine, received bytes / time")
    ax.set_ylim(top=1.3 * max(max(values) for values in series.values()))
    ax.legend(loc="upper center", ncols=2, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Entry point


# Help texts of the config options (internode.py's too).
CONFIG_HELP = {"nvl_bytes": "per-rank shared region"}


def parse_args() -> argparse.Namespace:
    parser = config_parser(__doc__, BenchConfig(), helps=CONFIG_HELP, results="intranode", ranks="2,4")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per rank count")
    parser.add_argument(
        "--thp",
        action="store_true",
        help="diagnostic: set THP_MEM_ALLOC_ENABLE=1 in the ranks, so torch backs large tensors with 2 MiB pages "
        "(fewer page faults; applies to mtdeepep and the baselines alike)",
    )
    parser.add_argument(
        "--plot",
        nargs="?",
        type=Path,
        const=RESULTS_DIR / "intranode.png",
        default=None,
        help="write a bar chart (default path: bench/results/intranode.png)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cfg = config_from_args(BenchConfig, args)
    if args.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch's CPU allocator in the spawned ranks
    rows = []
    for num_ranks in args.num_ranks:
        per_rank = run_ranks(bench_rank, num_ranks, (cfg,), timeout_s=args.timeout)
        rows.extend(summarize(num_ranks, per_rank))
    threads = {n: threads_per_rank(n) for n in args.num_ranks}
    print(
        f"T={cfg.tokens} H={cfg.hidden} E={cfg.experts} K={cfg.topk}; {num_cores()} cores, threads per "
        f"rank {threads}; median of {cfg.iters} iterations{'; THP_MEM_ALLOC_ENABLE=1' if args.thp else ''}"
    )
    print_table(TABLE_HEADERS, [table_row(row) for row in rows], TABLE_NOTE, parity_line(rows))
    env = {**environment(), "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE")}
    save_results(args.json, {"config": asdict(cfg), "threads_per_rank": threads, "environment": env, "rows": rows})
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
