"""What watching a run costs a training step: the MoE layer's trace regions when no profiler runs (off), against
the same step with the regions taken out (main's code path before them), in one process, step by step in turns;
then what TensorBoard and W&B logging add per step when on, and a step under `torch.profiler`.

Setting: `Trainer.train_step` on tiny's model (examples/deepseek_v3/configs/tiny.toml: 4 layers, 3 MoE + the MTP
block, 8 experts) at `--global-batch` x `--seq-len` tokens in 2 micro-batches, FP32, one intra-op thread (train.sh's
setting per rank), the same random tokens every step. Variants, alternated every step after `--warmup` steps:

- baseline: `moe.layer.moe_layer.region` replaced by a function returning the null context without asking torch whether
  a profiler records: the layer as it ran before the regions (a `with` of a no-op context remains);
- off: the code as it is, no profiler, no logger (what every run without the options pays).

Printed per variant: the median and the least wall time and thread CPU time of a step (the CPU time and the least
are steadier on a shared machine), and the ratios off / baseline. Because a 1% difference is below the noise of a
shared machine, a bound that does not depend on that noise is printed too: the region calls per step (counted) x the
cost of one call with no profiler (timed over 200k calls) over the step's time. Then, on: the time of writing one
step's record to TensorBoard and to W&B (offline) over the step's time, and the median step time under
`torch.profiler` (CPU activity, shapes) over the off step time.

    PYTHONPATH=. python bench/observe_overhead.py [--iters 30] [--warmup 3]

Measured (2026-11-28, 20:16 UTC, this 2-core machine shared with other jobs, load average 11-17, 30 steps per
variant, defaults): off / baseline median CPU time 0.967, least CPU time 0.989, median wall 1.088, least wall 0.851
(the wall times swing with the load); 56 region calls per step x 1.80 us = 0.026% of the step's CPU time (the
bound). On: TensorBoard 3.9 ms per step (21 scalars) = 0.29% of the step, W&B offline 0.52 ms = 0.04%; under
torch.profiler a step took 0.88x off (the load; an earlier run, load 20: 1.5x).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import make_parser  # noqa: E402
from moe.layer import moe_layer, trace_regions  # noqa: E402
from moe.layer.phase_timer import NULL_PHASE  # noqa: E402
from moe.trainer import run  # noqa: E402
from moe.trainer.data.token_file import TokenBatches  # noqa: E402
from moe.trainer.train.job_config import job_from_args  # noqa: E402
from moe.trainer.train.loggers import MetricsConfig, open_loggers, scalars  # noqa: E402
from moe.trainer.train.parallel_state import ParallelState  # noqa: E402
from moe.trainer.train.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "deepseek_v3" / "configs" / "tiny.toml"


def build_trainer(run_dir: Path, global_batch: int, seq_len: int, steps: int) -> Trainer:
    """tiny's model and trainer as train.py builds them (moe/trainer/run.py), constant learning rate 3e-4."""
    job = job_from_args(TINY, ["--steps", str(steps), "--global-batch-size", str(global_batch), "--micro-batches", "2",
                               "--seq-length", str(seq_len), "--lr", "3e-4", "--min-lr", "0",
                               "--lr-warmup-iters", "0"])  # fmt: skip
    parallel = ParallelState.single()
    model, _ = run.build_model(job, parallel, None, seed=0)
    vocab = job.model.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (global_batch + 1) * seq_len).astype(np.int64)
    batches = TokenBatches(tokens, seq_len=seq_len, global_batch=global_batch, val_sequences=1, seed=0)
    return run.build_trainer(job, model, parallel, batches, run_dir, seed=0)


def timed_step(trainer: Trainer, step: int) -> tuple[float, float, dict]:
    wall, cpu = time.perf_counter(), time.thread_time()
    record = trainer.train_step(step)
    return time.perf_counter() - wall, time.thread_time() - cpu, record


def region_call_cost(calls: int = 200_000) -> float:
    """Seconds per `region(...)` entered and left with no profiler running."""
    start = time.perf_counter()
    for _ in range(calls):
        with trace_regions.region(trace_regions.DISPATCH):
            pass
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = make_parser(__doc__)
    p.add_argument("--iters", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    real_region = moe_layer.region

    def baseline_region(name: str):
        return NULL_PHASE

    calls = 0

    def counting_region(name: str):
        nonlocal calls
        calls += 1
        return real_region(name)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        trainer = build_trainer(run_dir, args.global_batch, args.seq_len, steps=10**6)
        step = 0
        for _ in range(args.warmup):
            step += 1
            trainer.train_step(step)
        times: dict[str, list[tuple[float, float]]] = {"baseline": [], "off": []}
        record = None
        for _ in range(args.iters):
            for variant in ("baseline", "off"):
                moe_layer.region = baseline_region if variant == "baseline" else real_region
                step += 1
                wall, cpu, record = timed_step(trainer, step)
                times[variant].append((wall, cpu))
        moe_layer.region = counting_region
        step += 1
        trainer.train_step(step)
        moe_layer.region = real_region
        if calls == 0:  # the variants above would then have timed the same code
            raise RuntimeError("no region call counted: moe.layer.moe_layer no longer calls `region` by that name")
        per_call = region_call_cost()

        med = {v: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for v, ts in times.items()}
        low = {v: (min(t[0] for t in ts), min(t[1] for t in ts)) for v, ts in times.items()}
        print(f"train_step, tiny, {args.global_batch} x {args.seq_len} tokens, 2 micro-batches, 1 thread, "
              f"{args.iters} steps per variant in turns")  # fmt: skip
        print(f"{'variant':<10} {'wall ms':>9} {'cpu ms':>9} {'min wall':>9} {'min cpu':>9}")
        for v, (wall, cpu) in med.items():
            print(f"{v:<10} {wall * 1e3:>9.2f} {cpu * 1e3:>9.2f} {low[v][0] * 1e3:>9.2f} {low[v][1] * 1e3:>9.2f}")
        ratio_wall, ratio_cpu = (med["off"][i] / med["baseline"][i] for i in (0, 1))
        min_wall, min_cpu = (low["off"][i] / low["baseline"][i] for i in (0, 1))
        print(f"off / baseline: median wall {ratio_wall:.4f}, cpu {ratio_cpu:.4f}; min wall {min_wall:.4f}, "
              f"cpu {min_cpu:.4f}")  # fmt: skip
        bound = calls * per_call / med["off"][1]
        print(f"region calls per step {calls} x {per_call * 1e6:.2f} us each (no profiler) = "
              f"{calls * per_call * 1e6:.0f} us = {100 * bound:.3f}% of the step's CPU time")  # fmt: skip

        # On: the loggers' cost per step (one record), and a step under the profiler.
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        metrics = MetricsConfig(tensorboard_dir=str(run_dir / "tb"), wandb_project="bench", wandb_save_dir=str(run_dir))
        loggers = open_loggers(metrics, run_dir, 0, tables={}, config_toml="")
        values = scalars(record)
        for logger in loggers:
            costs = []
            for i in range(args.iters):
                start = time.perf_counter()
                logger.log(i + 1, values)
                costs.append(time.perf_counter() - start)
            logger.close()
            cost = statistics.median(costs)
            print(f"{type(logger).__name__}: {len(values)} scalars per step, {cost * 1e3:.3f} ms = "
                  f"{100 * cost / med['off'][0]:.2f}% of the step's wall time")  # fmt: skip
        from torch.profiler import ProfilerActivity, profile

        profiled = []
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
            for _ in range(3):
                step += 1
                profiled.append(timed_step(trainer, step)[0])
        print(f"under torch.profiler: {statistics.median(profiled) * 1e3:.2f} ms per step = "
              f"{statistics.median(profiled) / med['off'][0]:.2f} x off")  # fmt: skip


if __name__ == "__main__":
    main()
