"""MoE recompute: peak memory and time of a training step at every recompute level, and with the adaptive trigger.

Setting (every size is a flag): a stack of 4 MoE layers, 2048 tokens, hidden 1024, expert FFN 512, 16 experts,
top-4, a shared expert of 1024, float32, one process (recompute is local to a rank; 'full' re-dispatches in
backward, which on one process is a local regrouping). Variants: no recompute, 'light', 'medium', 'full', and
the adaptive trigger (`moe_adaptive_recompute_tokens`) set below the rows each layer computes, so every layer
recomputes its expert activations (the 'fc1' mode), and set above, so none does.

Peak memory: `moe.layer.peak_memory.peak_memory_bytes` (the process's resident-set peak above the memory in use at the
start of the step, with glibc mapping every allocation of 64 KiB or more on its own; the CUDA allocator's peak on GPUs).
Time: one step = grads kept allocated (zeroed), forward, backward. Variants alternate step by step; medians over
`--iters`. Before measuring, every variant's output and gradients are compared with the plain stack's (they must be
identical: recompute rebuilds tensors with the same operations).

Run (about a minute on a 2-core machine):

    .venv/bin/python bench/moe_recompute.py          # table + bench/results/moe_recompute.json
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from _common import (
    MoELayerBenchConfig,
    config_from_args,
    config_parser,
    environment,
    print_table,
    save_results,
)
from torch import nn

from moe import MoEConfig, MoELayer
from moe.layer.peak_memory import peak_memory_bytes


@dataclass(frozen=True)
class BenchConfig(MoELayerBenchConfig):
    iters: int = 3
    warmup: int = 1  # untimed steps per variant, at least one: the first checks parity (and allocates the grads)
    layers: int = 4
    shared: int = 1024


def variants(cfg: BenchConfig) -> dict[str, dict]:
    rows = cfg.tokens * cfg.topk  # rows the experts of each layer compute (one process)
    return {
        "none": {},
        "light": dict(moe_recompute_level="light"),
        "medium": dict(moe_recompute_level="medium"),
        "full": dict(moe_recompute_level="full"),
        f"adaptive, threshold {rows // 2} (< rows)": dict(moe_adaptive_recompute_tokens=rows // 2),
        f"adaptive, threshold {rows * 2} (> rows)": dict(moe_adaptive_recompute_tokens=rows * 2),
    }


def build_stack(cfg: BenchConfig, extra: dict) -> nn.Sequential:
    torch.manual_seed(cfg.seed)
    layer_cfg = MoEConfig(hidden_size=cfg.hidden, num_moe_experts=cfg.experts, moe_ffn_hidden_size=cfg.ffn,
                          moe_router_topk=cfg.topk, moe_shared_expert_intermediate_size=cfg.shared,
                          init_method_std=0.02, moe_aux_loss_coeff=1e-3, **extra)  # fmt: skip
    return nn.Sequential(*[MoELayer(layer_cfg) for _ in range(cfg.layers)])


def step(stack: nn.Sequential, x: torch.Tensor):
    stack.zero_grad(set_to_none=False)
    x_in = x.detach().requires_grad_()
    out = stack(x_in)
    out.square().mean().backward()
    return out.detach(), x_in.grad


def main() -> None:
    parser = config_parser(__doc__, BenchConfig(), results="moe_recompute")
    args = parser.parse_args()
    cfg = config_from_args(BenchConfig, args)

    stacks = {name: build_stack(cfg, extra) for name, extra in variants(cfg).items()}
    x = torch.randn(cfg.tokens, cfg.hidden, generator=torch.Generator().manual_seed(cfg.seed + 1))
    reference, modes = None, {}
    for name, stack in stacks.items():  # parity, and the first (warm-up) step that allocates the grads
        out, x_grad = step(stack, x)
        grads = [p.grad.clone() for p in stack.parameters()]
        if reference is None:
            reference = (out, x_grad, grads)
        same = torch.equal(out, reference[0]) and torch.equal(x_grad, reference[1])
        same = same and all(torch.equal(a, b) for a, b in zip(grads, reference[2]))
        if not same:
            raise SystemExit(f"parity check failed: {name} differs from the plain stack")
        modes[name] = stack[0].metrics.expert_recompute
    for _ in range(cfg.warmup - 1):
        for stack in stacks.values():
            step(stack, x)

    peaks = {name: [] for name in stacks}
    seconds = {name: [] for name in stacks}
    for _ in range(cfg.iters):
        for name, stack in stacks.items():
            peaks[name].append(peak_memory_bytes(lambda stack=stack: step(stack, x)))
            start = time.perf_counter()
            step(stack, x)
            seconds[name].append(time.perf_counter() - start)

    base_peak, base_time = statistics.median(peaks["none"]), statistics.median(seconds["none"])
    rows = []
    for name in stacks:
        peak, secs = statistics.median(peaks[name]), statistics.median(seconds[name])
        rows.append({"variant": name, "expert_recompute": modes[name], "peak_mib": peak / 2**20,
                     "peak_vs_none": peak / base_peak, "ms": secs * 1e3, "time_vs_none": secs / base_time})  # fmt: skip
    print(
        f"{cfg.layers} layers, T={cfg.tokens}, H={cfg.hidden}, F={cfg.ffn}, shared {cfg.shared}, E={cfg.experts}, "
        f"K={cfg.topk}, float32, one process, {torch.get_num_threads()} threads; median of {cfg.iters}; outputs and "
        "gradients identical to 'none' (checked)"
    )
    print_table(
        ["variant", "experts recompute", "peak MiB", "peak vs none", "step ms", "time vs none"],
        [[r["variant"], str(r["expert_recompute"]), f"{r['peak_mib']:.0f}", f"{r['peak_vs_none']:.2f}",
          f"{r['ms']:.0f}", f"{r['time_vs_none']:.2f}"] for r in rows],
    )  # fmt: skip
    save_results(args.json, {"config": asdict(cfg), "environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
