"""Rank cases of test_zero.py's pipeline tests: PP2 x DP2 (4 ranks) on tiny's model with ZeRO-1 in small buckets,
trained by `Trainer` a few steps with `overlap_grad_reduce` off and on, from the same weights and tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe.trainer import run
from moe.trainer.data.token_file import TokenBatches
from moe.trainer.train.checkpoint import ModelIO
from moe.trainer.train.job_config import job_from_args
from moe.trainer.train.parallel_state import Layout, ParallelState

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "deepseek_v3" / "configs" / "tiny.toml"
SEQ_LEN, BUCKET = 16, 20_000  # tiny has ~1.3M parameters: several buckets per stage


def _run(parallel: ParallelState, schedule: str, vpp: int, micro: int, overlap: bool, steps: int, run_dir: str):
    """`steps` steps of a fresh model; per step the record's loss and grad norm, the optimizer's launch and
    stage-done times against the schedule's span, and the final local parameters."""
    dp = parallel.layout.dp
    # tiny's model and trainer as train.py builds them (moe/trainer/run.py), constant learning rate.
    job = job_from_args(TINY, [
        "--pp", "2", "--pp-schedule", schedule, "--vpp", str(vpp), "--steps", str(steps), "--global-batch-size",
        str(dp * micro), "--micro-batches", str(micro), "--seq-length", str(SEQ_LEN), "--lr", "3e-3", "--min-lr", "0",
        "--lr-warmup-iters", "0", "--clip-grad", "0.5", "--use-distributed-optimizer", "--ddp-bucket-size",
        str(BUCKET), "--zero.overlap_grad_reduce", str(overlap).lower(),
    ], world=parallel.layout.world)  # fmt: skip
    model, runner = run.build_model(job, parallel, None, seed=0)
    tokens = np.random.default_rng(1).integers(0, job.model.vocab_size, 4000).astype(np.int64)
    batches = TokenBatches(tokens, seq_len=SEQ_LEN, global_batch=dp * micro, val_sequences=0, seed=0)
    io = ModelIO(model.full_state_dict, lambda p, sd: None, lambda p: None)
    trainer = run.build_trainer(job, model, parallel, batches, run_dir, seed=0, model_io=io, pipeline=runner)
    opt = trainer.optimizer
    out = {"records": [], "timing": []}
    for step in range(1, steps + 1):
        record = trainer.train_step(step)
        out["records"].append((record["loss"], record["mtp_loss"], record["grad_norm"]))
        start, end = runner.schedule_span
        out["timing"].append({
            "launches": [(i, t - end) for i, t in opt.launch_times()],  # seconds after the schedule's end
            "stages_done": [(s, t - end) for name, s, t in opt.events if name == "stage_done"],
            "schedule_s": end - start,
        })  # fmt: skip
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["buckets"] = [(b.index, b.stages, b.kind, [e.name for e in b.entries]) for b in opt.buckets]
    out["stage_ids"] = list(runner.stage_ids)
    out["stage_params"] = {s: sorted(n for n, p in model.named_parameters() if any(p is q for q in ps))
                           for s, ps in runner.stage_parameters().items()}  # fmt: skip
    trainer.checkpointer.close(True)
    return out


def overlap_on_off_case(ctx, schedule: str, vpp: int, micro: int, steps: int, tmp: str) -> dict:
    """PP2 x DP2: the same steps with `overlap_grad_reduce` off, then on. Returns both runs' facts (see `_run`)."""
    del ctx
    parallel = ParallelState.from_process_group(Layout(world=4, pp=2, pp_schedule=schedule, vpp=vpp))
    rank_dir = Path(tmp) / f"rank{parallel.rank}"
    off = _run(parallel, schedule, vpp, micro, False, steps, str(rank_dir / "off"))
    on = _run(parallel, schedule, vpp, micro, True, steps, str(rank_dir / "on"))
    return {"pp_rank": parallel.pp_rank, "dp_rank": parallel.dp_rank, "off": off, "on": on}
