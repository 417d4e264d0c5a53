"""The DeepSeek-V3 trainer's one config tree (examples/deepseek_v3/train.py): what a run is, from a TOML file and
the command line, validated before any process group exists (moe/trainer/train/config_tree.py has the mechanism).

    [model]       DeepseekV3Config     (moe/trainer/models/deepseek_v3/model_config.py)
    [training]    TrainingConfig       the loop: steps, batch, precision (moe/trainer/train/training_config.py, as the
    [optimizer]   OptimizerConfig      next five): AdamW, clip and learning-rate schedule
    [zero]        DistributedOptimizerConfig: ZeRO-1
    [checkpoint]  CheckpointConfig
    [rewind]      RewindConfig         anomaly checks and rewind
    [straggler]   StragglerConfig      slow-rank detection
    [data]        DataConfig           corpus, tokenizer, Megatron's indexed data
    [parallel]    ParallelConfig       (below): tp, pp, ep, etp, the schedule, the FP8 recipe, pipeline options
    [recompute]   RecomputeConfig      (moe/trainer/models/deepseek_v3/model_recompute.py)
    [metrics]     MetricsConfig        (moe/trainer/train/loggers.py): TensorBoard and Weights & Biases
    [profiling]   ProfilingConfig      (moe/trainer/train/profiling.py): torch.profiler over chosen steps and ranks

Every field can be set in the file or as `--section.key value` (`--optimizer.lr 1e-3`, `--parallel.tp 2`,
`--model.rope_parameters.rope_theta 5e4`). The short flags (`--tp`, `--ep`, `--steps`, ...) and Megatron's option
names (`--tensor-model-parallel-size`, `--train-iters`, `--global-batch-size`, `--lr`, ...) are aliases of tree
fields. Command line over file over defaults; the resolved tree is printed by rank 0 and saved as RUN_DIR/config.toml
(`--config RUN_DIR/config.toml` runs it again). A file (or `--training.<key>`) in the layout before the trainer's
tables were split, every key in one `[training]` table, still runs: each moved key is read at its old place and named
with its new table in one warning (`training_config.MOVED`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from moe.trainer.io.atomic import write_bytes
from moe.trainer.models.deepseek_v3 import DeepseekV3Config, RecomputeConfig
from moe.trainer.models.deepseek_v3.attention import ATTENTION_BACKENDS
from moe.trainer.models.deepseek_v3.model_config import EXTENSION_FIELDS
from moe.trainer.models.deepseek_v3.model_dir import read_config
from moe.trainer.pipeline.split import StageSplit, check_schedule, split_layers, stages_per_rank
from moe.trainer.train.config_tree import (
    ConfigTree,
    Section,
    dataclass_schema,
    overrides_from_namespace,
    split_overrides,
)
from moe.trainer.train.layout_rules import check_model_layout
from moe.trainer.train.loggers import MetricsConfig
from moe.trainer.train.parallel_state import FP8_RECIPES, PP_SCHEDULES, Layout, env_world_size
from moe.trainer.train.profiling import ProfilingConfig
from moe.trainer.train.training_config import (
    MOVED,
    REQUIRED,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    DistributedOptimizerConfig,
    OptimizerConfig,
    RewindConfig,
    StragglerConfig,
    TrainerConfig,
    TrainingConfig,
    build_table,
    section_table,
)

CONFIG_TOML = "config.toml"


@dataclass(kw_only=True)
class ParallelConfig:
    """How the ranks are split and scheduled (`Layout` adds the world size, which torchrun gives).

    tp, pp, ep, etp: tensor-, pipeline-, expert- and expert-tensor-parallel sizes (Megatron's
        `--tensor-model-parallel-size` ...). pp_schedule: '1f1b', 'zbh1' or 'dualpipev'.
    num_virtual_stages_per_pipeline_rank: V, the pipeline stages each rank holds round-robin (rank r: stages r,
        r + pp, ...; pp * V stages): 1f1b runs torch's interleaved 1F1B, zbh1 its interleaved zero bubble; 1 (the
        default) is one stage per rank.
    decoder_first/last_pipeline_num_layers: decoder layers of the first / last pipeline stage (the rest shared
        evenly); with V > 1, of the first / last pipeline rank, shared by its V stages (Megatron-core's rule).
        overlap_moe_expert_parallel_comm: DualPipeV's overlapped chunks run one micro-batch's MoE dispatch /
        combine beside the other's compute. pipeline_timeline: record the last step's pipeline actions (Perfetto
        JSON and PNG in the run directory). fp8: the FP8 recipe ('none', 'delayed', 'blockwise').
        use_deepep_p2p: the pipeline's activations and gradients move through `pp_send` / `pp_recv` of an
        `mtdeepep.ElasticBuffer` over the pipeline group instead of torch.distributed's P2P
        (moe/trainer/pipeline/p2p.py; named after Megatron's `use_ring_exchange_p2p`, its other P2P transport). Off by
        default: measured slower on this CPU executor (bench/pipeline.py).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    pp_schedule: str = "1f1b"
    num_virtual_stages_per_pipeline_rank: int = 1
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    overlap_moe_expert_parallel_comm: bool = False
    pipeline_timeline: bool = False
    fp8: str = "none"
    use_deepep_p2p: bool = False

    def layout(self, world: int) -> Layout:
        return Layout(world=world, tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, pp_schedule=self.pp_schedule,
                      fp8=self.fp8, vpp=self.num_virtual_stages_per_pipeline_rank)  # fmt: skip


@dataclass
class Job:
    """A validated run: the configs of its tables, the layout over this world, the pipeline split (None without
    pipeline parallelism) and the resolved tree (what is printed and saved)."""

    model: DeepseekV3Config
    training: TrainingConfig
    optimizer: OptimizerConfig
    zero: DistributedOptimizerConfig
    checkpoint: CheckpointConfig
    rewind: RewindConfig
    straggler: StragglerConfig
    data: DataConfig
    parallel: ParallelConfig
    recompute: RecomputeConfig
    metrics: MetricsConfig
    profiling: ProfilingConfig
    layout: Layout
    split: StageSplit | None
    tables: dict[str, dict[str, Any]]

    @property
    def trainer(self) -> TrainerConfig:
        """The trainer's component configs (what `Trainer` is given)."""
        return TrainerConfig(**{name: getattr(self, name) for name in SECTIONS})

    def toml(self) -> str:
        """The resolved tree as TOML (unset optional fields, None, are left out: TOML has no null)."""
        return tomli_w.dumps(_drop_none(self.tables))

    def save(self, run_dir: Path) -> None:
        write_bytes(run_dir / CONFIG_TOML, self.toml().encode())


def _build_model(table: dict[str, Any]) -> DeepseekV3Config:
    if not table:
        raise ValueError("no [model] table")
    return DeepseekV3Config.from_dict(table, strict=True, source="[model]")


def _trainer_section(name: str) -> Section:
    """A table of the trainer's (training_config.SECTIONS): built with its required keys checked."""
    cls = SECTIONS[name]

    def build(table: dict[str, Any]) -> Any:
        if not table and name in REQUIRED:
            raise ValueError(f"no [{name}] table")
        return build_table(cls, name, table)

    return Section(name, dataclass_schema(cls), build, section_table)


def _build_recompute(table: dict[str, Any]) -> RecomputeConfig:
    table = dict(table)
    table["modules"] = tuple(table.get("modules") or ("core_attn",))  # Megatron's default, also for an empty list
    return RecomputeConfig(**table)


TREE = ConfigTree(
    [
        Section("model", dataclass_schema(DeepseekV3Config), _build_model, DeepseekV3Config.to_dict),
        *(_trainer_section(name) for name in SECTIONS),
        Section("parallel", dataclass_schema(ParallelConfig), lambda t: ParallelConfig(**t), dataclasses.asdict),
        Section(
            "recompute",
            dataclass_schema(RecomputeConfig),
            _build_recompute,
            lambda r: {**dataclasses.asdict(r), "modules": list(r.modules)},
        ),
        Section("metrics", dataclass_schema(MetricsConfig), lambda t: MetricsConfig(**t), dataclasses.asdict),
        Section("profiling", dataclass_schema(ProfilingConfig), lambda t: ProfilingConfig(**t), dataclasses.asdict),
    ],
    moved=MOVED,
)


def add_tree_options(p: argparse.ArgumentParser) -> None:
    """The short flags and Megatron's names, each an alias of a tree field (its `dest` is the field's path)."""

    def alias(*flags: str, dest: str, **kwargs: Any) -> None:
        p.add_argument(*flags, dest=dest, default=None, **kwargs)

    alias("--steps", "--train-iters", dest="training.steps", type=int,
          help="optimizer steps (default: [training] steps)")  # fmt: skip
    alias("--micro-batches", dest="training.micro_batches", type=int,
          help="micro-batches per step per data-parallel rank (default: [training])")  # fmt: skip
    alias("--global-batch-size", dest="training.global_batch", type=int, help="sequences per optimizer step")
    alias("--seq-length", dest="training.seq_len", type=int, help="tokens per sequence")
    alias("--lr", dest="optimizer.lr", type=float, help="peak learning rate")
    alias("--min-lr", dest="optimizer.min_lr", type=float, help="learning rate at the end of the cosine decay")
    alias("--lr-warmup-iters", dest="optimizer.warmup_steps", type=int, help="linear warm-up steps")
    alias("--weight-decay", dest="optimizer.weight_decay", type=float, help="AdamW weight decay")
    alias("--clip-grad", dest="optimizer.clip_grad", type=float, help="global gradient-norm clip (0: off)")
    alias("--save-interval", dest="checkpoint.checkpoint_every", type=int, help="steps between checkpoints")
    alias("--log-interval", dest="training.log_every", type=int, help="steps between console log lines")
    alias("--bf16", dest="training.dtype", action="store_const", const="bfloat16", help="BF16 parameters/activations")
    alias("--use-distributed-optimizer", dest="zero.use_distributed_optimizer", action="store_const", const=True,
          help="ZeRO-1: optimizer states and FP32 masters sharded over the data-parallel ranks "
          "(default: [zero] use_distributed_optimizer)")  # fmt: skip
    alias("--ddp-bucket-size", dest="zero.ddp_bucket_size", type=int,
          help="gradient bucket size in elements (ZeRO-1)")  # fmt: skip
    alias("--overlap-grad-reduce", dest="zero.overlap_grad_reduce", action="store_const", const=True,
          help="ZeRO-1: start each gradient bucket's reduction as soon as it is complete, in the backward or, under a "
          "pipeline, once its stage's last weight-gradient action ran (default: [zero] overlap_grad_reduce, true; "
          "--zero.overlap_grad_reduce false reduces every bucket after the backward)")  # fmt: skip
    alias("--attention-backend", dest="training.attention_backend", choices=ATTENTION_BACKENDS,
          help="MLA's attention core: sdpa (default), unfused, auto (models/deepseek_v3/attention.py)")  # fmt: skip
    alias("--compile", dest="training.compile", action="store_const", const=True,
          help="torch.compile (inductor) every layer's attention (default: [training] compile; the first step "
          "compiles)")  # fmt: skip
    alias("--data-cache", dest="data.cache_dir", help="token cache directory (default: [data])")
    alias("--data-path", dest="data.data_path", nargs="+", metavar="W_OR_PREFIX",
          help="Megatron's blend of indexed datasets: w1 prefix1 w2 prefix2 ... or prefixes alone (then the corpus "
          "is unused; --tokenizer names the tokenizer that prepared them)")  # fmt: skip
    alias("--tokenizer", dest="data.tokenizer",
          help="bpe, bytes, or a tokenizer.json / tokenizer directory (default: [data])")  # fmt: skip
    alias("--corpus", dest="data.corpus", help="a directory, a file or a glob of corpus files")
    alias("--reset-position-ids", dest="data.reset_position_ids", action="store_const", const=True,
          help="position ids restart after every end-of-text token (Megatron's)")  # fmt: skip
    alias("--reset-attention-mask", dest="data.reset_attention_mask", action="store_const", const=True,
          help="attention does not cross an end-of-text token (Megatron's)")  # fmt: skip
    alias("--eod-mask-loss", dest="data.eod_mask_loss", action="store_const", const=True,
          help="no loss on the target after an end-of-text token (Megatron's)")  # fmt: skip
    alias("--ep", "--expert-model-parallel-size", dest="parallel.ep", type=int,
          help="expert-parallel ranks (divides the world size)")  # fmt: skip
    alias("--tp", "--tensor-model-parallel-size", dest="parallel.tp", type=int,
          help="tensor-parallel ranks (sequence parallel with them)")  # fmt: skip
    alias("--etp", "--expert-tensor-parallel-size", dest="parallel.etp", type=int,
          help="expert tensor-parallel ranks (ep * etp divides dp * tp)")  # fmt: skip
    alias("--pp", "--pipeline-model-parallel-size", dest="parallel.pp", type=int, help="pipeline-parallel ranks")
    alias("--pp-schedule", dest="parallel.pp_schedule", choices=PP_SCHEDULES,
          help="pipeline schedule (dualpipev: 2 stages per rank in a V)")  # fmt: skip
    alias("--num-virtual-stages-per-pipeline-rank", "--vpp",
          dest="parallel.num_virtual_stages_per_pipeline_rank", type=int,
          help="pipeline stages per rank, placed round-robin (default 1): with --pp-schedule 1f1b interleaved 1F1B, "
          "with zbh1 interleaved zero bubble; micro-batches a multiple of --pp")  # fmt: skip
    alias("--decoder-first-pipeline-num-layers", dest="parallel.decoder_first_pipeline_num_layers", type=int,
          help="decoder layers of the first pipeline stage (the rest shared evenly)")  # fmt: skip
    alias("--decoder-last-pipeline-num-layers", dest="parallel.decoder_last_pipeline_num_layers", type=int,
          help="decoder layers of the last pipeline stage")  # fmt: skip
    alias("--overlap-moe-expert-parallel-comm", dest="parallel.overlap_moe_expert_parallel_comm",
          action="store_const", const=True,
          help="dualpipev: in each overlapped forward-backward chunk, one micro-batch's MoE dispatch / combine runs "
          "while the other micro-batch computes (same results bit for bit)")  # fmt: skip
    alias("--pipeline-timeline", dest="parallel.pipeline_timeline", action="store_const", const=True,
          help="record every pipeline action; write RUN_DIR/pipeline_timeline.json (Perfetto) and .png of the last "
          "step, with the measured bubble")  # fmt: skip
    alias("--use-deepep-p2p", dest="parallel.use_deepep_p2p", action="store_const", const=True,
          help="pipeline activations and gradients through mtdeepep's pp_send / pp_recv instead of torch.distributed's "
          "P2P (default: [parallel] use_deepep_p2p, false)")  # fmt: skip
    alias("--fp8", "--fp8-recipe", dest="parallel.fp8", choices=FP8_RECIPES, help="FP8 recipe (default none)")
    alias("--tensorboard-dir", dest="metrics.tensorboard_dir",
          help="write every metrics.jsonl number as TensorBoard scalars here, from rank 0 (a resumed run continues "
          "it; torchtitan's [metrics] enable_tensorboard writes into RUN_DIR/tb)")  # fmt: skip
    alias("--wandb-project", dest="metrics.wandb_project",
          help="log the same numbers to this Weights & Biases project (needs wandb; WANDB_MODE=offline without a "
          "network)")  # fmt: skip
    alias("--wandb-exp-name", dest="metrics.wandb_exp_name", help="the W&B run's name (default: RUN_DIR's name)")
    alias("--wandb-save-dir", dest="metrics.wandb_save_dir", help="W&B's local files (default: RUN_DIR/wandb)")
    alias("--profile", dest="profiling.enable_profiling", action="store_const", const=True,
          help="torch.profiler over --profile-step-start < step <= --profile-step-end (default 10, 12) on "
          "--profile-ranks: a Perfetto trace per rank under RUN_DIR/profile_traces, top operators printed at the "
          "end")  # fmt: skip
    alias("--profile-step-start", dest="profiling.profile_step_start", type=int,
          help="steps done when profiling starts (Megatron's; default 10)")  # fmt: skip
    alias("--profile-step-end", dest="profiling.profile_step_end", type=int,
          help="steps done when profiling stops (Megatron's; default 12)")  # fmt: skip
    alias("--profile-ranks", dest="profiling.profile_ranks", type=int, nargs="+", metavar="RANK",
          help="global ranks to profile (default: every rank)")  # fmt: skip
    p.add_argument("--use-pytorch-profiler", action="store_true",
                   help="accepted for Megatron's command lines: --profile always runs torch.profiler")  # fmt: skip
    alias("--recompute-granularity", dest="recompute.granularity", choices=("full", "selective"),
          help="activation recompute (Megatron's; moe/trainer/models/deepseek_v3/model_recompute.py)")  # fmt: skip
    alias("--recompute-method", dest="recompute.method", choices=("uniform", "block"), help="for 'full'")
    alias("--recompute-num-layers", dest="recompute.num_layers", type=int,
          help="for 'full': chunk size / layers")  # fmt: skip
    alias("--recompute-modules", dest="recompute.modules", nargs="*",
          help="for 'selective' (default core_attn): core_attn moe_act layernorm mla_up_proj mlp moe "
          "shared_experts")  # fmt: skip


def parse(parser: argparse.ArgumentParser, argv: list[str] | None):
    """`(args, overrides)`: the parser's options (the aliases among them) and the `--section.key` overrides."""
    rest, dotted = split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    return args, [*overrides_from_namespace(args), *dotted]


def load_job(config: str | Path, overrides, world: int | None = None) -> Job:
    """The run's configs from the TOML file and the overrides, with every rule the layout, the batch and the pipeline
    put on the model checked (ValueError, before any process group)."""
    with warnings.catch_warnings():
        if env_rank() != 0:  # the moved keys' warning once per run, not once per rank
            warnings.simplefilter("ignore", FutureWarning)
        tables = TREE.read(config, overrides)
    built = TREE.build(tables)
    model, training, parallel, recompute = built["model"], built["training"], built["parallel"], built["recompute"]
    metrics, profiling = built["metrics"], built["profiling"]
    trainer = {name: built[name] for name in SECTIONS}
    layout = parallel.layout(env_world_size() if world is None else world)
    metrics.check()
    profiling.check(training.steps, layout.world)
    check_model_layout(model, training, layout)
    if training.compile and layout.tp > 1:
        raise ValueError(
            "[training] compile with --tp > 1: the sequence-parallel collectives inside the attention are not "
            "compiled (moe/trainer/models/deepseek_v3/compile.py); use one or the other"
        )
    split = pipeline_split(model, training, layout, parallel)
    recompute.full_chunks(model.num_hidden_layers)  # recompute_num_layers fits the model
    return Job(model=model, **trainer, parallel=parallel, recompute=recompute, metrics=metrics, profiling=profiling,
               layout=layout, split=split, tables=TREE.resolved(built))  # fmt: skip


def job_from_args(config: str | Path, argv: Sequence[str] = (), world: int = 1) -> Job:
    """`load_job` with the overrides of a command line (`--section.key value` and the aliases), as benches and
    tests describe a run: `job_from_args(TINY, ["--steps", "4", "--use-distributed-optimizer"], world=2)`."""
    parser = argparse.ArgumentParser(add_help=False)
    add_tree_options(parser)
    _, overrides = parse(parser, list(argv))
    return load_job(config, overrides, world=world)


def pipeline_split(model_cfg, train_cfg: TrainingConfig, layout: Layout, parallel: ParallelConfig):
    """The decoder layers of each pipeline stage (None without pipeline parallelism); ValueError for a split or a
    micro-batch count the schedule cannot run."""
    outer = (parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers)
    if parallel.overlap_moe_expert_parallel_comm and (layout.pp == 1 or layout.pp_schedule != "dualpipev"):
        raise ValueError(
            "--overlap-moe-expert-parallel-comm overlaps DualPipeV's forward-backward chunks: it needs --pp > 1 "
            "--pp-schedule dualpipev"
        )
    if layout.pp == 1:
        if any(v is not None for v in outer):
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pp > 1")
        if parallel.use_deepep_p2p:
            raise ValueError("--use-deepep-p2p moves the pipeline's activations and gradients: it needs --pp > 1")
        return None
    check_schedule(layout.pp_schedule, layout.pp, train_cfg.micro_batches, layout.vpp)
    if model_cfg.tie_word_embeddings and layout.pp_schedule != "dualpipev":
        raise ValueError(
            f"tie_word_embeddings with --pp {layout.pp} --pp-schedule {layout.pp_schedule}: the embedding and the "
            "output head would sit on different ranks; untie them or use dualpipev"
        )
    stages = layout.pp * stages_per_rank(layout.pp_schedule, layout.vpp)
    return split_layers(model_cfg.num_hidden_layers, stages, first_stage_layers=outer[0],
                        last_stage_layers=outer[1], virtual_stages=layout.vpp)  # fmt: skip


def check_init_config(init: str, model_cfg: DeepseekV3Config) -> None:
    """The --init model directory must hold the model of --config (the training extensions may differ)."""
    theirs, ours = read_config(init).to_dict(), model_cfg.to_dict()
    diff = {k: (theirs[k], ours[k]) for k in ours if k not in EXTENSION_FIELDS and theirs.get(k) != ours[k]}
    if diff:
        raise ValueError(f"--init {init}: its model differs from the [model] of --config: {diff} (checkpoint, config)")


def env_rank() -> int:
    """This process's global rank under torchrun (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, tuple):
        return list(value)
    return value
