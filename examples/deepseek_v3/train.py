"""Train DeepSeek-V3 (MLA, DeepSeekMoE with aux-loss-free balancing, MTP) on mtdeepep.

    python examples/deepseek_v3/train.py --config examples/deepseek_v3/configs/tiny.toml --out runs/tiny
    torchrun --nproc-per-node 4 examples/deepseek_v3/train.py --config ... --out runs/tiny-ep4 --ep 4

    torchrun --nproc-per-node 4 examples/deepseek_v3/train.py --config ... --out runs/tiny-tp2-ep2 --tp 2 --ep 2 \
        --use-distributed-optimizer
    torchrun --nproc-per-node 4 examples/deepseek_v3/train.py --config ... --out runs/tiny-pp2-ep2 --pp 2 --ep 2 \
        --pp-schedule dualpipev --overlap-moe-expert-parallel-comm --pipeline-timeline

One process, or one per rank under torchrun (gloo on CPU). Layout (moe/train/parallel.py): `--tp` ranks split the
attention and dense layers (tensor parallel, with sequence parallelism outside them), the experts of every MoE
layer are sharded over `--ep` ranks (mtdeepep's 'flex' dispatcher; MoE parallel folding lets EP span the TP
ranks), `--pp` ranks hold consecutive pipeline stages (moe/pipeline: 1F1B, ZB-H1 or DualPipeV on torch's schedules),
the rest is data parallel, with ZeRO-1 under `--use-distributed-optimizer`. For a given `--seed`, every
layout starts from the same weights, trains on the same tokens and does the same maths per step (see
moe/train/trainer.py).

A step whose loss or gradients are NaN/Inf, or whose loss spikes, can be rewound from an in-memory snapshot and
skipped ([training] rewind_*, check_for_*; moe/train/rewind.py); a run that cannot continue exits with status 3.
Slow ranks are reported with `log_straggler` (moe/train/straggler.py).

Writes into RUN_DIR: run.json (layout and config), metrics.jsonl (one line per optimizer step, and events), loss.png,
tokenizer.json, val_tokens.npy (held-out sequences for evaluate.py), checkpoints/step_N/ and checkpoints/latest.
Checkpoints are sharded flash checkpoints (moe/train/flash.py: each rank writes its shard in the background); the
last one also holds the whole model as a model directory. Every checkpoint reads as a model directory (--init,
evaluate.py, hf.py), and `--resume` continues from the newest complete one in any layout. Files are readable by
their owner only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import tomllib
import torch

# Runs as a script from any directory: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe import EPBuffers  # noqa: E402
from moe.fp8 import apply_fp8  # noqa: E402
from moe.models.deepseek_v3.tensor_parallel import check_tensor_parallel, parallelize  # noqa: E402
from moe.pipeline import PipelineRunner, TimelineRecorder  # noqa: E402
from moe.pipeline.split import SCHEDULE_STAGES_PER_RANK, check_schedule, split_layers  # noqa: E402
from moe.train import checkpoint as ckpt  # noqa: E402
from moe.train.config import TrainingConfig  # noqa: E402
from moe.train.data import TokenBatches, prepare_tokens  # noqa: E402
from moe.train.faults import FaultPlan  # noqa: E402
from moe.train.metrics import LOSS_PNG, METRICS, loss_table, plot_loss, read_metrics  # noqa: E402
from moe.train.parallel import FP8_RECIPES, PP_SCHEDULES, Layout, ParallelState, env_local_rank, env_world_size  # noqa: E402
from moe.train.rewind import TrainingStopped  # noqa: E402
from moe.train.trainer import ModelIO, Trainer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", required=True, help="TOML file with [model] and [training] tables")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: [training] steps)")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order, per-step randomness")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (divides the world size)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (sequence parallel with them)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor-parallel ranks (ep * etp divides dp * tp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--pp-schedule", default="1f1b", choices=PP_SCHEDULES,
                   help="pipeline schedule (dualpipev: 2 stages per rank in a V)")  # fmt: skip
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="decoder layers of the first pipeline stage (the rest shared evenly)")  # fmt: skip
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="decoder layers of the last pipeline stage")  # fmt: skip
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step per data-parallel rank (default: [training])")  # fmt: skip
    p.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="dualpipev: in each overlapped forward-backward chunk, one micro-batch's MoE dispatch / "
                   "combine runs while the other micro-batch computes (same results bit for bit)")  # fmt: skip
    p.add_argument("--pipeline-timeline", action="store_true",
                   help="record every pipeline action; write RUN_DIR/pipeline_timeline.json (Perfetto) and .png "
                   "of the last step, with the measured bubble")  # fmt: skip
    p.add_argument("--fp8", default="none", choices=FP8_RECIPES, help="FP8 recipe")
    p.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        default=None,
        help="ZeRO-1: optimizer states and FP32 masters sharded over the data-parallel ranks "
        "(default: [training] use_distributed_optimizer)",
    )
    p.add_argument("--ddp-bucket-size", type=int, default=None, help="gradient bucket size in elements (ZeRO-1)")
    p.add_argument("--init", default=None, help="start from the weights of this checkpoint / model directory")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest complete checkpoint (any layout)",
    )
    p.add_argument("--data-cache", default=None, help="token cache directory (default: [training.data] cache_dir)")
    p.add_argument("--prepare-data", action="store_true", help="build the tokenizer and token file, then exit")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on every collective wait, seconds")
    p.add_argument(
        "--recompute-granularity",
        default=None,
        choices=("full", "selective"),
        help="activation recompute (Megatron's; moe/models/deepseek_v3/recompute.py)",
    )
    p.add_argument("--recompute-method", default=None, choices=("uniform", "block"), help="for 'full'")
    p.add_argument("--recompute-num-layers", type=int, default=None, help="for 'full': chunk size / layers")
    p.add_argument("--recompute-modules", nargs="*", default=None,
                   help="for 'selective' (default core_attn): core_attn moe_act layernorm mla_up_proj mlp moe "
                   "shared_experts")  # fmt: skip
    return p.parse_args(argv)


def check_model_layout(model_cfg, train_cfg: TrainingConfig, layout: Layout) -> None:
    """What the layout and the batch ask of the model config (ValueError, before any process group). The routing
    settings themselves (e.g. a top-k larger than the experts of the allowed groups) are checked by
    `DeepseekV3Config`."""
    if layout.etp != 1:
        raise ValueError(f"--etp {layout.etp}: expert tensor parallelism is not in the MoE layer yet")
    layout.check_experts(model_cfg.n_routed_experts)
    layout.check_batch(train_cfg.global_batch, train_cfg.micro_batches)
    check_tensor_parallel(model_cfg, layout.tp)
    if train_cfg.seq_len < layout.tp + model_cfg.num_nextn_predict_layers:
        raise ValueError(
            f"seq_len={train_cfg.seq_len} is shorter than --tp {layout.tp} + MTP depth "
            f"{model_cfg.num_nextn_predict_layers}: a sequence-parallel rank would hold no position"
        )
    if train_cfg.seq_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len={train_cfg.seq_len} exceeds max_position_embeddings={model_cfg.max_position_embeddings}"
        )
    if train_cfg.seq_len < 2 + model_cfg.num_nextn_predict_layers:
        raise ValueError(
            f"seq_len={train_cfg.seq_len} leaves no target for MTP depth {model_cfg.num_nextn_predict_layers}"
        )


def pipeline_split(model_cfg, train_cfg: TrainingConfig, layout: Layout, args):
    """The decoder layers of each pipeline stage (None without pipeline parallelism); ValueError for a split or a
    micro-batch count the schedule cannot run."""
    outer = (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
    if args.overlap_moe_expert_parallel_comm and (layout.pp == 1 or layout.pp_schedule != "dualpipev"):
        raise ValueError(
            "--overlap-moe-expert-parallel-comm overlaps DualPipeV's forward-backward chunks: it needs --pp > 1 "
            "--pp-schedule dualpipev"
        )
    if layout.pp == 1:
        if any(v is not None for v in outer):
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pp > 1")
        return None
    check_schedule(layout.pp_schedule, layout.pp, train_cfg.micro_batches)
    if model_cfg.tie_word_embeddings and layout.pp_schedule != "dualpipev":
        raise ValueError(
            f"tie_word_embeddings with --pp {layout.pp} --pp-schedule {layout.pp_schedule}: the embedding and the "
            "output head would sit on different ranks; untie them or use dualpipev"
        )
    stages = layout.pp * SCHEDULE_STAGES_PER_RANK[layout.pp_schedule]
    return split_layers(model_cfg.num_hidden_layers, stages, first_stage_layers=outer[0],
                        last_stage_layers=outer[1])  # fmt: skip


def check_run_dir(run_dir: Path, resume: bool, init: str | None) -> Path | None:
    """The checkpoint to resume from (None: a new run): the newest complete one (incomplete newer ones are skipped
    with a warning; the ranks agree on one with verified checksums later, `Trainer.find_checkpoint`); ValueError
    for a run directory that does not fit."""
    if resume and init:
        raise ValueError("--resume continues a run from its own checkpoint; --init starts a new one: pick one")
    # The trainer state's sha256 is verified here (its step decides what is left to train); every file's is verified
    # by rank 0 once the process groups exist (Trainer.find_checkpoint), before anything is loaded.
    latest, skipped = ckpt.find_resumable(run_dir, verify_state=True, warn=resume and env_rank() == 0)
    if resume and latest is None:
        raise ValueError(f"--resume: {ckpt.no_resumable_reason(run_dir, skipped)}")
    if not resume and latest is not None:
        raise ValueError(f"{run_dir} already holds a run (at {latest.name}); pass --resume or another --out")
    if init is not None and not (Path(init) / "config.json").is_file():
        raise ValueError(f"--init {init}: not a model directory (no config.json)")
    return latest


def check_init_config(init: str, model_cfg) -> None:
    """The --init model directory must hold the model of --config (the training extensions may differ)."""
    from moe.models.deepseek_v3.config import EXTENSION_FIELDS
    from moe.models.deepseek_v3.model_dir import read_config

    theirs, ours = read_config(init).to_dict(), model_cfg.to_dict()
    diff = {k: (theirs[k], ours[k]) for k in ours if k not in EXTENSION_FIELDS and theirs.get(k) != ours[k]}
    if diff:
        raise ValueError(f"--init {init}: its model differs from the [model] of --config: {diff} (checkpoint, config)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.umask(0o077)  # checkpoints, metrics and caches: owner only

    # Step 1: everything that can be wrong is checked before any process group exists.
    from moe.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, RecomputeConfig
    from moe.models.deepseek_v3.model_dir import config_json, read_model_dir, write_model_dir

    try:
        model_cfg = DeepseekV3Config.from_toml(args.config)
        train_cfg = TrainingConfig.from_toml(args.config)
        if args.steps is not None:
            train_cfg = dataclasses.replace(train_cfg, steps=args.steps)
        if args.data_cache is not None:
            train_cfg.data.cache_dir = args.data_cache
        if args.use_distributed_optimizer:
            train_cfg = dataclasses.replace(train_cfg, use_distributed_optimizer=True)
        if args.ddp_bucket_size is not None:
            train_cfg = dataclasses.replace(train_cfg, ddp_bucket_size=args.ddp_bucket_size)
        if args.micro_batches is not None:
            train_cfg = dataclasses.replace(train_cfg, micro_batches=args.micro_batches)
        layout = Layout(world=env_world_size(), tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                        pp_schedule=args.pp_schedule, fp8=args.fp8)  # fmt: skip
        check_model_layout(model_cfg, train_cfg, layout)
        split = pipeline_split(model_cfg, train_cfg, layout, args)
        recompute = RecomputeConfig(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                                    tuple(args.recompute_modules or ("core_attn",)))  # fmt: skip
        recompute.full_chunks(model_cfg.num_hidden_layers)  # recompute_num_layers fits the model
        run_dir = Path(args.out)
        latest = None if args.prepare_data else check_run_dir(run_dir, args.resume, args.init)
        if args.init is not None:
            check_init_config(args.init, model_cfg)
        data = prepare_tokens(train_cfg.data, model_cfg.vocab_size, build=env_local_rank() == 0)
        batches = TokenBatches(data.tokens, seq_len=train_cfg.seq_len, global_batch=train_cfg.global_batch,
                               val_sequences=train_cfg.data.val_sequences, seed=args.seed)  # fmt: skip
        faults = FaultPlan.from_env()  # test hook (moe/train/faults.py)
        if faults is not None and faults.has_delays and not train_cfg.log_straggler:
            raise ValueError("injected sleep faults act on the phase timer: set [training] log_straggler = true")
    except (ValueError, FileNotFoundError) as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    if args.prepare_data:
        print(f"data ready: {data.directory} ({data.meta['num_tokens']} tokens, {data.meta['num_files']} files)")
        return 0
    # A finished run, but only if its final checkpoint is whole: else the resume below falls back to an older one.
    if latest is not None and ckpt.read_trainer_state(latest)["step"] >= train_cfg.steps \
            and ckpt.is_complete(latest, verify_checksums=True):  # fmt: skip
        if env_rank() == 0:
            print(f"{run_dir}: already trained to step {train_cfg.steps}; nothing to do")
            _summary(run_dir)
        return 0

    # Step 2: the process groups, then the model (same initial weights for every layout of a seed).
    parallel = ParallelState.initialize(layout, timeout_s=args.timeout)
    ep_buffers = EPBuffers(timeout_s=args.timeout)
    torch.manual_seed(args.seed)  # the model draws its initialisation seed from it (every tensor, expert by name)
    model = DeepseekV3ForCausalLM(model_cfg, ep_group=parallel.ep_group, ep_buffers=ep_buffers,
                                  aux_loss_group=parallel.token_group, dtype=DTYPES[train_cfg.dtype])  # fmt: skip
    parallelize(model, parallel)  # tensor + sequence parallel over the TP group (slices of the same weights)
    if layout.fp8 != "none":  # FP8 GEMMs (and FP8 dispatch) under the recipe; weights stay the FP32/BF16 masters
        apply_fp8(model, layout.fp8, tp_group=parallel.tp_group)
    model.set_recompute(recompute)
    pipeline = None
    if split is not None:  # prunes the model to this rank's stages: before the optimizer exists
        recorder = TimelineRecorder(parallel.pp_rank, enabled=args.pipeline_timeline)
        pipeline = PipelineRunner(model, parallel, schedule=layout.pp_schedule, split=split,
                                  micro_batches=train_cfg.micro_batches, seq_len=train_cfg.seq_len,
                                  micro_rows=train_cfg.global_batch // layout.dp // train_cfg.micro_batches,
                                  mtp_loss_weight=model_cfg.mtp_loss_weight,
                                  num_mtp=model_cfg.num_nextn_predict_layers, recorder=recorder,
                                  overlap_moe_comm=args.overlap_moe_expert_parallel_comm)  # fmt: skip

    def load_model(path: Path) -> None:
        state_dict, _ = _read_model(read_model_dir, path)
        model.load_full_state_dict(state_dict)

    def write_config(directory: Path) -> None:
        text = json.dumps(config_json(model_cfg, DTYPES[train_cfg.dtype]), indent=2, sort_keys=True) + "\n"
        (directory / "config.json").write_text(text)

    model_io = ModelIO(
        full_state_dict=model.full_state_dict,
        write=lambda path, sd: write_model_dir(path, sd, model_cfg),
        load=load_model,
        write_config=write_config,
    )
    run_info = {"title": _title(args, layout)}
    trainer = Trainer(model, train_cfg, parallel, batches, run_dir, seed=args.seed, model_io=model_io,
                      mtp_loss_weight=model_cfg.mtp_loss_weight, num_mtp=model_cfg.num_nextn_predict_layers,
                      extra_checkpoint_files=(data.tokenizer_path,), run_info=run_info,
                      pipeline=pipeline, faults=faults, checkpoint_timeout_s=args.timeout)  # fmt: skip

    # Step 3: the run directory, the starting point, the loop.
    if parallel.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_run_json(run_dir, args, layout, train_cfg, data, parallel)
        shutil.copyfile(data.tokenizer_path, run_dir / "tokenizer.json")
        np.save(run_dir / "val_tokens.npy", batches.val_tokens().numpy())
    start_step = 0
    if latest is not None:
        try:
            latest = trainer.find_checkpoint()  # rank 0 verifies the checksums; every rank takes its choice
        except ValueError as exc:  # every rank: the same clean error as before the process groups existed
            if parallel.is_main:
                print(f"train.py: error: {exc}", file=sys.stderr)
            ep_buffers.destroy()
            parallel.destroy()
            return 2
        start_step = trainer.resume(latest)
    elif args.init is not None:
        load_model(Path(args.init))
    parallel.barrier()
    if parallel.is_main:
        print(f"training {Path(args.config).stem} ({_layout_text(layout)}) from step {start_step} to {train_cfg.steps}")
    t0 = time.perf_counter()
    try:
        trainer.fit(start_step)
    except TrainingStopped as stop:  # every rank stops at the same step (the decision is all-reduced)
        if parallel.is_main:
            print(f"train.py: stopped: {stop}", file=sys.stderr)
        ep_buffers.destroy()
        parallel.destroy()
        return 3
    if pipeline is not None and args.pipeline_timeline:
        report = pipeline.write_timeline(run_dir / "pipeline_timeline.json", run_dir / "pipeline_timeline.png")
        if parallel.is_main:
            print(f"last step's pipeline bubble {100 * report.fraction:.1f}% ({run_dir}/pipeline_timeline.*)")
    if parallel.is_main:
        print(f"trained in {time.perf_counter() - t0:.1f} s")
        _summary(run_dir)
    ep_buffers.destroy()  # after the last backward, which communicates on them
    parallel.destroy()
    return 0


def _read_model(read_model_dir, path: Path):
    """`(state_dict, config)` of a model directory, whatever order `read_model_dir` returns them in."""
    first, second = read_model_dir(path)
    return (first, second) if isinstance(first, dict) else (second, first)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _title(args, layout: Layout) -> str:
    return f"{Path(args.config).stem}: {_layout_text(layout)}, seed {args.seed}"


def _layout_text(layout: Layout) -> str:
    text = f"world {layout.world}: dp {layout.dp} x tp {layout.tp} x pp {layout.pp}, ep {layout.ep}"
    return text + (f", {layout.pp_schedule}" if layout.pp > 1 else "")


def _write_run_json(run_dir: Path, args, layout: Layout, train_cfg: TrainingConfig, data, parallel) -> None:
    with open(args.config, "rb") as f:
        doc = tomllib.load(f)
    info = {
        "title": _title(args, layout),
        "layout": {**layout.to_dict(), "dtype": train_cfg.dtype},
        "overlap_moe_expert_parallel_comm": args.overlap_moe_expert_parallel_comm,
        "config": {"path": str(args.config), "model": doc["model"], "training": train_cfg.to_dict()},
        "seed": args.seed,
        "init": args.init,
        "data": data.meta,
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
    }
    ckpt.write_json(run_dir / "run.json", info)


def _summary(run_dir: Path) -> None:
    records = read_metrics(run_dir / METRICS)
    if records:
        title = json.loads((run_dir / "run.json").read_text()).get("title", "")
        plot_loss(run_dir / METRICS, run_dir / LOSS_PNG, title=title)
        print(loss_table(records))
        print(f"metrics: {run_dir / METRICS}\nloss curve: {run_dir / LOSS_PNG}")


if __name__ == "__main__":
    sys.exit(main())
