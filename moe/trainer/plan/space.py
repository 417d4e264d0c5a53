"""The layouts the planner considers and the rules that reject them, each rule the trainer's own.

A `Candidate` is one complete choice: TP, PP, EP, ETP (DP follows), a pipeline schedule and its virtual stages, a
recompute setting, an FP8 recipe and ZeRO-1 on or off. `enumerate_candidates` walks them all and sorts out those
the trainer would refuse, calling the functions train.py calls:
- `moe.trainer.train.parallel_state.Layout` (world = tp * pp * dp; MoE folding: ep * etp divides dp * tp),
`Layout.check_experts`,
  `Layout.check_batch` (global batch = dp x micro-batches x rows);
- `moe.trainer.models.deepseek_v3.tensor_parallel.check_tensor_parallel` (heads, vocabulary, dense FFN divisible by tp);
- `moe.trainer.pipeline.split.check_schedule` (micro-batch counts per schedule) and `split_layers`;
- `moe.trainer.train.layout_rules.check_model_layout`, train.py's own (sequence long enough for sequence parallelism,
  ...), run last as a catch-all, and `apply_fp8`'s rule (FP8 dispatch needs hidden % 128 == 0);
- expert tensor parallelism (`--etp`, Megatron's expert_tensor_parallel_size; train.py runs it with the 'flex' and
  'alltoall' dispatchers, the planner prices 'flex'): etp splits each routed expert's FFN (gate/up by columns,
  down by rows): `moe.trainer.train.layout_rules.check_expert_tensor_parallel`, train.py's rule: etp divides
  moe_intermediate_size, and under block-wise FP8 every shard is a whole number of 128-wide scaling tiles (1x128
  activations, 128x128 weights): (moe_intermediate_size / etp) % 128 == 0.
Rejected choices are counted per reason; a rule decided for a partial choice (e.g. a TP size) counts every complete
choice it covers, so the counts add up to the whole space.

Interleaved 1F1B (Megatron's virtual pipeline, `vpp` chunks per rank) is train.py's `--pp-schedule 1f1b
--num-virtual-stages-per-pipeline-rank vpp`; `check_schedule` holds it to Megatron's rule (micro-batches a multiple
of pp).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.tensor_parallel import check_tensor_parallel
from moe.trainer.pipeline.split import check_schedule
from moe.trainer.plan.devices import DeviceSpec
from moe.trainer.plan.model_shape import DTYPE_BYTES, RECOMPUTE_CHOICES
from moe.trainer.train.layout_rules import check_expert_tensor_parallel, check_model_layout
from moe.trainer.train.parallel_state import FP8_RECIPES, PP_SCHEDULES, Layout
from moe.trainer.train.training_config import positive_int

# (schedule, chunks per rank) for pp > 1; 'interleaved' is Megatron's virtual pipeline (train.py: 1f1b with vpp).
PIPELINE_SCHEDULES: tuple[tuple[str, int], ...] = (
    ("1f1b", 1), ("zbh1", 1), ("dualpipev", 2), ("interleaved", 2), ("interleaved", 4),
)  # fmt: skip

# Reason keys -> the text the report prints.
REASONS = {
    "folding": "ep * etp does not divide dp * tp (MoE parallel folding; moe.trainer.train.parallel_state.Layout)",
    "experts": "n_routed_experts not divisible by ep (Layout.check_experts)",
    "batch": "global_batch not divisible by dp * micro_batches (Layout.check_batch)",
    "tp_shapes": "heads / vocabulary / dense FFN not divisible by tp (check_tensor_parallel)",
    "etp_ffn": "etp does not divide moe_intermediate_size (the expert FFN splits evenly over the ETP ranks)",
    "etp_fp8": "blockwise FP8 with etp > 1 needs (moe_intermediate_size / etp) % 128 == 0 (whole tiles per shard)",
    "schedule": "micro-batches do not fit the pipeline schedule (moe.trainer.pipeline.split.check_schedule)",
    "tied": "tied embeddings across pipeline ranks need dualpipev (train.py)",
    "train_py": "another train.py rule (check_model_layout)",
    "no_fp8": "the device has no FP8 GEMMs",
    "fp8_dispatch": "FP8 dispatch needs hidden_size % 128 == 0 (moe_flex_use_fp8)",
    "memory": "exceeds the device memory",
}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step computes: `global_batch` sequences of `seq_len` tokens, `micro_batches` per
    data-parallel rank, in `dtype` ('float32' | 'bfloat16', the [training] dtype)."""

    global_batch: int
    micro_batches: int
    seq_len: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batches", "seq_len"):
            positive_int("", name, getattr(self, name))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class Candidate:
    """One complete layout choice. `schedule` is 'none' without pipeline parallelism; `vpp` the model chunks per
    pipeline rank (2 for dualpipev, the interleave factor for 'interleaved', else 1)."""

    world: int
    tp: int
    pp: int
    ep: int
    etp: int = 1
    schedule: str = "none"
    vpp: int = 1
    recompute: str = "none"
    fp8: str = "none"
    zero1: bool = False

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.dp * self.tp // (self.ep * self.etp)

    @property
    def stages(self) -> int:
        """Pipeline stages (model chunks) in all: pp * vpp."""
        return self.pp * self.vpp

    def micro_rows(self, work: Workload) -> int:
        """Sequences per micro-batch on a data-parallel rank; ValueError when the batch does not split evenly."""
        rows, rest = divmod(work.global_batch, self.dp * work.micro_batches)
        if rest or not rows:
            raise ValueError(
                f"global_batch={work.global_batch} does not split into dp={self.dp} x "
                f"micro_batches={work.micro_batches} equal micro-batches"
            )
        return rows

    def name(self) -> str:
        """Short label, e.g. 'tp2 pp4 ep8 dp16 dualpipev sel+ fp8b zero1'."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"ep{self.ep}", f"dp{self.dp}"]
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if self.pp > 1:
            parts.append(self.schedule + (f"-v{self.vpp}" if self.schedule == "interleaved" else ""))
        if self.recompute != "none":
            parts.append({"selective": "sel", "selective+": "sel+", "full": "full"}[self.recompute])
        if self.fp8 != "none":
            parts.append({"delayed": "fp8d", "blockwise": "fp8b"}[self.fp8])
        if self.zero1:
            parts.append("zero1")
        return " ".join(parts)

    def train_flags(self) -> list[str]:
        """train.py's flags for this layout (the world size comes from torchrun)."""
        flags = ["--tp", str(self.tp), "--pp", str(self.pp), "--ep", str(self.ep)]
        if self.etp > 1:
            flags += ["--etp", str(self.etp)]
        if self.pp > 1:
            flags += ["--pp-schedule", self.schedule if self.schedule != "interleaved" else "1f1b"]
            if self.schedule == "interleaved":
                flags += ["--num-virtual-stages-per-pipeline-rank", str(self.vpp)]
        rc = RECOMPUTE_CHOICES[self.recompute]
        if rc:
            flags += ["--recompute-granularity", rc["granularity"]]
            if rc["granularity"] == "full":
                flags += ["--recompute-method", rc["method"], "--recompute-num-layers", str(rc["num_layers"])]
            else:
                flags += ["--recompute-modules", *rc["modules"]]
        if self.fp8 != "none":
            flags += ["--fp8", self.fp8]
        if self.zero1:
            flags.append("--use-distributed-optimizer")
        return flags


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _TrainingStub:
    """The `TrainingConfig` fields `check_model_layout` reads."""

    def __init__(self, work: Workload) -> None:
        self.global_batch, self.micro_batches, self.seq_len = work.global_batch, work.micro_batches, work.seq_len


@dataclass
class Space:
    """The enumeration's outcome: `accepted` candidates (rules passed; memory not yet checked) and `rejected`
    counts per reason key of `REASONS`, with one example choice per reason."""

    accepted: list[Candidate]
    rejected: Counter
    examples: dict[str, str]

    def reject(self, reason: str, count: int, example: str) -> None:
        if count:
            self.rejected[reason] += count
            self.examples.setdefault(reason, example)


def enumerate_candidates(
    config: DeepseekV3Config,
    work: Workload,
    world: int,
    spec: DeviceSpec,
    *,
    recomputes: tuple[str, ...] = tuple(RECOMPUTE_CHOICES),
    fp8s: tuple[str, ...] = FP8_RECIPES,
    max_tp: int | None = None,
) -> Space:
    """Every choice for `world` devices, sorted into accepted candidates and rejection counts (module docstring).

    recomputes / fp8s: the recompute and FP8 choices to enumerate. max_tp: largest TP size considered (None: all
    divisors of `world`; TP sizes beyond it are not choices at all, not rejections).
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"devices must be a positive int, got {world!r}")
    bad = sorted(set(recomputes) - set(RECOMPUTE_CHOICES)) + sorted(set(fp8s) - set(FP8_RECIPES))
    if bad:
        raise ValueError(f"unknown recompute / fp8 choices {bad}")
    space = Space([], Counter(), {})
    stub = _TrainingStub(work)
    n_rc, n_fp8 = len(recomputes), len(fp8s)
    for tp, pp in itertools.product(divisors(world), repeat=2):
        if world % (tp * pp) or (max_tp is not None and tp > max_tp):
            continue
        dp = world // (tp * pp)
        schedules = [("none", 1)] if pp == 1 else list(PIPELINE_SCHEDULES)
        for ep, etp in itertools.product(divisors(world), repeat=2):
            zeros = _zero_choices(dp, tp, ep, etp)
            per_layout = len(schedules) * n_rc * n_fp8 * len(zeros)
            example = f"tp{tp} pp{pp} ep{ep} etp{etp} dp{dp}"
            try:
                layout = Layout(world=world, tp=tp, pp=pp, ep=ep, etp=etp)
            except ValueError:
                space.reject("folding", per_layout, example)
                continue
            reason = _layout_reason(config, work, layout, check_tensor_parallel)
            if reason is not None:
                space.reject(reason, per_layout, example)
                continue
            for schedule, vpp in schedules:
                per_schedule = n_rc * n_fp8 * len(zeros)
                label = example + (f" {schedule}" + (f"-v{vpp}" if schedule == "interleaved" else "") if pp > 1 else "")
                reason = _schedule_reason(config, work, pp, schedule, vpp)
                if reason is None:
                    reason = _train_py_reason(config, stub, world, tp, pp, ep, schedule, vpp)
                if reason is not None:
                    space.reject(reason, per_schedule, label)
                    continue
                for recompute, fp8, zero1 in itertools.product(recomputes, fp8s, zeros):
                    if fp8 != "none" and not spec.has_fp8():
                        space.reject("no_fp8", 1, label + f" fp8 {fp8}")
                        continue
                    if fp8 != "none" and config.hidden_size % 128:
                        space.reject("fp8_dispatch", 1, label + f" fp8 {fp8}")
                        continue
                    if not fp8_shards_whole_tiles(config, etp, fp8):
                        space.reject("etp_fp8", 1, label + f" fp8 {fp8}")
                        continue
                    space.accepted.append(Candidate(world, tp, pp, ep, etp, schedule, vpp, recompute, fp8, zero1))
    return space


def _zero_choices(dp: int, tp: int, ep: int, etp: int) -> tuple[bool, ...]:
    """ZeRO-1 is a choice when some optimizer state can be sharded: over dp ranks (dense) or edp (experts)."""
    edp = dp * tp // (ep * etp) if (dp * tp) % (ep * etp) == 0 else 1
    return (False, True) if max(dp, edp) > 1 else (False,)


def _layout_reason(config: DeepseekV3Config, work: Workload, layout: Layout, check_tp) -> str | None:
    """The first layout rule (independent of the schedule) `layout` breaks, or None."""
    try:
        layout.check_experts(config.n_routed_experts)
    except ValueError:
        return "experts"
    try:
        layout.check_batch(work.global_batch, work.micro_batches)
    except ValueError:
        return "batch"
    try:
        check_tp(config, layout.tp)
    except ValueError:
        return "tp_shapes"
    try:
        check_expert_tensor_parallel(config, layout.etp, "none")
    except ValueError:
        return "etp_ffn"
    return None


def fp8_shards_whole_tiles(config: DeepseekV3Config, etp: int, fp8: str) -> bool:
    """Whether the FP8 recipe `fp8` can run expert shards of `moe_intermediate_size / etp` columns: train.py's
    `check_expert_tensor_parallel` (block-wise scaling needs whole 128-wide tiles in each shard)."""
    try:
        check_expert_tensor_parallel(config, etp, fp8)
    except ValueError:
        return False
    return True


def _schedule_reason(config: DeepseekV3Config, work: Workload, pp: int, schedule: str, vpp: int) -> str | None:
    if pp == 1:
        return None
    try:
        if schedule == "interleaved":
            check_schedule("1f1b", pp, work.micro_batches, vpp)
        else:
            check_schedule(schedule, pp, work.micro_batches)
    except ValueError:
        return "schedule"
    if config.tie_word_embeddings and schedule != "dualpipev":
        return "tied"
    return None


def _train_py_reason(config, stub, world, tp, pp, ep, schedule, vpp) -> str | None:
    """train.py's `check_model_layout` on the layout: whatever it still refuses. It is asked with etp 1: its expert
    tensor-parallel rule (`check_expert_tensor_parallel`) is asked separately (`_layout_reason`,
    `fp8_shards_whole_tiles`) to count its rejections under their own names, and nothing else it checks depends on
    etp."""
    try:
        sched = schedule if schedule in PP_SCHEDULES else "1f1b"
        layout = Layout(
            world=world, tp=tp, pp=pp, ep=ep, pp_schedule=sched, vpp=vpp if schedule == "interleaved" else 1
        )
        check_model_layout(config, stub, layout)
    except ValueError:
        return "train_py"
    return None


def rejection_reason(cand: Candidate, config: DeepseekV3Config, work: Workload, spec: DeviceSpec) -> str | None:
    """The key of `REASONS` of the first rule `cand` breaks (the rules `enumerate_candidates` applies, in its
    order; memory not checked), or None when train.py would run it."""
    try:
        layout = Layout(world=cand.world, tp=cand.tp, pp=cand.pp, ep=cand.ep, etp=cand.etp)
    except ValueError:
        return "folding"
    reason = _layout_reason(config, work, layout, check_tensor_parallel)
    if reason is None:
        reason = _schedule_reason(config, work, cand.pp, cand.schedule, cand.vpp)
    if reason is None:
        reason = _train_py_reason(config, _TrainingStub(work), cand.world, cand.tp, cand.pp, cand.ep, cand.schedule,
                                  cand.vpp)  # fmt: skip
    if reason is None and cand.fp8 != "none":
        if not spec.has_fp8():
            reason = "no_fp8"
        elif config.hidden_size % 128:
            reason = "fp8_dispatch"
        elif not fp8_shards_whole_tiles(config, cand.etp, cand.fp8):
            reason = "etp_fp8"
    return reason
