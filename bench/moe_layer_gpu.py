"""Forward+backward throughput of the MoE layer on one GPU: per-expert loop vs grouped GEMM (BF16) vs FP8 experts.

Setting (DeepSeek-V2-Lite-like, every size is a flag): 8192 tokens, hidden 2048, expert FFN hidden 1408, 64 experts,
top-6 softmax routing, BF16 parameters and activations (the router in FP32, as always), dropless, no shared expert,
no balancing loss. One process, one GPU, no expert parallelism: `MoELayer(cfg)` with `ep_group=None` and the
'alltoall' dispatcher, whose single-process path only sorts the rows by expert and scatters them back (no
communication), so the differences between the rows are the experts' GEMMs.

Variants (table rows), all the same layer with the same weights (the first's state dict loaded into the others),
hence the same routing of the same tokens:

- loop:         `moe_grouped_gemm=False`: `moe.layer.experts.loop_linear`, one `x_e @ w[e]` per expert for each of the
                three GEMMs (forward, input grad, weight grad) of FC1 and FC2: the plain PyTorch baseline.
- grouped_bf16: `moe_grouped_gemm=True`: `moe.layer.experts.grouped_linear`, one `torch._grouped_mm` per GEMM over all
                experts. Skipped (with the reason) where `_grouped_mm` fails the layer's probe for the device and
                dtype, since the layer would silently run the loop instead.
- fp8:          `fp8='e4m3'`: `moe.layer.fp8.Fp8SwiGLUExperts`, DeepSeek-V3 block-wise FP8 (1x128 activation tiles,
                128x128 weight blocks, FP32 accumulation) through `torch._scaled_mm`, one call per expert per GEMM;
                the BF16 weights are master weights quantised every step. Skipped where `_scaled_mm` fails
                moe.layer.fp8's probe (the layer would emulate FP8 in FP32) and always on the CPU. The JSON's
                `kernel_calls` and the notes say what share of the FP8 GEMMs ran on `_scaled_mm` (`scaled_matmul`
                emulates a GEMM whose output width is not a multiple of 16).

Correctness first: each variant runs one step before any timing, and its output, input gradient and expert weight
gradients are compared with the loop's (relative RMS error, `||a - b|| / ||b||`). BF16 GEMMs accumulate in FP32 and
round once to BF16 (relative RMS ~2^-9 / sqrt(3) ~ 1e-3 per rounding); the grouped and the loop GEMMs differ only
in summation order and where those roundings fall, a few per chain (FC1, SwiGLU, FC2 and their backward):
a few 1e-3 expected, bound 2e-2 (34 dB). FP8 E4M3 keeps 3 mantissa bits (~2.5% RMS per quantised operand, both
operands of every GEMM): the emulated layer is 6.4% off the BF16 loop in every compared tensor (H 2048, F 1408 and
H 512, F 256 alike); bound 1e-1, the 20 dB the repo's FP8 tests accept against unquantised experts. A wrong expert
offset, a lost row or a transposed weight gives errors of order 1. The same step counts the calls of the torch
kernel the variant stands for (`torch._grouped_mm`, `torch._scaled_mm`): a variant that fell back to another path
fails. A failing variant is not timed; the script then exits with status 1 after writing the table and the JSON.

Timing: one step = parameter grads set to None, `out = layer(x)`, `out.backward(grad)` (`_common.train_step`).
Each variant runs `--warmup` untimed steps; then `--rounds` rounds, each timing `--iters` back-to-back steps of every
variant in turn between two CUDA events (so the host's launches and the layer's host syncs, e.g. the per-expert row
counts, count, as in training). Per variant the median over rounds of ms per step; tokens/s = tokens / that time;
'vs loop' = this variant's tokens/s / the loop's in the same run (the ratio is what carries over between runs of a
noisy machine). Expert TFLOP/s counts the six GEMMs of each expert MLP (18 N H F flops, N = tokens x top-k rows).

Run on a machine with a CUDA GPU (the mtdeepep CUDA executor is not needed):

    python bench/moe_layer_gpu.py                  # table + bench/results/moe_layer_gpu.json
    python bench/moe_layer_gpu.py --tokens 16384 --experts 128 --topk 8 --iters 20 --rounds 5

Without a CUDA device it prints why and exits with status 2. `--dry-run` runs the same code on the CPU (BF16, 256
tokens, hidden 256, FFN 128, 8 experts, top-2, 2 steps; the FP8 row skipped) to check the plumbing
(tests/test_bench_moe_layer_gpu.py); its times say nothing about the GPU.

Legend: T tokens, H hidden, F expert FFN hidden, E experts, K top-k, N = T K expert rows.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import _common as common
import torch
from _common import RESULTS_DIR, environment, make_parser, print_table, save_results, train_step

import moe.layer.fp8.gemm
from moe import MoEConfig, MoELayer
from moe.layer.experts import grouped_mm_available
from moe.layer.fp8 import COL_TILE, WEIGHT_TILE, probe_scaled_mm, scaled_mm_variant

DTYPE = torch.bfloat16
BASELINE = "loop"
EXIT_NO_GPU = 2
EXIT_PARITY = 1


@dataclass(frozen=True)
class BenchConfig(common.BenchConfig):
    ffn_hidden: int = 1408
    experts: int = 64
    rounds: int = 3
    seed: int = 0


# The full run: DeepSeek-V2-Lite's MoE layer (hidden 2048, expert FFN 1408, top-6 of 64 experts), 8192 tokens.
FULL = BenchConfig(tokens=8192, hidden=2048, topk=6, warmup=3)
# Small enough for a 2-core CPU in seconds; hidden and FFN multiples of 128 like the real sizes.
DRY_RUN = BenchConfig(tokens=256, hidden=256, ffn_hidden=128, experts=8, topk=2, iters=2, warmup=1, rounds=2)

HELPS = {
    "tokens": "tokens per step",
    "hidden": "hidden size",
    "ffn_hidden": "expert FFN hidden size (moe_ffn_hidden_size)",
    "experts": "routed experts",
    "topk": "experts per token",
    "iters": "timed steps per variant per round",
    "warmup": "untimed steps per variant before the rounds",
    "rounds": "timing rounds (all variants in turn each round); the median is reported",
    "seed": "seed of the weights and the tokens",
}


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[tuple[str, Any], ...]  # MoEConfig fields on top of the common ones
    tolerance: float  # relative RMS error against the loop (see the docstring); 0 for the loop itself
    kernel: str | None  # the torch function that must run for the variant to be what it says


VARIANTS = (
    Variant(BASELINE, (("moe_grouped_gemm", False),), 0.0, None),
    Variant("grouped_bf16", (("moe_grouped_gemm", True),), 2e-2, "_grouped_mm"),
    Variant("fp8", (("moe_grouped_gemm", True), ("fp8", "e4m3")), 1e-1, "_scaled_mm"),
)


# ---------------------------------------------------------------------------------------------------------------
# Layers and inputs


def layer_config(cfg: BenchConfig, variant: Variant) -> MoEConfig:
    return MoEConfig(
        hidden_size=cfg.hidden,
        num_moe_experts=cfg.experts,
        moe_ffn_hidden_size=cfg.ffn_hidden,
        moe_router_topk=cfg.topk,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall",  # single process: no communication, no mtdeepep buffer
        **dict(variant.overrides),
    )


def build_layers(cfg: BenchConfig, variants: list[Variant], device: torch.device) -> dict[str, MoELayer]:
    """One layer per variant, all holding the first one's weights (hence the same routing)."""
    layers: dict[str, MoELayer] = {}
    for variant in variants:
        torch.manual_seed(cfg.seed)
        layer = MoELayer(layer_config(cfg, variant), dtype=DTYPE, device=device)
        if layers:
            layer.load_state_dict(next(iter(layers.values())).state_dict())
        layers[variant.name] = layer
    return layers


def make_inputs(cfg: BenchConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and the output gradient, `[T, H]` each, drawn on the host (the same on every device)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(device, DTYPE)
    grad_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(device, DTYPE)
    return x_TH, grad_TH


def skip_reason(variant: Variant, cfg: BenchConfig, device: torch.device) -> str | None:
    """Why `variant` cannot run what it stands for on `device` (the layer would fall back silently), or None."""
    if variant.kernel == "_grouped_mm":
        if not grouped_mm_available(device.type, DTYPE):
            return f"torch._grouped_mm failed moe.layer.experts' probe on {device.type} {DTYPE} (the layer would loop)"
        if cfg.hidden % 8 or cfg.ffn_hidden % 8:
            return "torch._grouped_mm needs 16-byte rows: hidden and FFN hidden multiples of 8"
    if variant.kernel == "_scaled_mm":
        if device.type != "cuda":
            return (
                "FP8 GEMMs through torch._scaled_mm need a CUDA device (on the CPU moe.layer.fp8 emulates them: "
                "dequantise + FP32 matmul, no FP8 timing)"
            )
        # Probe both tilings now: the first FP8 step would otherwise probe inside the counted step (checked_step).
        for tile, what in ((WEIGHT_TILE, "block-wise"), (COL_TILE, "128x1 (weight gradient)")):
            if scaled_mm_variant(device, tile) is None:
                tried = "; ".join(f"{tuple(v)}: {why}" for v, why in probe_scaled_mm(device, tile))
                return f"torch._scaled_mm failed moe.layer.fp8's {what} probe (the layer would emulate): {tried}"
        if cfg.hidden % 16 or cfg.ffn_hidden % 16:
            return "torch._scaled_mm needs hidden and FFN hidden multiples of 16 (the layer would emulate FP8)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Correctness: one step against the loop, counting the kernels that ran


@contextlib.contextmanager
def counting_calls(targets: dict[str, tuple[Any, str]]) -> Iterator[dict[str, int]]:
    """Counts the calls of `getattr(owner, attr)` for each `name: (owner, attr)` while active (the moe code looks
    the functions up at call time, so wrapping the attribute sees every call)."""
    counts = dict.fromkeys(targets, 0)
    saved = {name: getattr(owner, attr) for name, (owner, attr) in targets.items()}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    try:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, counted(name, saved[name]))
        yield counts
    finally:
        for name, (owner, attr) in targets.items():
            setattr(owner, attr, saved[name])


KERNEL_SPIES = {
    "_grouped_mm": (torch, "_grouped_mm"),
    "_scaled_mm": (torch, "_scaled_mm"),
    # every FP8 GEMM, on _scaled_mm or emulated (key kept: the JSON's)
    "fp8_matmul": (moe.layer.fp8.gemm, "scaled_matmul"),
}


def checked_step(layer: MoELayer, x_TH: torch.Tensor, grad_TH: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """One step: the tensors to compare (output, input grad, expert weight grads) and the kernel call counts."""
    with counting_calls({n: t for n, t in KERNEL_SPIES.items() if hasattr(t[0], t[1])}) as calls:
        out_TH, x_grad_TH = train_step(layer, x_TH, grad_TH)
    tensors = {"out": out_TH, "x_grad": x_grad_TH, "w13_grad": layer.experts.w13.grad, "w2_grad": layer.experts.w2.grad}
    return {name: t.detach().float() for name, t in tensors.items()}, dict(calls)


def relative_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def check_variant(variant: Variant, tensors: dict, reference: dict, calls: dict[str, int]) -> str | None:
    """Why the variant's step is wrong (errors over its tolerance, its kernel never ran), or None."""
    if variant.kernel is not None and calls.get(variant.kernel, 0) == 0:
        return f"torch.{variant.kernel} never ran: the layer fell back to another path"
    errors = {name: relative_rms(tensors[name], reference[name]) for name in reference}
    over = {name: err for name, err in errors.items() if err > variant.tolerance}
    if over:
        worst = ", ".join(f"{name} {err:.2e}" for name, err in over.items())
        return f"relative RMS error vs {BASELINE} over {variant.tolerance:g}: {worst}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Seconds per step over `iters` back-to-back steps: CUDA events on a GPU (the device's time from the first
    launch to the last kernel), the host's clock on the CPU (where the work runs synchronously)."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    start_s = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - start_s) / iters


def warm_up(steps: dict[str, Callable[[], Any]], cfg: BenchConfig, device: torch.device) -> dict[str, float]:
    """`cfg.warmup` untimed steps of each variant; on a GPU returns each variant's step memory in GiB: the peak
    during its steps above what was allocated before them (activations, gradients, workspaces; all layers' weights
    stay resident and are not counted)."""
    step_memory = {}
    for name, step in steps.items():
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        for _ in range(cfg.warmup):
            step()
        if device.type == "cuda":
            synchronize(device)
            step_memory[name] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    return step_memory


def time_rounds(steps: dict[str, Callable[[], Any]], cfg: BenchConfig, device: torch.device) -> dict[str, list]:
    """Seconds per step of each variant per round; the variants take turns within a round, so a slow drift of the
    machine (clocks, another tenant) hits them alike."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(cfg.rounds):
        for name, step in steps.items():
            samples[name].append(time_steps(step, cfg.iters, device))
    return samples


def expert_flops(cfg: BenchConfig) -> float:
    """FLOPs of the expert GEMMs in one step: per row, FC1 (H -> 2F) and FC2 (F -> H) forward, input grad and
    weight grad: 3 x 2 x (2 H F + F H) = 18 H F."""
    return 18.0 * cfg.tokens * cfg.topk * cfg.hidden * cfg.ffn_hidden


# ---------------------------------------------------------------------------------------------------------------
# The run


def run(cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    """One row per variant in `VARIANTS` order: skipped (why), failed (why) or timed."""
    rows = {v.name: {"variant": v.name, "status": "skipped", "reason": skip_reason(v, cfg, device)} for v in VARIANTS}
    runnable = [v for v in VARIANTS if rows[v.name]["reason"] is None]
    if runnable[0].name != BASELINE:
        raise RuntimeError(f"the baseline '{BASELINE}' cannot run: {rows[BASELINE]['reason']}")
    layers = build_layers(cfg, runnable, device)
    x_TH, grad_TH = make_inputs(cfg, device)

    timed: dict[str, Callable[[], Any]] = {}
    reference: dict[str, torch.Tensor] = {}
    for variant in runnable:
        layer = layers[variant.name]
        tensors, calls = checked_step(layer, x_TH, grad_TH)
        if not reference:
            reference = tensors
        row = rows[variant.name]
        row["parity_vs_" + BASELINE] = {name: relative_rms(tensors[name], reference[name]) for name in reference}
        row["tolerance"] = variant.tolerance
        row["kernel_calls"] = calls
        row["reason"] = check_variant(variant, tensors, reference, calls)
        if row["reason"] is not None:
            row["status"] = "failed"
            del layers[variant.name]  # not timed, and its memory back for the others
            continue
        row["status"] = "ok"
        timed[variant.name] = lambda layer=layer: train_step(layer, x_TH, grad_TH)
    del reference, tensors  # FP32 copies of the weight grads: GiBs at the full size

    step_memory = warm_up(timed, cfg, device)
    for name, seconds in time_rounds(timed, cfg, device).items():
        rows[name].update(timing_fields(cfg, seconds), step_memory_gib=step_memory.get(name))
    base = rows[BASELINE].get("tokens_per_s")
    for row in rows.values():
        if "tokens_per_s" in row and base:
            row["vs_" + BASELINE] = row["tokens_per_s"] / base
    return list(rows.values())


def timing_fields(cfg: BenchConfig, seconds: list[float]) -> dict[str, Any]:
    step_s = statistics.median(seconds)
    return {
        "time_ms": step_s * 1e3,
        "tokens_per_s": cfg.tokens / step_s,
        "expert_tflops": expert_flops(cfg) / step_s / 1e12,
        "samples_ms": [s * 1e3 for s in seconds],
    }


# ---------------------------------------------------------------------------------------------------------------
# Report

TABLE_HEADERS = ("variant", "status", "fwd+bwd ms", "tokens/s", "vs loop", "expert TFLOP/s", "max rel err")


def table_row(row: dict[str, Any]) -> list[str]:
    if row["status"] != "ok":
        return [row["variant"], row["status"], "-", "-", "-", "-", "-"]
    parity = row["parity_vs_" + BASELINE]
    return [
        row["variant"],
        row["status"],
        f"{row['time_ms']:.2f}",
        f"{row['tokens_per_s']:.0f}",
        f"{row['vs_' + BASELINE]:.2f}x",
        f"{row['expert_tflops']:.1f}" if row["expert_tflops"] >= 1 else f"{row['expert_tflops']:.2g}",
        f"{max(parity.values()):.1e}",
    ]


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """What the table cannot say: skip and failure reasons, and how much of the FP8 work ran in FP8."""
    lines = [
        f"'vs loop' = tokens/s / the loop's in this run; max rel err = worst relative RMS error vs the loop over "
        f"output, input grad and expert weight grads (bf16 bound {VARIANTS[1].tolerance:g}, fp8 "
        f"{VARIANTS[2].tolerance:g})"
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['variant']} {row['status']}: {row['reason']}")
        calls = row.get("kernel_calls", {})
        if row["status"] == "ok" and calls.get("fp8_matmul"):
            share = calls["_scaled_mm"] / calls["fp8_matmul"]
            lines.append(
                f"{row['variant']}: {calls['_scaled_mm']} of {calls['fp8_matmul']} FP8 GEMMs per step on "
                f"torch._scaled_mm ({share:.0%}); the rest emulated (output widths not a multiple of 16)"
            )
    return lines


def device_environment(device: torch.device) -> dict[str, Any]:
    env = environment()
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return env


# ---------------------------------------------------------------------------------------------------------------
# Command line


def parse_args():
    parser = make_parser(__doc__)
    for f in fields(BenchConfig):
        default, dry = getattr(FULL, f.name), getattr(DRY_RUN, f.name)
        # None = not given: the default of the mode (full or --dry-run) applies.
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=int, default=None, help=f"{HELPS[f.name]} ({default}; dry run {dry})"
        )
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU at tiny sizes (tests the plumbing)")
    parser.add_argument(
        "--json", type=Path, default=RESULTS_DIR / "moe_layer_gpu.json", help="results file (bench/results/...)"
    )
    return parser.parse_args()


def config_from_args(args) -> BenchConfig:
    """The mode's defaults (full or --dry-run) with the options given on the command line."""
    given = {f.name: getattr(args, f.name) for f in fields(BenchConfig) if getattr(args, f.name) is not None}
    cfg = replace(DRY_RUN if args.dry_run else FULL, **given)
    if min(cfg.tokens, cfg.hidden, cfg.ffn_hidden, cfg.experts, cfg.topk, cfg.iters, cfg.rounds) < 1 or cfg.warmup < 0:
        raise SystemExit(f"sizes, --iters and --rounds must be positive, --warmup >= 0: {cfg}")
    return cfg


def main() -> int:
    args = parse_args()
    cfg = config_from_args(args)
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA device: this benchmark measures a GPU (--dry-run runs its code on the CPU)", file=sys.stderr)
        return EXIT_NO_GPU

    wall_start = time.perf_counter()
    rows = run(cfg, device)
    wall_s = time.perf_counter() - wall_start
    env = device_environment(device)
    print(
        f"{env.get('gpu', 'cpu')}{' (dry run)' if args.dry_run else ''}: T={cfg.tokens}, H={cfg.hidden}, "
        f"F={cfg.ffn_hidden}, E={cfg.experts}, K={cfg.topk}, {str(DTYPE).removeprefix('torch.')}, dropless, EP 1; "
        f"median over {cfg.rounds} rounds of {cfg.iters} steps after {cfg.warmup} warm-up steps"
    )
    print_table(TABLE_HEADERS, [table_row(row) for row in rows], *notes(rows))
    save_results(
        args.json,
        {
            "config": asdict(cfg),
            "dry_run": args.dry_run,
            "device": str(device),
            "dtype": str(DTYPE),
            "layer": {
                "dispatcher": "alltoall",
                "ep_size": 1,
                "variants": {v.name: dict(v.overrides) for v in VARIANTS},
            },
            "wall_seconds": wall_s,
            "environment": env,
            "rows": rows,
        },
    )
    return EXIT_PARITY if any(row["status"] == "failed" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
