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
- net bytes: the bytes that leave the node (what crosses the network between hosts): mtdeepep's RDMA bytes without
  the own node; the baseline's: one row per (token, destination rank on another node), so a token bound for two
  ranks of one node crosses twice. Each implementation's net GB/s divides its own net bytes by its own time.
GB/s = bytes / median time of the whole call (both stages), as upstream reports both against one time.

Baseline, in the same processes, iteration by iteration alternating with mtdeepep: `all_to_all_single` over the
4-rank group with the same payload and results (bench/intranode.py's `a2a_dispatch` / `a2a_combine`: one row per
(token, destination rank), no node stage); checked once against mtdeepep's outputs before timing.

Run (about 2 minutes on a 2-core machine):

    .venv/bin/python bench/internode.py            # table + bench/results/internode.json
    .venv/bin/python bench/internode.py --num-tokens 1024 --ranks-per-node 1

Across real hosts (`--torchrun`: every rank started by torchrun, one agent per host; rank 0 prints and saves), e.g.
2 namespace hosts x 2 ranks (scripts/hosts.sh, root), the network stage over TCP between the hosts' veths:

    scripts/hosts.sh each 2 -- .venv/bin/python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 \
        --rdzv-backend c10d --rdzv-endpoint 10.77.0.1:29400 --rdzv-id bench bench/internode.py --torchrun \
        --num-tokens 1024 --json bench/results/internode_hosts.json

Legend: T tokens per rank, H hidden, K top-k, E experts, R ranks, N nodes, L ranks per node.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import intranode
import torch
import torch.distributed as dist
from _common import (
    config_from_args,
    config_parser,
    environment,
    gbps,
    num_cores,
    print_table,
    run_ranks,
    save_results,
    slowest_rank_timing,
    threads_per_rank,
    time_cases,
)
from intranode import CONFIG_HELP, IMPLS, OPS, make_inputs, op_cases, parity_line, payload_bytes

import mtdeepep as deep_ep


@dataclass(frozen=True)
class BenchConfig(intranode.BenchConfig):
    iters: int = 5
    warmup: int = 1
    nvl_bytes: int = 1 << 29
    num_nodes: int = 2
    ranks_per_node: int = 2

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.ranks_per_node


# ---------------------------------------------------------------------------------------------------------------
# Byte counts


def rows_per_destination(topk_idx_TK: torch.Tensor, num_experts: int, num_destinations: int) -> torch.Tensor:
    """`[num_destinations]` int64: the tokens bound for each destination (node or rank), each token once."""
    dest_TK = torch.where(topk_idx_TK >= 0, topk_idx_TK // (num_experts // num_destinations), num_destinations)
    in_dest_TD = torch.zeros(topk_idx_TK.size(0), num_destinations + 1, dtype=torch.bool)
    in_dest_TD.scatter_(1, dest_TK, True)
    return in_dest_TD[:, :num_destinations].sum(dim=0)


def rdma_rows(topk_idx_TK: torch.Tensor, cfg: BenchConfig, rank_node: int) -> tuple[int, int, int]:
    """`(rows, rows leaving the node, the baseline's rows leaving the node)`: tokens x distinct destination nodes,
    with and without the own node; tokens x distinct destination ranks on other nodes."""
    per_node = rows_per_destination(topk_idx_TK, cfg.experts, cfg.num_nodes)
    per_rank = rows_per_destination(topk_idx_TK, cfg.experts, cfg.num_ranks).view(cfg.num_nodes, -1).sum(dim=1)
    leaving = lambda rows: int(rows.sum() - rows[rank_node])
    return int(per_node.sum()), leaving(per_node), leaving(per_rank)


def row_bytes(x) -> int:
    """Bytes of one token of x (FP8: e4m3 row plus its scales)."""
    parts = x if isinstance(x, tuple) else (x,)
    return sum(t.size(1) * t.element_size() for t in parts)


def counted_bytes(rows: tuple[int, int, int], x, recv_x) -> dict[str, int]:
    """An op's bytes (see the module docstring), from this rank's `rdma_rows`, the tokens sent and those received."""
    per_row = row_bytes(x)
    return {"rdma": rows[0] * per_row, "rdma_leaving_node": rows[1] * per_row, "nvl": payload_bytes(recv_x),
            "a2a_leaving_node": rows[2] * per_row}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# One rank


def bench_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Checks parity once per operation, then times mtdeepep and the all-to-all baseline interleaved."""
    inputs = make_inputs(cfg, rank)
    rows = rdma_rows(inputs.topk_idx_TK, cfg, rank // cfg.ranks_per_node)
    buffer = deep_ep.Buffer(group, cfg.nvl_bytes, explicitly_destroy=True, num_ranks_per_node=cfg.ranks_per_node)
    try:
        assert buffer.get_num_rdma_ranks() == cfg.num_nodes
        cases = op_cases(buffer, inputs, cfg, group, partial(counted_bytes, rows))
        return time_cases(cases, cfg.iters, cfg.warmup, group)
    finally:
        buffer.destroy()


# ---------------------------------------------------------------------------------------------------------------
# Report


NET_BYTES = {"mtdeepep": "rdma_leaving_node", "all-to-all": "a2a_leaving_node"}  # each one's bytes leaving the node


def rates(
    bytes_per_rank: Sequence[dict[str, int]], seconds: Sequence[float], slowest: int, impl: str = "mtdeepep"
) -> dict[str, float]:
    """The slowest rank's RDMA, NVL and net GB/s (net: `impl`'s own bytes leaving the node)."""
    counted, time_s = bytes_per_rank[slowest], seconds[slowest]
    return {"rdma_gbps": gbps(counted["rdma"], time_s), "nvl_gbps": gbps(counted["nvl"], time_s),
            "net_gbps": gbps(counted[NET_BYTES[impl]], time_s)}  # fmt: skip


def summarize(cfg: BenchConfig, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op: the slowest rank's time and GB/s for each implementation, per-rank details for the JSON."""
    rows = []
    for op in OPS:
        row: dict[str, Any] = {"op": op, "num_nodes": cfg.num_nodes, "ranks_per_node": cfg.ranks_per_node}
        for impl in IMPLS:
            row[impl] = slowest_rank_timing(per_rank, op, impl, "ms", partial(rates, impl=impl))
        row["bytes_per_rank"] = [r["bytes"][op] for r in per_rank]
        row["speedup"] = row["all-to-all"]["time_ms"] / row["mtdeepep"]["time_ms"]
        row["parity"] = [r["parity"][op] for r in per_rank]
        rows.append(row)
    return rows


TABLE_HEADERS = (
    "op", "time ms", "RDMA GB/s", "NVL GB/s", "RDMA MB", "NVL MB", "net MB", "net GB/s", "a2a ms",
    "a2a NVL-equiv GB/s", "a2a net MB", "a2a net GB/s", "speedup",
)  # fmt: skip
TABLE_NOTE = (
    "Slowest rank's median time. RDMA bytes = tokens x distinct destination nodes x row bytes (own node included, as\n"
    "upstream); NVL bytes = recv_x bytes; both divided by the same time. a2a: all_to_all_single over the 4 ranks with\n"
    "the same payload (its GB/s counts the same recv_x bytes); speedup = a2a time / mtdeepep time. net: the bytes\n"
    "that leave the node (mtdeepep: once per destination node; a2a: once per destination rank), over each one's time."
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
        f"{counted['rdma_leaving_node'] / 1e6:.1f}",
        f"{ours['net_gbps']:.2f}",
        f"{theirs['time_ms']:.1f}",
        f"{theirs['nvl_gbps']:.2f}",
        f"{row['bytes_per_rank'][theirs['slowest_rank']]['a2a_leaving_node'] / 1e6:.1f}",
        f"{theirs['net_gbps']:.2f}",
        f"{row['speedup']:.2f}x",
    ]


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def parse_args() -> argparse.Namespace:
    helps = {**CONFIG_HELP, "num_nodes": "simulated nodes"}
    parser = config_parser(__doc__, BenchConfig(), helps=helps, results="internode")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed for the whole run")
    parser.add_argument("--torchrun", action="store_true", help="ranks started by torchrun (several hosts)")
    return parser.parse_args()


def _torchrun_ranks(cfg: BenchConfig, timeout_s: float) -> list[dict[str, Any]] | None:
    """This rank's part of a torchrun launch: every rank's results on rank 0, None elsewhere."""
    torch.set_num_threads(threads_per_rank(cfg.num_ranks))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    if dist.get_world_size() != cfg.num_ranks or int(os.environ["LOCAL_WORLD_SIZE"]) != cfg.ranks_per_node:
        raise SystemExit(f"torchrun started {dist.get_world_size()} ranks, {os.environ['LOCAL_WORLD_SIZE']} per host; "
                         f"the config wants {cfg.num_nodes} x {cfg.ranks_per_node}")  # fmt: skip
    mine = bench_rank(dist.get_rank(), cfg.num_ranks, dist.group.WORLD, cfg)
    everyone: list = [None] * cfg.num_ranks
    dist.all_gather_object(everyone, mine)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return everyone if rank == 0 else None


def main() -> None:
    args = parse_args()
    cfg = config_from_args(BenchConfig, args)
    if cfg.num_nodes < 2:
        raise SystemExit("--num-nodes must be at least 2 (one node is bench/intranode.py)")
    where, network = "on one host", "gloo over loopback"
    if args.torchrun:
        per_rank = _torchrun_ranks(cfg, args.timeout)
        if per_rank is None:  # not rank 0
            return
        where, network = "on separate hosts (torchrun)", f"gloo over {os.environ.get('GLOO_SOCKET_IFNAME', 'TCP')}"
    else:
        per_rank = run_ranks(bench_rank, cfg.num_ranks, (cfg,), timeout_s=args.timeout)
    rows = summarize(cfg, per_rank)
    print(
        f"T={cfg.tokens} H={cfg.hidden} E={cfg.experts} K={cfg.topk}; {cfg.num_nodes} nodes x "
        f"{cfg.ranks_per_node} ranks {where} ({num_cores()} cores, {threads_per_rank(cfg.num_ranks)} thread(s) per "
        f"rank); network stage: {network}; median of {cfg.iters} iterations"
    )
    print_table(TABLE_HEADERS, [table_row(row) for row in rows], TABLE_NOTE, parity_line(rows))
    save_results(args.json, {"config": asdict(cfg), "environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
