"""Hot-expert replication on a skewed router: bytes and time of a training step with and without it.

Setting (every size is a flag): hidden 1024, expert FFN 256, 16 experts, top-4 softmax routing, 2048 tokens per
rank, float32, dropless. The router is skewed: experts 0 and 1 (both on rank 0) share a direction that 70% of
the tokens carry, so they take about a third of all slots and rank 0 computes most rows. For each dispatcher
('alltoall', 'flex') two layers with the same weights run: plain, and with `moe_hot_expert_replication` (after one
step and `update_hot_experts`, experts 0 and 1 are hot).

One step = grads to None, forward, backward, SGD step (so every step pays the copies' refresh and gradient
all-reduce). Variants alternate step by step (`time_interleaved`, a gloo barrier before each); each rank's median
over `--iters`; the table shows the slowest rank (the step of an expert-parallel group lasts as long as its
slowest rank). Before timing, the replicated layer's output and input gradient are compared with the plain one's.

Bytes per rank and step (payload, not counting the collective algorithm's own traffic):
- token bytes: rows leaving this rank for experts of other ranks, x2 (dispatch and combine), H x 4 bytes each
  (slot-wise, as the 'alltoall' dispatcher moves them; 'flex' moves one row per token and destination rank, less);
- replica bytes: the hot experts' weights (refresh all-reduce) and their FP32 gradients (backward all-reduce).

Run (about a minute on a 2-core machine):

    .venv/bin/python bench/moe_replication.py          # EP 2 and 4; table + bench/results/moe_replication.json
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    MoELayerBenchConfig,
    add_rank_counts,
    config_from_args,
    config_parser,
    environment,
    print_table,
    run_ranks,
    save_results,
    time_variants,
    train_step,
)

from moe import MoEConfig, MoELayer
from moe.layer.replication import update_hot_experts


@dataclass(frozen=True)
class BenchConfig(MoELayerBenchConfig):
    ffn: int = 256  # fine-grained experts (F = H / 4; DeepSeek-V3: 2048 / 7168)
    skewed_share: float = 0.7  # fraction of tokens that prefer experts 0 and 1
    dispatchers: tuple[str, ...] = ("alltoall", "flex")


def build_layers(cfg: BenchConfig, dispatcher: str, group) -> dict[str, MoELayer]:
    layers = {}
    for replicate in (False, True):
        torch.manual_seed(cfg.seed)
        layer = MoELayer(
            MoEConfig(hidden_size=cfg.hidden, num_moe_experts=cfg.experts, moe_ffn_hidden_size=cfg.ffn,
                      moe_router_topk=cfg.topk, init_method_std=0.02, moe_token_dispatcher_type=dispatcher,
                      moe_hot_expert_replication=replicate),
            ep_group=group,
        )  # fmt: skip
        with torch.no_grad():  # experts 0 and 1 answer to the first 8 input channels
            layer.router.weight[:2, :8] += 1.0
        layers[f"{dispatcher}{' + replication' if replicate else ''}"] = layer
    return layers


def make_inputs(cfg: BenchConfig, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen)
    skewed = torch.rand(cfg.tokens, generator=gen) < cfg.skewed_share
    x[skewed, :8] = x[skewed, :8].abs() + 2.0
    return x, torch.randn(cfg.tokens, cfg.hidden, generator=gen)


def step_bytes(layer: MoELayer, rank: int, cfg: BenchConfig) -> tuple[int, int]:
    """(token bytes, replica bytes) of this rank's last step (see the module docstring)."""
    counts = layer.metrics.tokens_per_expert
    local = slice(layer.local_expert_start, layer.local_expert_start + layer.num_local_experts)
    remote = counts.clone()
    remote[local] = 0
    hot = layer.replicas.hot if layer.replicas is not None else []
    remote[hot] = 0
    token_bytes = int(remote.sum()) * cfg.hidden * 4 * 2
    replica_bytes = len(hot) * 3 * cfg.hidden * cfg.ffn * 4 * 2
    return token_bytes, replica_bytes


def bench_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    x, grad = make_inputs(cfg, rank)
    layers = {name: layer for d in cfg.dispatchers for name, layer in build_layers(cfg, d, group).items()}
    optimizers = {name: torch.optim.SGD(layer.parameters(), lr=1e-4) for name, layer in layers.items()}
    # One step counts the load; the update makes the skewed experts hot.
    for name, layer in layers.items():
        train_step(layer, x, grad, optimizers[name])
    hot = update_hot_experts(list(layers.values()))
    # Parity: plain and replicated layers hold the same weights again after one identical step each.
    parity, outputs = {}, {}
    for name, layer in layers.items():
        outputs[name] = train_step(layer, x, grad, optimizers[name])
    for name in layers:
        plain = name.split(" + ")[0]
        parity[name] = max(float((a - b).norm() / b.norm()) for a, b in zip(outputs[name], outputs[plain]))
    bytes_ = {name: step_bytes(layer, rank, cfg) for name, layer in layers.items()}
    replicated_slots = {name: layer.metrics.num_replicated_slots for name, layer in layers.items()}
    fns = {name: (lambda n=name: train_step(layers[n], x, grad, optimizers[n])) for name in layers}
    return {
        **time_variants(fns, cfg.iters, cfg.warmup, group),
        "bytes": bytes_,
        "parity": parity,
        "hot": {name: h for name, h in hot.items()},
        "replicated_slots": replicated_slots,
    }


def summarize(cfg: BenchConfig, num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    names = list(per_rank[0]["seconds"])
    for name in names:
        plain = name.split(" + ")[0]
        slowest = max(r["seconds"][name] for r in per_rank)
        slowest_plain = max(r["seconds"][plain] for r in per_rank)
        rows.append({
            "ep": num_ranks,
            "variant": name,
            "ms": slowest * 1e3,
            "speedup": slowest_plain / slowest,
            "token_mb": sum(r["bytes"][name][0] for r in per_rank) / num_ranks / 1e6,
            "replica_mb": per_rank[0]["bytes"][name][1] / 1e6,
            "replicated_slots": sum(r["replicated_slots"][name] for r in per_rank) / num_ranks,
            "parity": max(r["parity"][name] for r in per_rank),
        })  # fmt: skip
    return rows


HEADERS = ["EP", "variant", "step ms", "vs plain", "token MB/rank", "replica MB", "slots kept home/rank", "parity"]


def main() -> None:
    fields = ("tokens", "hidden", "ffn", "experts", "topk", "iters", "warmup", "seed", "skewed_share")
    parser = config_parser(__doc__, BenchConfig(), fields, results="moe_replication")
    add_rank_counts(parser, "2,4", "--ep", "expert-parallel sizes")
    args = parser.parse_args()
    cfg = config_from_args(BenchConfig, args)
    rows, hot = [], {}
    for num_ranks in args.ep:
        start = time.perf_counter()
        per_rank = run_ranks(bench_rank, num_ranks, (cfg,), timeout_s=600)
        print(f"EP {num_ranks}: {time.perf_counter() - start:.0f} s; hot experts {per_rank[0]['hot']}")
        hot[num_ranks] = per_rank[0]["hot"]
        rows.extend(summarize(cfg, num_ranks, per_rank))
    print(
        f"T={cfg.tokens} per rank, H={cfg.hidden}, F={cfg.ffn}, E={cfg.experts}, K={cfg.topk}, float32; "
        f"{cfg.skewed_share:.0%} of tokens prefer experts 0 and 1; median of {cfg.iters} steps; slowest rank"
    )
    print_table(HEADERS, [
        [str(r["ep"]), r["variant"], f"{r['ms']:.1f}", f"{r['speedup']:.2f}x", f"{r['token_mb']:.1f}",
         f"{r['replica_mb']:.1f}", f"{r['replicated_slots']:.0f}", f"{r['parity']:.1e}"]
        for r in rows
    ])  # fmt: skip
    save_results(args.json, {"config": asdict(cfg), "hot": hot, "environment": environment(), "rows": rows})
    worst = max(r["parity"] for r in rows)
    if worst > 1e-4:
        raise SystemExit(f"parity check failed: relative error {worst:.1e} > 1e-4")


if __name__ == "__main__":
    main()
