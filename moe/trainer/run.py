"""Train DeepSeek-V3 (MLA, DeepSeekMoE with aux-loss-free balancing, MTP) on mtdeepep.

Usage: examples/deepseek_v3/train.py, the command line that runs `main`.

One process, or one per rank under torchrun (gloo on CPU). Layout (moe/trainer/train/parallel_state.py): `--tp` ranks
split the attention and dense layers (tensor parallel, with sequence parallelism outside them), the experts of every MoE
layer are sharded over `--ep` ranks (mtdeepep's 'flex' dispatcher; MoE parallel folding lets EP span the TP
ranks), `--pp` ranks hold consecutive pipeline stages (moe/trainer/pipeline: 1F1B, ZB-H1 or DualPipeV on torch's
schedules), the rest is data parallel, with ZeRO-1 under `--use-distributed-optimizer`. For a given `--seed`, every
layout starts from the same weights, trains on the same tokens and does the same maths per step (see
moe/trainer/train/trainer.py).

A step whose loss or gradients are NaN/Inf, or whose loss spikes, can be rewound from an in-memory snapshot and
skipped ([rewind] rewind_*, check_for_*; moe/trainer/train/rewind.py); a run that cannot continue exits with status 3.
Slow ranks are reported with `log_straggler` (moe/trainer/train/straggler.py).

Every step's MFU (model FLOPs utilisation) is its model FLOPs per token (moe/trainer/models/deepseek_v3/flops.py,
counted from the config) x tokens/s over the peak FLOP/s of one rank (moe/trainer/plan/peak.py: the device's spec, or on
the CPU a matmul measured by rank 0 at start-up) x the ranks; run.json records the figures ("mfu").

Data ([data], moe/trainer/data/run_data.py): this Python's standard library or a corpus (a directory, file or
glob of .py/.txt/.md/.jsonl/.jsonl.gz/.parquet; `--corpus`, `--tokenizer bpe|bytes|PATH`), or Megatron-prepared indexed
datasets blended by weight (`--data-path W1 PREFIX1 ...`), with Megatron's `--eod-mask-loss`, `--reset-position-ids`
and `--reset-attention-mask`.

Where users watch a run (moe/trainer/train/loggers.py, moe/trainer/train/profiling.py): `--tensorboard-dir DIR`
(TensorBoard scalars of every metrics.jsonl number, and the resolved config), `--wandb-project P [--wandb-exp-name N
--wandb-save-dir D]` (the same through Weights & Biases), `--profile --profile-step-start N --profile-step-end M
[--profile-ranks R ...]` (a torch.profiler trace of steps N+1..M per rank, the top operators printed at the end);
torchtitan's [metrics] and [profiling] keys too.

Writes into RUN_DIR: run.json (layout and config), metrics.jsonl (one line per optimizer step, and events), loss.png,
tokenizer.json, val_tokens.npy (held-out sequences for evaluate.py), checkpoints/step_N/ and checkpoints/latest.
Checkpoints are sharded flash checkpoints (moe/trainer/train/checkpoint/: each rank writes its shard in the background);
the last one also holds the whole model as a model directory. Every checkpoint reads as a model directory (--init,
evaluate.py, hf.py), and `--resume` continues from the newest complete one in any layout. Files are readable by
their owner only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from moe import EPBuffers
from moe.layer.fp8.convert import apply_fp8, fp8_moe_options
from moe.trainer.data.run_data import RunData, prepare_run_data
from moe.trainer.data.source import DataSource
from moe.trainer.io.atomic import write_json
from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.compile import compile_model
from moe.trainer.models.deepseek_v3.flops import model_flops_per_token
from moe.trainer.models.deepseek_v3.model_dir import config_json, read_model_dir, write_model_dir
from moe.trainer.models.deepseek_v3.tensor_parallel import parallelize
from moe.trainer.pipeline import PipelineRunner, TimelineRecorder, pipeline_moe_options
from moe.trainer.plan.peak import agreed_peak
from moe.trainer.train import checkpoint as ckpt
from moe.trainer.train import job_config
from moe.trainer.train.faults import FaultPlan
from moe.trainer.train.loggers import open_loggers
from moe.trainer.train.metrics import LOSS_PNG, METRICS, loss_table, plot_loss, read_metrics
from moe.trainer.train.parallel_state import Layout, ParallelState, env_local_rank
from moe.trainer.train.profiling import StepProfiler
from moe.trainer.train.rewind import TrainingStopped
from moe.trainer.train.trainer import Trainer
from mtdeepep.engines.peers import GroupWatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    """The run's own options; every config field is a `--section.key` override or one of its aliases
    (moe/trainer/train/job_config.py)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog=job_config.__doc__)  # fmt: skip
    p.add_argument(
        "--config",
        required=True,
        help="TOML file with [model], [training], [optimizer] ... tables (moe/trainer/train/job_config.py)",
    )
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order, per-step randomness")
    p.add_argument("--init", default=None, help="start from the weights of this checkpoint / model directory")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest complete checkpoint (any layout)",
    )
    p.add_argument("--prepare-data", action="store_true", help="build the tokenizer and token file, then exit")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on every collective wait, seconds")
    job_config.add_tree_options(p)
    return p


def check_run_dir(run_dir: Path, resume: bool, init: str | None) -> Path | None:
    """The checkpoint to resume from (None: a new run): the newest complete one (incomplete newer ones are skipped
    with a warning; the ranks agree on one with verified checksums later, `Checkpointer.find_resumable`); ValueError
    for a run directory that does not fit."""
    if resume and init:
        raise ValueError("--resume continues a run from its own checkpoint; --init starts a new one: pick one")
    # The trainer state's sha256 is verified here (its step decides what is left to train); every file's is verified
    # by rank 0 once the process groups exist (Checkpointer.find_resumable), before anything is loaded.
    latest, skipped = ckpt.find_resumable(run_dir, verify_state=True, warn=resume and job_config.env_rank() == 0)
    if resume and latest is None:
        raise ValueError(f"--resume: {ckpt.no_resumable_reason(run_dir, skipped)}")
    if not resume and latest is not None:
        raise ValueError(f"{run_dir} already holds a run (at {latest.name}); pass --resume or another --out")
    if init is not None and not (Path(init) / "config.json").is_file():
        raise ValueError(f"--init {init}: not a model directory (no config.json)")
    return latest


@dataclass
class CheckedJob:
    """Phase 1's result: everything resolved and checked before any process group exists."""

    job: job_config.Job
    run_dir: Path
    latest: Path | None  # the checkpoint to resume from (None: a new run)
    data: RunData
    batches: DataSource
    faults: FaultPlan | None  # test hook (moe/trainer/train/faults.py)

    def already_trained(self) -> bool:
        """The run reached its last step, and its final checkpoint is whole (else the resume falls back to an
        older one and trains the rest)."""
        return self.latest is not None and ckpt.read_trainer_state(self.latest)["step"] >= self.job.training.steps \
            and ckpt.is_complete(self.latest, verify_checksums=True)  # fmt: skip


@dataclass
class BuiltRun:
    """Phase 2's result: the process groups, the model (pruned to this rank's pipeline stages), the trainer."""

    parallel: ParallelState
    ep_buffers: EPBuffers
    model: DeepseekV3ForCausalLM
    pipeline: PipelineRunner | None
    trainer: Trainer
    mfu_basis: dict  # run.json's "mfu": the figures every step's MFU is computed from

    def close(self) -> None:
        self.ep_buffers.destroy()  # after the last backward, which communicates on them
        if self.pipeline is not None:
            self.pipeline.close()  # the pipeline's P2P buffer (use_deepep_p2p)
        self.parallel.destroy()


def check(args, overrides) -> CheckedJob:
    """Phase 1: the config tree, the run directory, the data; ValueError / FileNotFoundError for what is wrong."""
    job = job_config.load_job(args.config, overrides)
    model_cfg, train_cfg = job.model, job.training
    run_dir = Path(args.out)
    latest = None if args.prepare_data else check_run_dir(run_dir, args.resume, args.init)
    if args.init is not None:
        job_config.check_init_config(args.init, model_cfg)
    data = prepare_run_data(job.data, train_cfg, model_cfg.vocab_size, seed=args.seed, build=env_local_rank() == 0,
                            prepare_only=args.prepare_data)  # fmt: skip
    batches = data.batches
    if latest is not None:  # a resume on other data (or other blend weights) is refused here, before any group
        ckpt.check_same_data(ckpt.read_trainer_state(latest).get("data", {}), batches.identity(), latest)
    faults = FaultPlan.from_env()
    if faults is not None and faults.has_delays and not job.straggler.log_straggler:
        raise ValueError("injected sleep faults act on the phase timer: set [straggler] log_straggler = true")
    return CheckedJob(job, run_dir, latest, data, batches, faults)


def build(args, checked: CheckedJob) -> BuiltRun:
    """Phase 2: the process groups, then the model (same initial weights for every layout of a seed), converted and
    parallelised, its pipeline stages, and the trainer."""
    job = checked.job
    model_cfg, train_cfg, layout = job.model, job.training, job.layout
    parallel = ParallelState.initialize(layout, timeout_s=args.timeout)
    ep_buffers = EPBuffers(timeout_s=args.timeout)
    model, pipeline = build_model(job, parallel, ep_buffers, seed=args.seed, p2p_timeout_s=args.timeout)

    # The checkpoints' config.json names the data's end-of-text token (generate.py stops there; transformers too).
    eos_token_id = checked.data.eos_id

    def write_config(directory: Path) -> None:
        write_json(directory / "config.json", config_json(model_cfg, DTYPES[train_cfg.dtype], eos_token_id), indent=2)

    mfu_basis = _mfu_basis(job, layout, next(model.parameters()).device)
    peak = mfu_basis["peak_flops_per_rank"]
    model_io = ckpt.ModelIO(
        full_state_dict=model.full_state_dict,
        write=lambda path, sd: write_model_dir(path, sd, model_cfg, eos_token_id=eos_token_id),
        load=lambda path: load_model(model, path),
        write_config=write_config,
    )
    # TensorBoard / W&B on the main rank, opened by `fit` once the starting step is known (a resumed TensorBoard run
    # continues); the profiler on the ranks it profiles.
    loggers = None
    if job.metrics.tensorboard or job.metrics.wandb:
        loggers = partial(open_loggers, job.metrics, checked.run_dir, tables=job.tables, config_toml=job.toml())
    profiler = None
    if job.profiling.profiles_rank(parallel.rank):
        profiler = StepProfiler(job.profiling, checked.run_dir, parallel.rank, train_cfg.steps)
    trainer = build_trainer(job, model, parallel, checked.batches, checked.run_dir, seed=args.seed, model_io=model_io,
                            extra_checkpoint_files=checked.data.tokenizer_files,
                            run_info={"title": _title(args, layout)}, pipeline=pipeline, faults=checked.faults,
                            checkpoint_timeout_s=args.timeout,
                            model_flops_per_token=mfu_basis["model_flops_per_token"] if peak is not None else None,
                            peak_flops_per_rank=peak, loggers=loggers, profiler=profiler)  # fmt: skip
    return BuiltRun(parallel, ep_buffers, model, pipeline, trainer, mfu_basis)


def build_model(
    job: job_config.Job,
    parallel: ParallelState,
    ep_buffers: EPBuffers | None,
    *,
    seed: int | None,
    initial_state: dict | None = None,
    p2p_timeout_s: float | None = None,
) -> tuple[DeepseekV3ForCausalLM, PipelineRunner | None]:
    """The model as every run builds it: the MoE layers' build-time options, tensor parallel, the FP8 conversion,
    recompute, the attention backend, the opt-in compile, and (with a pipeline split) the `PipelineRunner`, which
    prunes the model to this rank's stages. `seed`: the initial weights' seed (every layout of a seed starts from the
    same weights), or None to keep torch's generator as it is; `initial_state`: a full state dict loaded before the
    FP8 conversion instead (e.g. another framework's initial weights)."""
    model_cfg, train_cfg, layout, split = job.model, job.training, job.layout, job.split
    if seed is not None:
        torch.manual_seed(seed)  # the model draws its initialisation seed from it (every tensor, expert by name)
    # Build-time choices of the MoE layers: FP8 dispatch under an FP8 recipe, no self-deferred expert weight
    # gradients under a schedule that splits the backward (its W actions take their place).
    moe_options = fp8_moe_options(layout.fp8) | (pipeline_moe_options(layout.pp_schedule) if split is not None else {})
    # The MoE layers dispatch over the folded EP x ETP group (the EP group when etp is 1), each expert's FFN split
    # over the ETP ranks.
    model = DeepseekV3ForCausalLM(model_cfg, ep_group=parallel.expert_model_group, etp_group=parallel.etp_group,
                                  ep_buffers=ep_buffers,
                                  aux_loss_group=parallel.token_group, dtype=DTYPES[train_cfg.dtype],
                                  moe_options=moe_options)  # fmt: skip
    parallelize(model, parallel)  # tensor + sequence parallel over the TP group (slices of the same weights)
    if initial_state is not None:
        model.load_full_state_dict(initial_state)
    if layout.fp8 != "none":  # FP8 GEMMs under the recipe (FP8 dispatch was built in); weights stay the masters
        apply_fp8(model, layout.fp8, tp_group=parallel.tp_group)
    model.set_recompute(job.recompute)
    model.set_attention_backend(train_cfg.attention_backend)
    # opt-in: the attention modules compile at the first step (moe/trainer/models/deepseek_v3/compile.py)
    if train_cfg.compile:
        compile_model(model)
    pipeline = None
    if split is not None:  # prunes the model to this rank's stages: before the optimizer exists
        recorder = TimelineRecorder(parallel.pp_rank, enabled=job.parallel.pipeline_timeline)
        pipeline = PipelineRunner(model, parallel, schedule=layout.pp_schedule, split=split,
                                  micro_batches=train_cfg.micro_batches, seq_len=train_cfg.seq_len,
                                  micro_rows=train_cfg.global_batch // layout.dp // train_cfg.micro_batches,
                                  mtp_loss_weight=model_cfg.mtp_loss_weight,
                                  num_mtp=model_cfg.num_nextn_predict_layers, recorder=recorder,
                                  overlap_moe_comm=job.parallel.overlap_moe_expert_parallel_comm,
                                  virtual_stages=layout.vpp,
                                  p2p_transport="deepep" if job.parallel.use_deepep_p2p else "torch",
                                  p2p_timeout_s=p2p_timeout_s)  # fmt: skip
    return model, pipeline


def build_trainer(
    job: job_config.Job,
    model: DeepseekV3ForCausalLM,
    parallel: ParallelState,
    batches: DataSource,
    run_dir: str | Path,
    *,
    seed: int,
    model_io: ckpt.ModelIO | None = None,
    pipeline: PipelineRunner | None = None,
    **options,
) -> Trainer:
    """The `Trainer` of `model` (from `build_model`) as every run builds it: the job's component configs, its MTP
    loss weight and depth; `options`: the rest of `Trainer`'s keywords (checkpoint files, faults, MFU, loggers)."""
    return Trainer(model, job.trainer, parallel, batches, run_dir, seed=seed, model_io=model_io,
                   mtp_loss_weight=job.model.mtp_loss_weight, num_mtp=job.model.num_nextn_predict_layers,
                   pipeline=pipeline, **options)  # fmt: skip


def _mfu_basis(job: job_config.Job, layout: Layout, device: torch.device) -> dict:
    """The figures of every step's MFU: the model FLOPs per token (the config's), and one rank's peak FLOP/s (the
    GEMMs' dtype: the training dtype, or FP8 under a recipe), rank 0's on every rank (collective). Without a peak
    for the device (an accelerator without a spec) the peak is None and the steps carry no MFU."""
    rate_dtype = "fp8" if layout.fp8 != "none" else job.training.dtype
    peak = agreed_peak(device, rate_dtype)
    flops = model_flops_per_token(job.model, job.training.seq_len)
    basis = {
        "model_flops_per_token": flops,
        "peak_flops_per_rank": peak.flops_per_s if peak is not None else None,
        "peak_source": peak.source if peak is not None else f"no peak FLOP/s known for {device}",
        "ranks": layout.world,
        "formula": "mfu = model_flops_per_token x tokens_per_s / (peak_flops_per_rank x ranks)",
        "convention": "forward + backward = 3 x forward, matrix products only, causal attention, no recompute "
        "(moe/trainer/models/deepseek_v3/flops.py)",
    }
    if device.type == "cpu":  # the peak is one process's: ranks sharing fewer cores cannot all reach it at once
        cores, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
        basis["cpu_cores"] = cores
        basis["max_mfu"] = min(1.0, cores / (layout.world * threads))
    return basis


def load_model(model: DeepseekV3ForCausalLM, path: Path) -> None:
    """Load a model directory's (or checkpoint's) full weights into `model` (any layout)."""
    state_dict, _ = _read_model(read_model_dir, path)
    model.load_full_state_dict(state_dict)


def start(args, checked: CheckedJob, run: BuiltRun) -> int:
    """Phase 3: the run directory's files, then the starting step (a verified checkpoint, --init's weights, or the
    seed's). `NoResumableCheckpoint`, on every rank, when no checkpoint verifies whole."""
    job, run_dir = checked.job, checked.run_dir
    if run.parallel.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_run_json(run_dir, args, job, checked.data, run.mfu_basis)
        job.save(run_dir)  # the resolved tree: `--config RUN_DIR/config.toml` runs it again
        for path in checked.data.tokenizer_files:  # the tokenizer, for evaluate.py and generate.py
            shutil.copyfile(path, run_dir / path.name)
        np.save(run_dir / "val_tokens.npy", checked.batches.val_tokens().numpy())
    start_step = 0
    if checked.latest is not None:
        latest = run.trainer.checkpointer.find_resumable()  # rank 0 verifies the checksums; every rank takes its choice
        start_step = run.trainer.checkpointer.load(latest)
    elif args.init is not None:
        load_model(run.model, Path(args.init))
    run.parallel.barrier()
    if run.parallel.is_main:
        print(f"resolved config ({run_dir / job_config.CONFIG_TOML}):\n{job.toml()}")
        print(f"training {Path(args.config).stem} ({_layout_text(job.layout)}) from step {start_step} "
              f"to {job.training.steps}")  # fmt: skip
        basis = run.mfu_basis
        if basis["peak_flops_per_rank"] is not None:
            print(f"MFU basis: {basis['model_flops_per_token'] / 1e6:.4g} MFLOP per token (fwd + bwd), peak "
                  f"{basis['peak_flops_per_rank'] / 1e9:.4g} GFLOP/s per rank ({basis['peak_source']}) x "
                  f"{basis['ranks']} ranks")  # fmt: skip
    return start_step


def report(checked: CheckedJob, run: BuiltRun, seconds: float) -> None:
    """Phase 5: the pipeline timeline (if asked for), the profiled ranks' top operators and the summary of the
    run."""
    run_dir = checked.run_dir
    profiler = run.trainer.profiler
    if profiler is not None and profiler.tables:
        print(profiler.summary(), flush=True)
    if run.pipeline is not None and checked.job.parallel.pipeline_timeline:
        bubble = run.pipeline.write_timeline(run_dir / "pipeline_timeline.json", run_dir / "pipeline_timeline.png")
        if run.parallel.is_main:
            expected = run.pipeline.expected_bubble_fraction(bubble)
            analytic = "" if expected is None else f"analytic {100 * expected:.1f}%; "
            print(f"last step's pipeline bubble {100 * bubble.fraction:.1f}% ({analytic}{run_dir}/pipeline_timeline.*)")
    if run.parallel.is_main:
        print(f"trained in {seconds:.1f} s")
        _summary(run_dir)


def main(argv: list[str] | None = None) -> int:
    """check, build, start, train, report. Exit status: 0 done, 2 bad input (nothing trained), 3 stopped."""
    parser = build_parser()
    try:
        args, overrides = job_config.parse(parser, argv)
    except ValueError as exc:
        parser.error(str(exc))
    os.umask(0o077)  # checkpoints, metrics and caches: owner only
    try:  # everything that can be wrong is checked before any process group exists
        checked = check(args, overrides)
    except (ValueError, FileNotFoundError) as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    if args.prepare_data:
        print(f"data ready: {checked.data.summary}")
        return 0
    if checked.already_trained():
        if job_config.env_rank() == 0:
            print(f"{checked.run_dir}: already trained to step {checked.job.training.steps}; nothing to do")
            _summary(checked.run_dir)
        return 0
    run = build(args, checked)
    try:
        start_step = start(args, checked, run)
    except ckpt.NoResumableCheckpoint as exc:  # on every rank alike: the clean error of phase 1, one phase later
        if run.parallel.is_main:
            print(f"train.py: error: {exc}", file=sys.stderr)
        run.close()
        return 2
    t0 = time.perf_counter()
    # Across machines, a lost host fails the trainer's own collectives with gloo's words (an address, a timeout):
    # the watch names the lost ranks and their host instead (mtdeepep's dispatch and combine name them already).
    watch = GroupWatch(timeout_s=args.timeout) if run.parallel.layout.world > 1 else None
    try:
        run.trainer.fit(start_step)
    except TrainingStopped as stop:  # every rank stops at the same step (the decision is all-reduced)
        if run.parallel.is_main:
            print(f"train.py: stopped: {stop}", file=sys.stderr)
        run.close()
        return 3
    except Exception as error:
        lost = watch.explain(error) if watch is not None and "on host" not in str(error) else ""
        if not lost:
            raise
        raise RuntimeError(f"train.py: rank {run.parallel.rank}: {_failure_site(error)} failed: {lost}") from error
    finally:
        if watch is not None:
            watch.close()
    report(checked, run, time.perf_counter() - t0)
    run.close()
    return 0


def _failure_site(error: BaseException) -> str:
    """'step N, train_step > all_reduce_sum': the step and the innermost calls of the project's code where `error`
    was raised (the phase of a failed collective)."""
    frames = [f for f, _ in traceback.walk_tb(error.__traceback__)]
    ours = [f for f in frames if "/moe/" in f.f_code.co_filename or "/mtdeepep/" in f.f_code.co_filename]
    step = next((f.f_locals["step"] for f in reversed(frames) if isinstance(f.f_locals.get("step"), int)), None)
    calls = " > ".join(f.f_code.co_name for f in ours[-2:]) or "training"
    return f"step {step}, {calls}" if step is not None else calls


def _read_model(read_model_dir, path: Path):
    """`(state_dict, config)` of a model directory, whatever order `read_model_dir` returns them in."""
    first, second = read_model_dir(path)
    return (first, second) if isinstance(first, dict) else (second, first)


def _title(args, layout: Layout) -> str:
    return f"{Path(args.config).stem}: {_layout_text(layout)}, seed {args.seed}"


def _layout_text(layout: Layout) -> str:
    text = f"world {layout.world}: dp {layout.dp} x tp {layout.tp} x pp {layout.pp}, ep {layout.ep}"
    text += f" x etp {layout.etp}" if layout.etp > 1 else ""
    virtual = f" x {layout.vpp} virtual stages per rank" if layout.vpp > 1 else ""
    return text + (f", {layout.pp_schedule}{virtual}" if layout.pp > 1 else "")


def _write_run_json(run_dir: Path, args, job: job_config.Job, data, mfu_basis: dict) -> None:
    info = {
        "title": _title(args, job.layout),
        "layout": {**job.layout.to_dict(), "dtype": job.training.dtype},
        "overlap_moe_expert_parallel_comm": job.parallel.overlap_moe_expert_parallel_comm,
        "pipeline_p2p": "deepep" if job.parallel.use_deepep_p2p else "torch",
        "config": {"path": str(args.config), **job.tables},
        "seed": args.seed,
        "init": args.init,
        "data": data.meta,
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
        "mfu": mfu_basis,
    }
    write_json(run_dir / "run.json", info)


def _summary(run_dir: Path) -> None:
    records = read_metrics(run_dir / METRICS)
    if records:
        title = json.loads((run_dir / "run.json").read_text()).get("title", "")
        plot_loss(run_dir / METRICS, run_dir / LOSS_PNG, title=title)
        print(loss_table(records))
        print(f"metrics: {run_dir / METRICS}\nloss curve: {run_dir / LOSS_PNG}")


if __name__ == "__main__":
    sys.exit(main())
