"""How much of ZeRO-1's gradient communication the backward hides (moe/trainer/train/zero.py).

Setting: an MLP of `--depth` blocks Linear(width, width) + GELU (FP32), a batch of `--rows` rows per rank, `--ranks`
gloo ranks of this host (the one launcher, `mtdeepep.utils.testing.run_ranks`), buckets of `--bucket-size` elements
(about one layer each). Each step: backward, `finish_grad_sync()`, AdamW step. Two modes alternate step by step:
- overlap off: every bucket's reduction is launched by `finish_grad_sync()` after the backward, so the time from
  the end of the backward to the end of the sync is the whole communication time `C`;
- overlap on: each bucket is launched by the gradient hooks as soon as it is complete; what remains after the
  backward is the exposed part `X`.
Hidden fraction = 1 - median(X) / median(C). The backward times of both modes are printed too: on a CPU the
collectives' threads share the cores with the backward, so hiding communication may lengthen the backward.

Pipelined mode (`--pipeline SCHEDULE`): DeepSeek-V3 `--config` (default tiny) trained by `moe.trainer.train.Trainer` at
PP2 x DP(`--ranks` / 2) with ZeRO-1 (`--bucket-size`, default 100k elements: a few buckets per stage), through
`moe.trainer.pipeline.PipelineRunner` (`--vpp`, `--micro-batches` of one `--seq-len` sequence per data-parallel rank).
Two trainers per rank from the same weights, `overlap_grad_reduce` off and on, alternate step by step:
- off (the trainer before issue 25): every bucket is launched by `reduce_gradients()` after the pipeline step, so
  the time it takes (the optimizer's grad_sync_start -> grad_sync_end events) is the whole reduction time `C`;
- on: each stage's buckets are launched right after the stage's last weight-gradient action (last B, or last W
  under a split backward), inside the schedule; what `reduce_gradients()` still waits for is the exposed part `X`.
Printed per pipeline rank (medians over its data-parallel ranks' steps): C, X, the hidden share 1 - X / C (before:
0 by construction, no launch inside the schedule, which is counted), the schedule's time in both modes, and
whether both modes gave the same losses and gradient norms (they must: the same sums, only earlier).

    PYTHONPATH=. .venv/bin/python bench/zero_overlap.py --ranks 2
    PYTHONPATH=. .venv/bin/python bench/zero_overlap.py --ranks 4 --pipeline zbh1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moe.trainer import run
from moe.trainer.data.token_file import TokenBatches
from moe.trainer.train.checkpoint import ModelIO
from moe.trainer.train.job_config import job_from_args
from moe.trainer.train.parallel_state import Layout, ParallelState
from moe.trainer.train.trainer import Trainer
from moe.trainer.train.training_config import OptimizerConfig
from moe.trainer.train.zero import DistributedAdamW, ZeroConfig
from mtdeepep.utils.testing import run_ranks

REPO = Path(__file__).resolve().parents[1]
PP = 2


def _worker(rank, world, group, args):
    del group
    par = ParallelState.from_process_group(Layout(world=world))
    cfg = OptimizerConfig(lr=1e-3, clip_grad=1.0)
    results = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.depth)])
        opt = DistributedAdamW(
            model, [], cfg, par, ZeroConfig(bucket_size=args.bucket_size, overlap_grad_reduce=overlap)
        )
        results[overlap] = (model, opt, [], [])
    x = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(rank))
    for step in range(args.warmup + args.steps):
        for model, opt, backward_s, exposed_s in results.values():
            opt.zero_grad()
            loss = model(x).square().mean()
            dist.barrier()
            start = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            opt.finish_grad_sync()
            synced = time.perf_counter()
            opt.clip(opt.global_grad_norm())
            opt.step(lr=1e-3)
            if step >= args.warmup:
                backward_s.append(end - start)
                exposed_s.append(synced - end)
    out = {}
    for overlap, (_, opt, backward_s, exposed_s) in results.items():
        out[overlap] = (statistics.median(backward_s), statistics.median(exposed_s), len(opt.buckets))
    return out


def _trainer(parallel: ParallelState, args, overlap: bool, run_dir: str) -> Trainer:
    """A fresh tiny model (seed 0) in its pipeline stages, and its Trainer with ZeRO-1 (`overlap_grad_reduce`)."""
    named = REPO / "examples" / "deepseek_v3" / "configs" / f"{args.config}.toml"
    config = Path(args.config) if args.config.endswith(".toml") else named
    dp, micro = parallel.layout.dp, args.micro_batches
    # The model in its stages and the trainer as train.py builds them (moe/trainer/run.py), constant learning rate.
    job = job_from_args(config, [
        "--pp", str(PP), "--pp-schedule", args.pipeline, "--vpp", str(args.vpp),
        "--steps", str(args.warmup + args.steps),
        "--global-batch-size", str(dp * micro), "--micro-batches", str(micro), "--seq-length", str(args.seq_len),
        "--lr", "1e-3", "--min-lr", "0", "--lr-warmup-iters", "0", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--use-distributed-optimizer", "--ddp-bucket-size", str(args.bucket_size),
        "--zero.overlap_grad_reduce", str(overlap).lower(),
    ], world=parallel.layout.world)  # fmt: skip
    model, runner = run.build_model(job, parallel, None, seed=0)
    tokens = np.random.default_rng(1).integers(0, job.model.vocab_size, 1 << 16).astype(np.int64)
    batches = TokenBatches(tokens, seq_len=args.seq_len, global_batch=dp * micro, val_sequences=0, seed=0)
    io = ModelIO(model.full_state_dict, lambda p, sd: None, lambda p: None)
    return run.build_trainer(job, model, parallel, batches, run_dir, seed=0, model_io=io, pipeline=runner)


def _pipeline_worker(rank, world, group, args):
    del group
    parallel = ParallelState.from_process_group(Layout(world=world, pp=PP, pp_schedule=args.pipeline, vpp=args.vpp))
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {overlap: _trainer(parallel, args, overlap, f"{tmp}/{overlap}") for overlap in (False, True)}
        times = {overlap: {"exposed": [], "schedule": [], "inside": []} for overlap in trainers}
        records = {overlap: [] for overlap in trainers}
        for step in range(1, args.warmup + args.steps + 1):
            for overlap, trainer in trainers.items():  # the modes take turns: a shared machine's load hits both
                record = trainer.train_step(step)
                records[overlap].append((record["loss"], record["grad_norm"]))
                if step <= args.warmup:
                    continue
                events = {name: t for name, _, t in trainer.optimizer.events if name.startswith("grad_sync")}
                start, end = trainer.pipeline.schedule_span
                launches = trainer.optimizer.launch_times()
                times[overlap]["exposed"].append(events["grad_sync_end"] - events["grad_sync_start"])
                times[overlap]["schedule"].append(end - start)
                times[overlap]["inside"].append(sum(t < end for _, t in launches) / len(launches))
        for trainer in trainers.values():
            trainer.checkpointer.close(True)
    return {"pp_rank": parallel.pp_rank, "times": times, "same": records[False] == records[True],
            "buckets": len(trainers[True].optimizer.buckets), "stages": trainers[True].pipeline.stage_ids}  # fmt: skip


def _pipeline_main(args) -> None:
    if args.ranks % PP:
        raise SystemExit(f"--pipeline runs PP{PP} x DP(ranks / {PP}): --ranks must be even, got {args.ranks}")
    results = run_ranks(_pipeline_worker, args.ranks, (args,), timeout_s=1800, threads=1)  # one core a rank
    vpp = f", {args.vpp} virtual stages per rank" if args.vpp > 1 else ""
    print(f"{args.pipeline}{vpp}, PP{PP} x DP{args.ranks // PP} on {args.ranks} gloo ranks, {args.config}, "
          f"{args.micro_batches} micro-batches of 1 x {args.seq_len} tokens per data-parallel rank, buckets of "
          f"{args.bucket_size} elements, {args.steps} timed steps per mode (medians)")  # fmt: skip
    hidden = []
    for pp_rank in range(PP):
        ranks = [r for r in results if r["pp_rank"] == pp_rank]

        def med(overlap, key, ranks=ranks):
            return statistics.median(v for r in ranks for v in r["times"][overlap][key])

        comm, exposed = med(False, "exposed"), med(True, "exposed")
        hidden.append(1 - exposed / comm)
        print(f"pipeline rank {pp_rank} (stages {ranks[0]['stages']}, {ranks[0]['buckets']} buckets):")
        for overlap, label in ((False, "off (before)"), (True, "on  (after) ")):
            print(f"  overlap {label}: reduction after the schedule {med(overlap, 'exposed') * 1e3:7.2f} ms, "
                  f"launched inside the schedule {100 * med(overlap, 'inside'):3.0f}%, schedule "
                  f"{med(overlap, 'schedule') * 1e3:7.1f} ms")  # fmt: skip
        steps = [med(overlap, "schedule") + med(overlap, "exposed") for overlap in (False, True)]
        print(f"  hidden: before 0% (by construction), after {100 * hidden[-1]:.0f}% of the {comm * 1e3:.2f} ms; "
              f"schedule + reduction after it {steps[0] * 1e3:.1f} -> {steps[1] * 1e3:.1f} ms")  # fmt: skip
    print(f"hidden share of the reduction, mean over the pipeline ranks: before 0%, after "
          f"{100 * statistics.mean(hidden):.0f}%; losses and gradient norms of both modes identical: "
          f"{all(r['same'] for r in results)}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--bucket-size", type=int, default=None, help="default 1.1M (MLP), 100k (--pipeline)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pipeline", choices=("1f1b", "zbh1", "dualpipev"), default=None,
                        help="pipelined mode: tiny DeepSeek-V3 at PP2 x DP(ranks / 2) under this schedule")  # fmt: skip
    parser.add_argument("--vpp", type=int, default=1, help="--pipeline: virtual stages per rank")
    parser.add_argument("--micro-batches", type=int, default=4, help="--pipeline: per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=128, help="--pipeline: tokens per sequence")
    parser.add_argument("--config", default="tiny", help="--pipeline: a DeepSeek-V3 config name or TOML path")
    args = parser.parse_args()
    if args.pipeline is not None:
        args.bucket_size = args.bucket_size or 100_000
        _pipeline_main(args)
        return
    args.bucket_size = args.bucket_size or 1_100_000
    results = run_ranks(_worker, args.ranks, (args,), timeout_s=600)
    off_b, comm, buckets = results[0][False]
    on_b, exposed, _ = results[0][True]
    params = args.depth * (args.width * args.width + args.width)
    print(f"{args.ranks} gloo ranks, {params / 1e6:.1f} M FP32 parameters in {buckets} buckets, rows {args.rows}")
    print(f"overlap off: backward {off_b * 1e3:7.1f} ms, communication after it {comm * 1e3:7.1f} ms")
    print(f"overlap on : backward {on_b * 1e3:7.1f} ms, communication after it {exposed * 1e3:7.1f} ms")
    print(f"hidden: {100 * (1 - exposed / comm):.0f}% of the communication time; step (backward + sync) "
          f"{(off_b + comm) * 1e3:.1f} -> {(on_b + exposed) * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
