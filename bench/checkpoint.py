"""Flash checkpoints of DeepSeek-V3 training (moe/trainer/train/checkpoint/): what a checkpoint costs the training step
(the copy of each rank's state into CPU memory) against the step time, what the background writer takes, checkpoint
sizes, and the synchronous gather-and-write save it replaced.

Setting: `examples/deepseek_v3/configs/small.toml`'s model (hidden 512, 4 layers, 16 routed experts, MTP) trained
by `moe.trainer.train.Trainer` on the python-stdlib corpus with a batch small enough for a 2-core CPU (`--global-batch`
sequences of `--seq-len` tokens, `--micro-batches` per data-parallel rank: a short step, so the comparison is the
strict one). Each row (`--rows`) is one job of fresh processes (the one launcher, `run_ranks`: gloo on 127.0.0.1,
`max(1, cores // ranks)` threads each):
1. `--warmup` steps, then `--steps` steps without checkpoints: "step ms" is their median;
2. `--checkpoints` checkpoints, one every `--between` steps: "save ms" is the median time `Trainer.save` blocked the
   step (collect the entries, wait for the previous write if still going, copy into the reused CPU buffers; the
   first save, which also allocates the buffers, is given apart), "save / step" their ratio (the issue's bound: at
   most 1), "step ms while writing" the median of the steps that ran while a write was in flight;
3. the writer thread's time per checkpoint ("write s": this rank's files, streamed with their sha256 and fsynced;
   "commit s": rank 0's manifest, checks and rename), the bytes of one rank's shard and of the whole checkpoint;
4. "sync save s": what the previous checkpoint format cost the step: the model and optimizer state gathered over
   the ranks, then written by rank 0 with `safetensors.torch.save_file` and fsynced, all synchronous.
Rows: `1` (one process, FP32), `1-bf16` (BF16 weights: FP32 masters in the optimizer state), `dp2-zero1` (2 ranks,
ZeRO-1: each rank copies and writes its half of the optimizer state), `ep2` (2 ranks, the experts split).
The largest rank's figures are reported. Checkpoints go to `--dir` (default: a temporary directory on the same disk
as /tmp).

Run (about 8 minutes on a 2-core machine with the defaults):

    .venv/bin/python bench/checkpoint.py
    .venv/bin/python bench/checkpoint.py --rows 1 --global-batch 32 --seq-len 512 --micro-batches 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import RESULTS_DIR, make_parser, num_cores, print_table, run_ranks, save_run

from moe import EPBuffers
from moe.trainer import run
from moe.trainer.data.token_file import TokenBatches, prepare_tokens
from moe.trainer.train.checkpoint import ModelIO
from moe.trainer.train.checkpoint.train_state import optimizer_entries
from moe.trainer.train.job_config import job_from_args
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
# name -> (ranks, expert-parallel size, ZeRO-1, dtype)
ROWS = {
    "1": (1, 1, False, "float32"),
    "1-bf16": (1, 1, False, "bfloat16"),
    "dp2-zero1": (2, 1, True, "float32"),
    "ep2": (2, 2, False, "float32"),
}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(rank: int, world: int, group, args: argparse.Namespace, row: str, work: str) -> dict[str, Any]:
    _, ep, zero, dtype = ROWS[row]
    # The config's model and trainer as train.py builds them (moe/trainer/run.py), with this row's batch, dtype,
    # expert parallelism and ZeRO-1, a checkpoint allowed at every step.
    argv = ["--global-batch-size", str(args.global_batch), "--seq-length", str(args.seq_len), "--micro-batches",
            str(args.micro_batches), "--save-interval", "1", "--steps", "10000", "--ep", str(ep),
            *(["--bf16"] if dtype == "bfloat16" else []),
            *(["--use-distributed-optimizer"] if zero else [])]  # fmt: skip
    job = job_from_args(REPO / args.config, argv, world=world)
    parallel = ParallelState.from_process_group(job.layout) if world > 1 else ParallelState.single()
    data = prepare_tokens(job.data, job.model.vocab_size, build=rank == 0, timeout_s=args.timeout)
    batches = TokenBatches(data.tokens, seq_len=args.seq_len, global_batch=args.global_batch,
                           val_sequences=job.data.val_sequences, seed=0)  # fmt: skip
    buffers = EPBuffers(timeout_s=args.timeout)
    model, _ = run.build_model(job, parallel, buffers, seed=0)
    io = ModelIO(model.full_state_dict, lambda path, sd: None, lambda path: None)
    run_dir = Path(work) / row
    trainer = run.build_trainer(job, model, parallel, batches, run_dir, seed=0, model_io=io,
                                checkpoint_timeout_s=args.timeout)  # fmt: skip
    step = 0

    def train(n: int) -> list[float]:
        nonlocal step
        times = []
        for _ in range(n):
            step += 1
            parallel.barrier()
            start = time.perf_counter()
            trainer.train_step(step)
            times.append(time.perf_counter() - start)
        return times

    train(args.warmup)
    plain = train(args.steps)
    save_call, during = [], []
    for _ in range(args.checkpoints):
        parallel.barrier()
        start = time.perf_counter()
        trainer.checkpointer.save(step)
        save_call.append(time.perf_counter() - start)
        during += train(args.between)[:1]  # the step right after the save runs beside the writer
    trainer.checkpointer.close(True)
    stats = trainer.checkpointer.stats
    sync_s = sync_save(trainer, Path(work) / f"{row}-sync", parallel)
    buffers.destroy()
    return {
        "rank": rank,
        "step_s": _median(plain),
        "step_during_write_s": _median(during),
        "first_save_s": save_call[0],
        "save_s": _median(save_call[1:]),
        "copy_s": _median([s.copy_s for s in stats[1:]]),
        "wait_previous_s": max(s.wait_previous_s for s in stats),
        "write_s": _median([s.write_s for s in stats]),
        "commit_s": _median([s.commit_s for s in stats]) if rank == 0 else 0.0,
        "shard_bytes": stats[-1].shard_bytes,
        "total_bytes": stats[-1].total_bytes if rank == 0 else 0,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "sync_save_s": sync_s,
    }


def sync_save(trainer: Trainer, out: Path, parallel: ParallelState) -> float:
    """The previous format's save, timed: gather the whole model and optimizer state to rank 0 (collective), rank 0
    writes both files and fsyncs them."""
    from safetensors.torch import save_file

    parallel.barrier()
    start = time.perf_counter()
    model_sd = {k: v.detach().clone() for k, v in trainer.model.full_state_dict().items()}
    optim_sd = _gathered_optimizer_state(trainer, parallel)
    if parallel.is_main:
        out.mkdir(parents=True, exist_ok=True)
        for name, sd in (("model.safetensors", model_sd), ("optimizer.safetensors", optim_sd)):
            save_file(sd, str(out / name))
            fd = os.open(out / name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    parallel.barrier()
    return time.perf_counter() - start


def _gathered_optimizer_state(trainer: Trainer, parallel: ParallelState) -> dict[str, torch.Tensor]:
    """Every element of the optimizer state once (the boxes each rank stores in a checkpoint), gathered to every
    rank: the bytes the previous format moved (its keys are `rank:index:key`, only their bytes matter here)."""
    entries = optimizer_entries(trainer.optimizer, parallel)
    mine = {f"{i}:{e.key}": e.tensor.detach().cpu().clone() for i, e in enumerate(entries) if e.write}
    parts = [mine]
    if parallel.layout.world > 1:
        parts = [None] * parallel.layout.world
        dist.all_gather_object(parts, mine)
    return {f"{r}:{k}": v for r, part in enumerate(parts) for k, v in part.items()}


def run_row(args: argparse.Namespace, row: str, work: str) -> dict[str, Any]:
    ranks = ROWS[row][0]
    if ranks == 1:
        torch.set_num_threads(num_cores())
        results = [measure(0, 1, None, args, row, work)]
    else:
        results = run_ranks(measure, ranks, (args, row, work), timeout_s=args.timeout)
    worst = {k: max(r[k] for r in results) for k in results[0] if k != "rank"}
    worst["step_s"] = max(r["step_s"] for r in results)
    return {"row": row, "ranks": ranks, **worst, "per_rank": results}


def parse_args() -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--config", default="examples/deepseek_v3/configs/small.toml")
    parser.add_argument("--rows", default="1,1-bf16,dp2-zero1", help=f"comma-separated subset of {list(ROWS)}")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=2, help="per data-parallel rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps without checkpoints (the step time)")
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--between", type=int, default=2, help="steps between two checkpoints")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "checkpoint.json")
    args = parser.parse_args()
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or args.checkpoints < 2:
        parser.error(f"unknown rows {unknown} (known: {list(ROWS)}) or fewer than 2 checkpoints")
    return args


def main() -> None:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        for row in args.rows:
            rows.append(run_row(args, row, work))
            r = rows[-1]
            print(f"{row}: step {r['step_s'] * 1e3:.0f} ms, save {r['save_s'] * 1e3:.1f} ms, "
                  f"write {r['write_s']:.2f} s")  # fmt: skip
    mib = 2**20
    table = [
        [
            r["row"], str(r["ranks"]), f"{r['step_s'] * 1e3:.0f}", f"{r['save_s'] * 1e3:.1f}",
            f"{r['save_s'] / r['step_s']:.3f}", f"{r['first_save_s'] * 1e3:.0f}", f"{r['copy_s'] * 1e3:.1f}",
            f"{r['step_during_write_s'] * 1e3:.0f}", f"{r['write_s']:.2f}", f"{r['commit_s']:.2f}",
            f"{r['shard_bytes'] / mib:.1f}", f"{r['total_bytes'] / mib:.1f}", f"{r['param_bytes'] / mib:.1f}",
            f"{r['sync_save_s']:.2f}",
        ]
        for r in rows
    ]  # fmt: skip
    print(
        f"\nflash checkpoints, DeepSeek-V3 {args.config}, global batch {args.global_batch} x {args.seq_len}, "
        f"{args.micro_batches} micro-batches per dp rank; {num_cores()} cores"
    )
    headers = ("row", "ranks", "step ms", "save ms", "save/step", "1st save ms", "copy ms", "step ms writing",
               "write s", "commit s", "shard MiB", "ckpt MiB", "params MiB", "sync save s")  # fmt: skip
    print_table(
        headers,
        table,
        "save ms: what Trainer.save blocks the step for (median over the checkpoints after the first); copy ms: the "
        "copy into CPU buffers within it; 1st save ms: the first, which also allocates the buffers.",
        "step ms writing: a step running beside the writer thread; write s: the thread's time for this rank's files "
        "(sha256, fsync); commit s: rank 0's manifest and rename.",
        "shard MiB: one rank's files; ckpt MiB: the whole checkpoint; sync save s: the previous format's gathered, "
        "synchronous save. Largest rank's figures.",
    )
    save_run(args.json, args, rows=rows)


if __name__ == "__main__":
    main()
