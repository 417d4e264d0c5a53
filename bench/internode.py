"""Internode (two-stage) dispatch/combine bandwidth, nodes simulated on this host, against all_to_all_single.

Setting: upstream DeepEP's internode benchmark scaled to this machine: 4096 tokens per rank, hidden 7168, top-8 of
256 experts with random routing, 4 ranks as 2 nodes x 2 ranks (`num_ranks_per_node=2`). The network stage runs
on torch.distributed (gloo over loopback TCP here), the node-local stage on shared memory. Three operations:

- dispatch bf16: `get_dispatch_layout` + `dispatch(x, topk_idx, topk_weights, ...)`, x bfloat16 `[T, H]`;
- dispatch fp8:  the same with x the pair `(float8_e4m3fn [T, H], float32 scales [T, H/128])`;
- combine bf16:  `combine(recv_x, handle)` of the bf16 rows the dispatch received.

Bytes, as upstream's test_internode.py counts them (per rank, the slowest rank's shown):

- RDMA bytes: tokens x distinct destination nodes x hidden x 2 (bf16), the own node included as upstream does;
  FP8 counts the e4m3 bytes plus the scales (upstream's factor (1 + 4/128) / 2). The JSON also holds the bytes
  that leave the node (own node excluded). Combine counts the bf16 dispatch's bytes.
- NVL bytes: the bytes of `recv_x` this rank received (FP8: data + scales).
GB/s = bytes / median time of the whole call (both stages), as upstream reports both against one time.

Baseline, in the same processes, iteration by iteration alternating with mtdeepep: `all_to_all_single` over the
4-rank group with the same payload and results (bench/intranode.py's `a2a_dispatch` / `a2a_combine`: one row per
(token, destination rank), no node stage); checked once against mtdeepep's outputs before timing.

Run (about 2 minutes on a 2-core machine):

    .venv/bin/python bench/internode.py            # table + bench/results/internode.json
    .venv/bin/python bench/internode.py --num-tokens 1024 --ranks-per-node 1

Legend: T tokens per rank, H hidden, K top-k, E experts, R ranks, N nodes, L ranks per node.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    RESULTS_DIR,
    environment,
    format_table,
    gbps,
    median,
    num_cores,
    run_ranks,
    threads_per_rank,
    time_interleaved,
    write_json,
)
from intranode import (
    RankInputs,
    a2a_combine,
    a2a_dispatch,
    check_combine_parity,
    check_dispatch_parity,
    make_inputs,
    payload_bytes,
)

import mtdeepep as deep_ep

OPS = ("dispatch bf16", "dispatch fp8", "combine bf16")
IMPLS = ("mtdeepep", "all-to-all")


@dataclass(frozen=True)
class BenchConfig:
    num_tokens: int = 4096
    hidden: int = 7168
    num_experts: int = 256
    num_topk: int = 8
    num_nodes: int = 2
    ranks_per_node: int = 2
    iters: int = 5
    warmup: int = 1
    nvl_bytes: int = 1 << 29
    seed: int = 0

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node


# ---------------------------------------------------------------------------------------------------------------
# Byte counts


def rdma_rows(topk_idx_TK: torch.Tensor, num_experts: int, num_nodes: int, rank_node: int) -> tuple[int, int]:
    """`(rows, rows leaving the node)`: tokens x distinct destination nodes, with and without the own node."""
    node_TK = torch.where(topk_idx_TK >= 0, topk_idx_TK // (num_experts // num_nodes), num_nodes)
    in_node_TN = torch.zeros(topk_idx_TK.size(0), num_nodes + 1, dtype=torch.bool)
    in_node_TN.scatter_(1, node_TK, True)
    per_node = in_node_TN[:, :num_nodes].sum(dim=0)
    return int(per_node.sum()), int(per_node.sum() - per_node[rank_node])


def row_bytes(x) -> int:
    """Bytes of one token of x (FP8: e4m3 row plus its scales)."""
    parts = x if isinstance(x, tuple) else (x,)
    return sum(t.size(1) * t.element_size() for t in parts)


# ---------------------------------------------------------------------------------------------------------------
# One rank


def deepep_dispatch(buffer: deep_ep.Buffer, x, inputs: RankInputs, num_experts: int):
    """Layout + dispatch, as a training step calls them (with upstream's `num_tokens_per_rdma_rank`)."""
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(inputs.topk_idx_TK, num_experts)
    return buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=inputs.topk_idx_TK, topk_weights=inputs.topk_weights_TK,
    )  # fmt: skip


@dataclass
class OpCase:
    """One timed operation: both implementations as closures, the bytes that count, the parity check's result."""

    op: str
    rdma_bytes: int
    rdma_leaving_bytes: int
    nvl_bytes: int
    fns: dict[str, Callable[[], Any]]
    parity: dict[str, Any]


def dispatch_case(op: str, buffer, x, inputs: RankInputs, cfg: BenchConfig, group, rows: tuple[int, int]) -> OpCase:
    a2a_args = (inputs.topk_idx_TK, inputs.topk_weights_TK, cfg.num_experts, group)
    ours = deepep_dispatch(buffer, x, inputs, cfg.num_experts)
    check_dispatch_parity(op, ours, a2a_dispatch(x, *a2a_args))
    fns = {
        "mtdeepep": lambda: deepep_dispatch(buffer, x, inputs, cfg.num_experts),
        "all-to-all": lambda: a2a_dispatch(x, *a2a_args),
    }
    per_row = row_bytes(x)
    return OpCase(op, rows[0] * per_row, rows[1] * per_row, payload_bytes(ours[0]), fns, {"identical": True})


def combine_case(buffer, inputs: RankInputs, cfg: BenchConfig, group, rows: tuple[int, int]) -> OpCase:
    recv_x, _, _, _, handle, _ = deepep_dispatch(buffer, inputs.x_TH, inputs, cfg.num_experts)
    route = a2a_dispatch(inputs.x_TH, inputs.topk_idx_TK, inputs.topk_weights_TK, cfg.num_experts, group)[3]
    parity = check_combine_parity(buffer.combine(recv_x, handle)[0], a2a_combine(recv_x, route, cfg.num_tokens, group))
    fns = {
        "mtdeepep": lambda: buffer.combine(recv_x, handle),
        "all-to-all": lambda: a2a_combine(recv_x, route, cfg.num_tokens, group),
    }
    per_row = row_bytes(inputs.x_TH)
    return OpCase("combine bf16", rows[0] * per_row, rows[1] * per_row, payload_bytes(recv_x), fns, parity)


def bench_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Checks parity once per operation, then times mtdeepep and the all-to-all baseline interleaved."""
    inputs = make_inputs(cfg, rank)
    rows = rdma_rows(inputs.topk_idx_TK, cfg.num_experts, cfg.num_nodes, rank // cfg.ranks_per_node)
    buffer = deep_ep.Buffer(group, cfg.nvl_bytes, explicitly_destroy=True, num_ranks_per_node=cfg.ranks_per_node)
    try:
        assert buffer.get_num_rdma_ranks() == cfg.num_nodes
        cases = [
            dispatch_case("dispatch bf16", buffer, inputs.x_TH, inputs, cfg, group, rows),
            dispatch_case("dispatch fp8", buffer, inputs.x_fp8, inputs, cfg, group, rows),
            combine_case(buffer, inputs, cfg, group, rows),
        ]
        times = {case.op: time_interleaved(case.fns, cfg.iters, cfg.warmup, group) for case in cases}
        dist.barrier(group=group)
    finally:
        buffer.destroy()
    return {
        "bytes": {
            case.op: {"rdma": case.rdma_bytes, "rdma_leaving_node": case.rdma_leaving_bytes, "nvl": case.nvl_bytes}
            for case in cases
        },
        "seconds": {op: {impl: median(samples) for impl, samples in by_impl.items()} for op, by_impl in times.items()},
        "samples": times,
        "parity": {case.op: case.parity for case in cases},
    }


# ---------------------------------------------------------------------------------------------------------------
# Report


def summarize(cfg: BenchConfig, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op: the slowest rank's time and GB/s for each implementation, per-rank details for the JSON."""
    rows = []
    for op in OPS:
        row: dict[str, Any] = {"op": op, "num_nodes": cfg.num_nodes, "ranks_per_node": cfg.ranks_per_node}
        for impl in IMPLS:
            seconds = [r["seconds"][op][impl] for r in per_rank]
            slowest = max(range(len(per_rank)), key=lambda i: seconds[i])
            counted = per_rank[slowest]["bytes"][op]
            row[impl] = {
                "slowest_rank": slowest,
                "time_ms": seconds[slowest] * 1e3,
                "rdma_gbps": gbps(counted["rdma"], seconds[slowest]),
                "nvl_gbps": gbps(counted["nvl"], seconds[slowest]),
                "per_rank_ms": [s * 1e3 for s in seconds],
                "samples_ms": [[s * 1e3 for s in r["samples"][op][impl]] for r in per_rank],
            }
        row["bytes_per_rank"] = [r["bytes"][op] for r in per_rank]
        row["speedup"] = row["all-to-all"]["time_ms"] / row["mtdeepep"]["time_ms"]
        row["parity"] = [r["parity"][op] for r in per_rank]
        rows.append(row)
    return rows


TABLE_HEADERS = (
    "op", "time ms", "RDMA GB/s", "NVL GB/s", "RDMA MB", "NVL MB", "a2a ms", "a2a NVL-equiv GB/s", "speedup",
)  # fmt: skip
TABLE_NOTE = (
    "Slowest rank's median time. RDMA bytes = tokens x distinct destination nodes x row bytes (own node included, as\n"
    "upstream); NVL bytes = recv_x bytes; both divided by the same time. a2a: all_to_all_single over the 4 ranks with\n"
    "the same payload (its GB/s counts the same recv_x bytes); speedup = a2a time / mtdeepep time."
)


def table_row(row: dict[str, Any]) -> list[str]:
    ours, theirs = row["mtdeepep"], row["all-to-all"]
    counted = row["bytes_per_rank"][ours["slowest_rank"]]
    return [
        row["op"],
        f"{ours['time_ms']:.1f}",
        f"{ours['rdma_gbps']:.2f}",
        f"{ours['nvl_gbps']:.2f}",
        f"{counted['rdma'] / 1e6:.1f}",
        f"{counted['nvl'] / 1e6:.1f}",
        f"{theirs['time_ms']:.1f}",
        f"{theirs['nvl_gbps']:.2f}",
        f"{row['speedup']:.2f}x",
    ]


def parity_line(rows: list[dict[str, Any]]) -> str:
    combines = [parity for row in rows if row["op"].startswith("combine") for parity in row["parity"]]
    exact = all(p["bit_exact"] for p in combines)
    worst = max(p["max_abs_diff"] for p in combines)
    combined = "bit-exact" if exact else f"within one bf16 ulp (max |diff| {worst:g})"
    return (
        "parity with the all-to-all baseline (checked once on every rank): dispatched rows, top-k ids and weights "
        f"identical; combined output {combined}"
    )


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = BenchConfig()
    parser.add_argument("--num-tokens", type=int, default=defaults.num_tokens, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--num-experts", type=int, default=defaults.num_experts)
    parser.add_argument("--num-topk", type=int, default=defaults.num_topk)
    parser.add_argument("--num-nodes", type=int, default=defaults.num_nodes, help="simulated nodes")
    parser.add_argument("--ranks-per-node", type=int, default=defaults.ranks_per_node)
    parser.add_argument("--iters", type=int, default=defaults.iters, help="timed iterations per op")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed iterations per op")
    parser.add_argument("--nvl-bytes", type=int, default=defaults.nvl_bytes, help="per-rank shared region")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed for the whole run")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "internode.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cfg = BenchConfig(
        args.num_tokens, args.hidden, args.num_experts, args.num_topk, args.num_nodes, args.ranks_per_node,
        args.iters, args.warmup, args.nvl_bytes, args.seed,
    )  # fmt: skip
    if cfg.num_nodes < 2:
        raise SystemExit("--num-nodes must be at least 2 (one node is bench/intranode.py)")
    per_rank = run_ranks(bench_rank, cfg.num_ranks, (cfg,), timeout_s=args.timeout)
    rows = summarize(cfg, per_rank)
    print(
        f"T={cfg.num_tokens} H={cfg.hidden} E={cfg.num_experts} K={cfg.num_topk}; {cfg.num_nodes} nodes x "
        f"{cfg.ranks_per_node} ranks on one host ({num_cores()} cores, {threads_per_rank(cfg.num_ranks)} thread(s) per "
        f"rank); network stage: gloo over loopback; median of {cfg.iters} iterations"
    )
    print(format_table(TABLE_HEADERS, [table_row(row) for row in rows]))
    print(TABLE_NOTE)
    print(parity_line(rows))
    payload = {"config": asdict(cfg), "environment": environment(), "rows": rows}
    write_json(args.json, payload)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
