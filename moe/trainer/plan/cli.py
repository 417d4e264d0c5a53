"""Plan the parallel layout of a DeepSeek-V3 training run before running it (a SimuMax-like strategy search).

Usage: examples/deepseek_v3/plan.py, the command line that runs `main`.

Enumerates every TP / PP / EP / DP split of --devices (with expert tensor parallelism, ETP: each routed expert's
FFN split over etp ranks, the dispatch over the folded ep x etp group; the pipeline schedule 1F1B / ZB-H1 /
DualPipeV / interleaved 1F1B with its virtual stages, the recompute setting, the FP8 recipe and ZeRO-1), drops what
train.py would refuse (the trainer's own rules: moe/trainer/plan/space.py), estimates every remaining layout's peak
memory and step time analytically (moe/trainer/plan/memory_estimate.py, moe/trainer/plan/timing.py) on the --device-spec
(h100, h200, mtt-s4000, mtt-s5000, cpu, or a JSON file of DeviceSpec fields; --list-devices prints every figure with its
source), drops what does not fit in memory, and prints the K fastest with their breakdown (an etp column when one of
them uses ETP), the train.py command of the best layout, and how many choices each rule rejected. The batch
(global_batch, micro_batches, seq_len) and dtype come from the config's [training] table unless given.

--layout prices one named layout instead (the notation of the ranked table, moe/trainer/plan/layout.py; its device count
is tp x pp x dp, --devices may be left out): memory per pipeline stage, the step time and its breakdown (GEMMs,
attention, element-wise, all-to-all, TP / PP / DP communication, bubble, optimizer); a layout train.py would
refuse is an error naming the rule. --framework prices another trainer's runs of it (moe/trainer/plan/framework.py).
--num-layers / --first-k-dense / --mtp-depths override the config's layer counts (e.g. a 4-layer cut of 671B).

Exit status: 0, 1 when no layout fits (or the named layout does not fit in memory), 2 for bad arguments (unknown
spec, bad config, bad or rejected layout, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.plan import report
from moe.trainer.plan.calibrate import calibrated_cpu_spec
from moe.trainer.plan.devices import SPECS, load_device_spec
from moe.trainer.plan.framework import FRAMEWORKS
from moe.trainer.plan.layout import check_layout, parse_layout
from moe.trainer.plan.memory_estimate import GIB, memory_by_stage
from moe.trainer.plan.model_shape import RECOMPUTE_CHOICES, ModelShape
from moe.trainer.plan.search import estimate, plan
from moe.trainer.plan.space import Workload
from moe.trainer.train.parallel_state import FP8_RECIPES
from moe.trainer.train.training_config import TrainingConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", help="TOML file with [model] and [training] tables (the old flat [training] too)")
    p.add_argument("--devices", type=int, help="number of devices (ranks)")
    p.add_argument("--device-spec", help=f"one of {', '.join(SPECS)}, or a JSON file of DeviceSpec fields")
    p.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: [training] global_batch)")
    p.add_argument("--micro-batches", type=int, help="micro-batches per dp rank (default: [training])")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: [training] seq_len)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="model dtype (default: [training] dtype)")
    p.add_argument("--recompute", nargs="+", choices=tuple(RECOMPUTE_CHOICES), default=list(RECOMPUTE_CHOICES),
                   help="recompute choices to consider (default: all)")  # fmt: skip
    p.add_argument("--fp8", nargs="+", choices=FP8_RECIPES, default=list(FP8_RECIPES),
                   help="FP8 recipes to consider (default: all)")  # fmt: skip
    p.add_argument("--max-tp", type=int, default=None, help="largest tensor-parallel size to consider")
    p.add_argument("--calibrate", action="store_true",
                   help="with --device-spec cpu: measure GEMM, copy and gloo rates on this machine first")  # fmt: skip
    p.add_argument("--list-devices", action="store_true", help="print the device specs with their sources; exit")
    p.add_argument("--json", type=Path, default=None, help="also write the ranked layouts and rejections here")
    p.add_argument("--layout", help="price this one layout, e.g. 'tp1 pp2 ep4 dp4 1f1b zero1' (no search)")
    p.add_argument(
        "--framework",
        choices=tuple(FRAMEWORKS),
        default="train.py",
        help="the trainer priced (default train.py; megatron-alltoall: Megatron-LM as SimuMax ran it)",
    )
    p.add_argument("--num-layers", type=int, help="override [model] num_hidden_layers")
    p.add_argument("--first-k-dense", type=int, help="override [model] first_k_dense_replace")
    p.add_argument("--mtp-depths", type=int, help="override [model] num_nextn_predict_layers")
    return p.parse_args(argv)


def _human(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _fail(message: str) -> int:
    print(f"plan.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_devices:
        print("\n\n".join(report.spec_table(spec) for spec in SPECS.values()))
        return 0
    needed = ("config", "device_spec") if args.layout else ("config", "devices", "device_spec")
    missing = [f"--{n.replace('_', '-')}" for n in needed if getattr(args, n) is None]
    if missing:
        return _fail(f"the following arguments are required: {', '.join(missing)}")
    try:
        cand = parse_layout(args.layout) if args.layout else None
        if cand is not None:
            if args.devices is not None and args.devices != cand.world:
                raise ValueError(f"--devices {args.devices} but layout {args.layout!r} is {cand.world} devices")
            args.devices = cand.world
        if args.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {args.devices}")
        if args.top < 1:
            raise ValueError(f"--top must be >= 1, got {args.top}")
        spec = load_device_spec(args.device_spec)
        if args.calibrate and spec.name != "cpu":
            raise ValueError("--calibrate measures this machine: use it with --device-spec cpu")
        config = DeepseekV3Config.from_toml(args.config)
        overrides = {name: value for name, value in (("num_hidden_layers", args.num_layers),
                     ("first_k_dense_replace", args.first_k_dense), ("num_nextn_predict_layers", args.mtp_depths))
                     if value is not None}  # fmt: skip
        if overrides:
            config = dataclasses.replace(config, **overrides)
        training = TrainingConfig.from_toml(args.config)
        work = Workload(
            global_batch=args.global_batch or training.global_batch,
            micro_batches=args.micro_batches or training.micro_batches,
            seq_len=args.seq_len or training.seq_len,
            dtype=args.dtype or training.dtype,
        )
        if cand is not None:
            check_layout(cand, config, work, spec)
    except (ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    if cand is not None:
        return price_layout(args, cand, config, work, spec)
    if args.calibrate:
        print("calibrating the 'cpu' spec on this machine ...", flush=True)
        spec = calibrated_cpu_spec()

    shape = ModelShape.from_config(config)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = plan(config, work, args.devices, spec, recomputes=tuple(args.recompute), fp8s=tuple(args.fp8),
                  max_tp=args.max_tp)  # fmt: skip
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start

    model_flops = shape.model_flops_per_token(work.seq_len)
    total, activated, mtp = (_human(n) for n in (shape.total_params(), shape.activated_params(), shape.mtp_params()))
    print(
        f"DeepSeek-V3 {args.config}: {total} parameters ({activated} activated) + MTP {mtp}; "
        f"{model_flops / 1e9:.3g} GFLOP per token (fwd + bwd)"
    )
    print(f"{args.devices} x {spec.name} ({spec.title}); global batch {work.global_batch} x {work.seq_len} tokens, "
          f"{work.micro_batches} micro-batches per dp rank, {work.dtype}")  # fmt: skip
    # the search is one process: its CPU seconds are what it costs on an idle core of a shared machine
    print(f"{result.total:,} choices considered in {elapsed:.1f} s ({cpu:.1f} s of CPU): {len(result.ranked):,} fit, "
          f"{sum(result.rejected.values()):,} rejected\n")  # fmt: skip
    if result.ranked:
        print(f"top {min(args.top, len(result.ranked))} (fastest first):")
        print(report.ranked_table(result, args.top, shape, work, spec))
        print("\n" + report.legend())
        print("\nthe best layout's train.py command (#1):\n  " + report.flags_line(result.ranked[0], args.config))
    else:
        print("no layout fits: see the rejections (more devices, fewer sequences per micro-batch, recompute)")
    print("\nrejected:")
    print(report.rejection_table(result))
    if args.json is not None:
        rows = [
            {"layout": e.candidate.name(), "flags": e.candidate.train_flags(), "etp": e.candidate.etp,
             "memory_gib": e.memory.gib(), "time_s": e.time.as_dict()}
            for e in result.ranked[: args.top]
        ]  # fmt: skip
        payload = {"spec": spec.to_dict(), "workload": vars(work), "ranked": rows}
        payload.update(rejected=dict(result.rejected), total=result.total)
        args.json.write_text(json.dumps(payload, indent=1))
    return 0 if result.ranked else 1


def price_layout(args: argparse.Namespace, cand, config, work, spec) -> int:
    """Print (and with --json write) one layout's memory per stage and time breakdown (module docstring)."""
    if args.calibrate:
        spec = calibrated_cpu_spec()
    framework = FRAMEWORKS[args.framework]
    shape = ModelShape.from_config(config)
    est = estimate(cand, config, work, spec, framework)
    stages = memory_by_stage(cand, shape, work, spec, framework)
    capacity = spec.memory_capacity_bytes(cand.world) / GIB
    t = est.time
    elementwise = t.compute - t.recompute - t.gemm - t.attention
    breakdown = {"gemm": t.gemm, "attention": t.attention, "elementwise": elementwise, "recompute": t.recompute,
                 "all_to_all": t.ep_comm, "tp_comm": t.tp_comm, "pp_comm": t.pp_comm, "dp_comm": t.dp_comm,
                 "bubble": t.bubble, "optimizer": t.optimizer}  # fmt: skip
    print(f"layout {cand.name()} on {cand.world} x {spec.name} ({spec.title}), priced for {framework.name}")
    print(f"DeepSeek-V3 {args.config}: {config.num_hidden_layers} layers ({config.first_k_dense_replace} dense), "
          f"MTP {config.num_nextn_predict_layers}; global batch {work.global_batch} x {work.seq_len} tokens, "
          f"{work.micro_batches} micro-batches per dp rank, {work.dtype}\n")  # fmt: skip
    keys = ("weights", "grads", "optimizer", "activations", "transient", "comm_buffers", "runtime", "allocator")
    rows = [[str(m.pp_rank), f"{m.inflight:g}", *(f"{m.gib()[k]:.2f}" for k in keys), f"{m.allocated / GIB:.2f}",
             f"{m.total / GIB:.2f}"] for m in stages]  # fmt: skip
    print("memory per pipeline stage (GiB):")
    print(report.table(["stage", "(mb)", *keys, "allocated", "total"], rows))
    fits = max(m.total for m in stages) / GIB <= capacity
    print(f"device memory {capacity:.1f} GiB: {'fits' if fits else 'DOES NOT FIT'}\n")
    print(f"step {t.step * 1e3:.4g} ms ({est.tokens_per_s(work):.4g} tokens/s, MFU "
          f"{100 * est.mfu(shape, work, spec):.1f}%), bottleneck rank:")  # fmt: skip
    print(report.table(["part", "ms", "share"],
                       [[k, f"{v * 1e3:.4g}", f"{100 * v / t.step:.1f}%"] for k, v in breakdown.items()]))  # fmt: skip
    print("\ntrain.py flags: " + " ".join(cand.train_flags()))
    if args.json is not None:
        payload = {"layout": cand.name(), "flags": cand.train_flags(), "framework": dataclasses.asdict(framework),
                   "spec": spec.to_dict(), "workload": vars(work), "model": config.to_dict(),
                   "memory_gib_by_stage": [m.gib() for m in stages], "fits": fits,
                   "time_s": {**t.as_dict(), "elementwise": elementwise},
                   "time_breakdown_s": breakdown}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
