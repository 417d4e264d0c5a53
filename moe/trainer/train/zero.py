"""ZeRO-1 data parallelism: bucketed gradient reduce-scatter overlapped with the backward, and AdamW whose FP32
master weights and moments are sharded over the data-parallel ranks (Megatron-core's distributed optimizer).

A drop-in for `MasterAdamW` (moe/trainer/train/optim.py): the same constructor, `zero_grad / reduce_gradients /
global_grad_norm / clip / step / state_tensors / set_steps`, the same AdamW maths (torch's single-tensor AdamW on
slices of the parameters) and the same layout-independent state format. What the trainer adds (see
`accumulation_context`): micro-batches other than the last run under `no_sync()`, so nothing is communicated until
the last micro-batch's backward.

Gradients. Parameters are grouped by how their gradients reduce (the tags of the issue-11 contract):
- dense parameters: summed over `dp_group`; a TP-replicated one tagged `sequence_parallel_grad` is also summed over
  `tp_group` (each TP rank saw part of the sequence);
- expert parameters (`expert_parallel`, or listed in `expert_params`): summed over `expert_dp_group`.
Each (group kind, parameter dtype) gets one contiguous FP32 gradient buffer, cut into buckets at parameter boundaries
in reverse registration order (the order the backward produces them): a bucket is closed once it holds at least
`bucket_size` elements (Megatron's semantics), and padded so that it splits into equal shards over its group's ranks.
Rank i of the group owns shard i of every bucket (a parameter may straddle shards).

Overlap. A post-accumulate-grad hook on every parameter adds its gradient into the bucket (in FP32) and frees
`param.grad`; on the last micro-batch, when every parameter of a bucket has arrived, the bucket's reduce-scatter is
launched asynchronously while the backward goes on. Buckets launch in one fixed global order on every rank (a bucket
waits for its predecessors), so the collectives of the two groups never cross on any rank. `finish_grad_sync()`
launches whatever did not complete (e.g. a parameter that received no gradient counts as zero) and waits.

Under a pipeline (`stage_params`: each pipeline stage's parameters) a bucket holds the parameters of one stage
only (a parameter shared by stages, a tied embedding, goes with the others of the same stages), and the trainer runs
the whole schedule under `no_sync()`: the schedule interleaves the micro-batches' backwards, so a hook cannot tell a
stage's last gradient. Instead the schedule reports when a stage's last micro-batch's weight gradients are complete
(its last B action, or its last W action under a split backward) and `stage_grads_done(stage)` launches that
stage's buckets then, in bucket order, while the other stages still compute (Megatron's overlap of the data-parallel
reduction with the pipeline's cool-down). The ranks of one reduction group hold the same stages and run the same
schedule, so they launch in the same order. Gradients the W actions add to `param.grad` by hand join their buckets
just before the launch (`_absorb_unhooked_grads`); one arriving after its bucket was launched is an error.

Collectives per backend: NCCL/MCCL use `reduce_scatter_tensor` (in place: the output is this rank's shard of the
bucket) and `all_gather_into_tensor`. torch 2.13's gloo accepts both reduce-scatter forms but implements them on top
of all-reduce (`reduce_scatter_tensor`: clone the input, all-reduce it, copy the shard out; the list form: one
all-reduce per rank's chunk), so on gloo the bucket is all-reduced in place and the rank reads its shard: the same
traffic as gloo's own reduce-scatter without the clone.

Optimizer. Each rank keeps FP32 masters (a view of the parameter itself when the parameter is FP32), exp_avg and
exp_avg_sq only for its shards; AdamW steps those slices; then every bucket's parameters (model dtype) are
all-gathered over the bucket's group. The model's parameters are views into the buckets' parameter buffers, so the
all-gather writes the model in place.

Global norm (contract rule: every element of the full model once): each rank adds the squares of its shards,
skipping TP-replicated dense parameters on tp ranks other than 0; one float64 all-reduce over the world.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from moe.trainer.train.optim import (
    StateTensor,
    build_adamw,
    clip_factor,
    decays,
)
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.training_config import OptimizerConfig

MEGATRON_MIN_BUCKET = 40_000_000  # Megatron's default bucket size: max(40M, 1M * dp) elements


@dataclass(frozen=True)
class ZeroConfig:
    """bucket_size: elements per gradient bucket (a bucket closes once it holds at least this many); None =
    Megatron's default `max(40_000_000, 1_000_000 * dp)`. overlap_grad_reduce: launch each bucket's reduce-scatter
    from the backward, under a pipeline as soon as its stage's gradients are final (False: all of them in
    `finish_grad_sync`). timeout_s: the deadline of every wait."""

    bucket_size: int | None = None
    overlap_grad_reduce: bool = True
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1
        ):
            raise ValueError(f"bucket_size must be a positive int or None, got {self.bucket_size!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s!r}")


class CollectiveTimeout(RuntimeError):
    """A ZeRO-1 collective failed or did not complete in time (a rank never arrived); the message names the phase."""


@dataclass(eq=False)
class _Entry:
    """One trainable parameter in its bucket: elements `[offset, offset + numel)` of the bucket's buffers."""

    name: str
    param: nn.Parameter
    expert: bool
    tp_replicated: bool  # no tensor_parallel_dim: counted in the norm on tp rank 0 only
    sp_grad: bool  # gradient summed over the TP group as well
    stages: tuple[int, ...] = ()  # the pipeline stages whose backward produces its gradient (none: no pipeline)
    bucket: int = -1
    offset: int = 0

    @property
    def numel(self) -> int:
        return self.param.numel()


@dataclass(eq=False)
class _Segment:
    """The part of an entry inside this rank's shard: parameter elements `[lo, hi)` = shard elements
    `[lo + entry.offset - shard_start, ...)`. `master` is FP32 (a view of the parameter when it is FP32)."""

    entry: _Entry
    lo: int
    hi: int
    shard_lo: int
    master: torch.Tensor | None = None


@dataclass(eq=False)
class _Bucket:
    index: int
    kind: str  # "dense" | "expert"
    group: dist.ProcessGroup | None
    group_size: int
    group_rank: int
    dtype: torch.dtype
    entries: list[_Entry]
    numel: int  # padded to a multiple of group_size
    grad: torch.Tensor  # [numel] FP32
    params: torch.Tensor  # [numel] model dtype; the entries' parameters are views into it
    stages: tuple[int, ...] = ()  # its entries' pipeline stages (every entry has the same)
    segments: list[_Segment] = field(default_factory=list)
    exp_avg: torch.Tensor | None = None  # [shard] FP32
    exp_avg_sq: torch.Tensor | None = None
    master: torch.Tensor | None = None  # [shard] FP32, only for non-FP32 buckets
    ready: set[int] = field(default_factory=set)
    work: object | None = None
    launched: bool = False

    @property
    def shard_size(self) -> int:
        return self.numel // self.group_size

    @property
    def shard_start(self) -> int:
        return self.group_rank * self.shard_size

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.shard_start : self.shard_start + self.shard_size]

    def describe(self) -> str:
        return f"bucket {self.index} ({self.kind}, {self.dtype}, {self.numel} elements, group of {self.group_size})"


class DistributedAdamW:
    """ZeRO-1 AdamW (see the module docstring).

    Args:
        model: the module whose `named_parameters()` are trained (on every rank the same names and local shapes).
        expert_params: parameters to treat as expert parameters besides those tagged `expert_parallel`.
        config: [optimizer]: lr, betas, eps, weight_decay, clip_grad.
        parallel: the groups (dp, tp, ep, expert_dp).
        zero: bucket size, overlap, timeout.
        stage_params: under a pipeline, `{stage index: that stage's parameters}` for the stages this rank holds:
            buckets then never mix stages, and `stage_grads_done(stage)` launches a stage's buckets (module
            docstring). None: no pipeline.

    Events for measurements: `events` lists `(name, bucket index or -1, perf_counter time)` of the current step:
    "launch" per bucket, "stage_done" per pipeline stage (with the stage's index), "grad_sync_start" /
    "grad_sync_end" around `finish_grad_sync`'s waits.
    """

    def __init__(
        self,
        model: nn.Module,
        expert_params: list[nn.Parameter],
        config: OptimizerConfig,
        parallel: ParallelState,
        zero: ZeroConfig | None = None,
        stage_params: Mapping[int, Iterable[nn.Parameter]] | None = None,
    ) -> None:
        self.config = config
        self.parallel = parallel
        self.zero = zero or ZeroConfig()
        self._timeout = timedelta(seconds=self.zero.timeout_s)
        self._sync = True
        self._reduced = False
        self.steps = 0
        self.events: list[tuple[str, int, float]] = []
        self._stages_done: set[int] = set()
        self.buckets = self._build_buckets(model, {id(p) for p in expert_params}, _stages_of(stage_params))
        self._next_launch = 0
        self._check_same_layout()
        self._build_shards()
        decay = [s.master for b in self.buckets for s in b.segments if decays(s.entry.param)]
        no_decay = [s.master for b in self.buckets for s in b.segments if not decays(s.entry.param)]
        self.adamw = build_adamw(decay, no_decay, config)
        self._init_adamw_state()
        self._hooks = [
            e.param.register_post_accumulate_grad_hook(self._grad_hook(e)) for b in self.buckets for e in b.entries
        ]

    # -- construction

    def _build_buckets(self, model: nn.Module, expert_ids: set[int],
                       stages_of: dict[int, tuple[int, ...]]) -> list[_Bucket]:  # fmt: skip
        par = self.parallel
        entries: dict[tuple[str, torch.dtype, tuple[int, ...]], list[_Entry]] = {}
        first_seen: dict[tuple[str, torch.dtype, tuple[int, ...]], list[int]] = {}
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for position, (name, p) in enumerate(reversed(trainable)):  # the order the backward produces gradients
            expert = bool(getattr(p, "expert_parallel", False)) or id(p) in expert_ids
            sp_grad = bool(getattr(p, "sequence_parallel_grad", False))
            tp_dim = getattr(p, "tensor_parallel_dim", None)
            if expert and sp_grad:
                raise ValueError(f"{name}: an expert parameter cannot be tagged sequence_parallel_grad")
            if sp_grad and tp_dim is not None:
                raise ValueError(f"{name}: tagged both sequence_parallel_grad and tensor_parallel_dim={tp_dim}")
            if not p.is_contiguous():
                raise ValueError(f"{name}: ZeRO-1 needs contiguous parameters (it views them into flat buffers)")
            if p.is_floating_point() is False:
                raise ValueError(f"{name}: only floating-point parameters can be trained, got {p.dtype}")
            stages = stages_of.get(id(p), ())
            key = ("expert" if expert else "dense", p.dtype, stages)  # a bucket never mixes pipeline stages
            entries.setdefault(key, []).append(_Entry(name, p, expert, tp_dim is None and not expert, sp_grad, stages))
            first_seen.setdefault(key, []).append(position)

        # Buckets of every buffer, then one global order: by the backward position of each bucket's first
        # parameter, so that the launch order approximates the order buckets complete.
        pending: list[tuple[int, str, torch.dtype, list[_Entry]]] = []
        for key, es in entries.items():
            kind, dtype, _ = key
            group = par.expert_dp_group if kind == "expert" else par.dp_group
            size = 1 if group is None else dist.get_world_size(group)
            limit = self.zero.bucket_size or max(MEGATRON_MIN_BUCKET, 1_000_000 * size)
            current: list[_Entry] = []
            positions = first_seen[key]
            start_pos = positions[0]
            count = 0
            for e, pos in zip(es, positions):
                if not current:
                    start_pos = pos
                current.append(e)
                count += e.numel
                if count >= limit:
                    pending.append((start_pos, kind, dtype, current))
                    current, count = [], 0
            if current:
                pending.append((start_pos, kind, dtype, current))
        pending.sort(key=lambda item: item[0])

        buckets = []
        for index, (_, kind, dtype, es) in enumerate(pending):
            group = par.expert_dp_group if kind == "expert" else par.dp_group
            size = 1 if group is None else dist.get_world_size(group)
            rank = 0 if group is None else dist.get_rank(group)
            offset = 0
            for e in es:
                e.bucket, e.offset = index, offset
                offset += e.numel
            numel = -(-offset // size) * size
            params = torch.zeros(numel, dtype=dtype, device=es[0].param.device)
            with torch.no_grad():
                for e in es:  # the parameter's storage becomes a view into the bucket (Megatron's param buffer)
                    view = params[e.offset : e.offset + e.numel].view_as(e.param)
                    view.copy_(e.param)
                    e.param.data = view
            grad = torch.zeros(numel, dtype=torch.float32, device=params.device)
            buckets.append(_Bucket(index, kind, group, size, rank, dtype, es, numel, grad, params, es[0].stages))
        return buckets

    def _build_shards(self) -> None:
        for b in self.buckets:
            lo_shard, hi_shard = b.shard_start, b.shard_start + b.shard_size
            if b.dtype != torch.float32:
                b.master = b.shard(b.params).float()
            b.exp_avg = torch.zeros(b.shard_size, dtype=torch.float32, device=b.grad.device)
            b.exp_avg_sq = torch.zeros_like(b.exp_avg)
            for e in b.entries:
                lo, hi = max(e.offset, lo_shard), min(e.offset + e.numel, hi_shard)
                if lo >= hi:
                    continue
                seg = _Segment(e, lo - e.offset, hi - e.offset, lo - lo_shard)
                if b.master is None:
                    seg.master = e.param.detach().view(-1)[seg.lo : seg.hi]
                else:
                    seg.master = b.master[seg.shard_lo : seg.shard_lo + (hi - lo)]
                seg.master.grad = b.shard(b.grad)[seg.shard_lo : seg.shard_lo + (hi - lo)]
                b.segments.append(seg)

    def _init_adamw_state(self) -> None:
        """AdamW's per-slice state as views into the shard buffers (its single-tensor update is in place), so the
        moments are contiguous per bucket (`state_tensors` hands out one flat range per bucket and key)."""
        for b in self.buckets:
            for s in b.segments:
                n = s.hi - s.lo
                self.adamw.state[s.master] = {
                    "step": torch.tensor(float(self.steps), dtype=torch.float32),
                    "exp_avg": b.exp_avg[s.shard_lo : s.shard_lo + n],
                    "exp_avg_sq": b.exp_avg_sq[s.shard_lo : s.shard_lo + n],
                }

    def _check_same_layout(self) -> None:
        """Every rank of a reduction group (and of the TP group, whose SP gradients are summed shard by shard) must
        have built the same buckets; a mismatch would pair unrelated elements in the collectives."""
        for kind, groups in (("dense", (self.parallel.dp_group, self.parallel.tp_group)),
                             ("expert", (self.parallel.expert_dp_group,))):  # fmt: skip
            sig = repr([(e.name, tuple(e.param.shape), str(e.param.dtype), e.bucket, e.offset, e.sp_grad, e.stages)
                        for b in self.buckets if b.kind == kind for e in b.entries])  # fmt: skip
            value = int.from_bytes(hashlib.sha256(sig.encode()).digest()[:7], "little")
            for group in groups:
                if group is None:
                    continue
                mine = torch.tensor([value], dtype=torch.int64)
                both = torch.stack([mine, -mine]).view(-1)
                self._wait(dist.all_reduce(both, dist.ReduceOp.MAX, group=group, async_op=True), "layout check")
                if int(both[0]) != value or int(-both[1]) != value:
                    raise ValueError(
                        f"ZeRO-1: the ranks of a reduction group hold different {kind} parameters (names, shapes, "
                        "dtypes or tags differ), so their gradient buckets do not line up"
                    )

    # -- gradients

    def zero_grad(self) -> None:
        """Clears the gradient buckets and the reduction state (start of an optimizer step)."""
        for b in self.buckets:
            if b.work is not None:
                raise RuntimeError(f"ZeRO-1: zero_grad while the reduce-scatter of {b.describe()} is in flight")
            b.grad.zero_()
            b.ready.clear()
            b.launched = False
            for e in b.entries:
                e.param.grad = None
        self._next_launch = 0
        self._stages_done.clear()
        self._reduced = False
        self.events = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into the buckets (micro-batches before the last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def accumulation_context(self, micro_batch: int, num_micro_batches: int) -> contextlib.AbstractContextManager:
        """What the trainer wraps micro-batch `micro_batch` (0-based) of `num_micro_batches` in: `no_sync()` but
        for the last one."""
        return self.no_sync() if micro_batch < num_micro_batches - 1 else contextlib.nullcontext()

    def _grad_hook(self, entry: _Entry):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            b = self.buckets[entry.bucket]
            if b.launched:
                raise RuntimeError(
                    f"ZeRO-1: a gradient of {entry.name} arrived after the reduce-scatter of its {b.describe()} was "
                    "launched (run the micro-batches before the last under no_sync(), one backward each)"
                )
            b.grad[entry.offset : entry.offset + entry.numel].add_(grad.reshape(-1))
            param.grad = None  # accumulated in FP32 in the bucket
            if self._sync:
                b.ready.add(id(entry))
                if self.zero.overlap_grad_reduce and len(b.ready) == len(b.entries):
                    self._launch_in_order()

        return hook

    def _launch_in_order(self) -> None:
        """Launch the complete buckets that follow the last launched one (the global order is the same on every rank,
        so no rank's collectives cross another's)."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) != len(b.entries):
                return
            self._launch(b)
            self._next_launch += 1

    @torch.no_grad()
    def stage_grads_done(self, stage: int) -> None:
        """Pipeline stage `stage`'s gradients are final for this step (its last micro-batch's B or W action ran):
        with `overlap_grad_reduce`, launch now, in bucket order, every bucket whose stages are all done (see the
        module docstring). Called by the schedule, which runs under `no_sync()`."""
        if self._sync:
            raise RuntimeError("ZeRO-1: stage_grads_done() is for a pipeline schedule run under no_sync()")
        self.events.append(("stage_done", stage, time.perf_counter()))
        self._stages_done.add(stage)
        if not self.zero.overlap_grad_reduce:
            return
        ready = [b for b in self.buckets if not b.launched and b.stages and self._stages_done.issuperset(b.stages)]
        self._absorb_unhooked_grads(ready)
        for b in ready:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        self.events.append(("launch", b.index, time.perf_counter()))
        if b.group is not None:
            if dist.get_backend(b.group) == "gloo":  # gloo's reduce-scatter is an all-reduce underneath
                b.work = dist.all_reduce(b.grad, group=b.group, async_op=True)
            else:
                b.work = _reduce_scatter(b.shard(b.grad), b.grad, b.group)
        b.launched = True

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (in order), wait for every reduce-scatter, then sum the shards of the
        sequence-parallel gradients over the TP group. After it each rank's bucket shards hold the reduced
        gradient."""
        self.events.append(("grad_sync_start", -1, time.perf_counter()))
        self._absorb_unhooked_grads(self.buckets)
        for b in self.buckets:
            if not b.launched:  # the hooks launch a prefix of the buckets, a pipeline's stages any subset: in order
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                work, b.work = b.work, None
                self._wait(work, f"gradient reduce-scatter of {b.describe()}")
        sp = [b.shard(b.grad)[s.shard_lo : s.shard_lo + s.hi - s.lo]
              for b in self.buckets for s in b.segments if s.entry.sp_grad]  # fmt: skip
        if sp and self.parallel.tp_group is not None:
            flat = torch.cat(sp)
            self._wait(dist.all_reduce(flat, group=self.parallel.tp_group, async_op=True),
                       "sequence-parallel gradient all-reduce over the TP group")  # fmt: skip
            for view, part in zip(sp, flat.split([v.numel() for v in sp])):
                view.copy_(part)
        self._reduced = True
        self.events.append(("grad_sync_end", -1, time.perf_counter()))

    @torch.no_grad()
    def _absorb_unhooked_grads(self, buckets: list[_Bucket]) -> None:
        """Gradients of `buckets`' parameters that reached `param.grad` without autograd's accumulation (so without
        the hook): torch's pipeline schedules and `moe.layer.wgrad` add the weight-gradient (W) actions' results by
        hand. They join their buckets here; a bucket already launched must not receive any (RuntimeError, as in the
        hook)."""
        for b in buckets:
            for e in b.entries:
                grad = e.param.grad
                if grad is None:
                    continue
                if b.launched:
                    raise RuntimeError(f"ZeRO-1: a gradient of {e.name} arrived after its {b.describe()} was launched")
                b.grad[e.offset : e.offset + e.numel].add_(grad.reshape(-1))
                e.param.grad = None

    def reduce_gradients(self) -> None:
        """MasterAdamW's name for `finish_grad_sync`."""
        self.finish_grad_sync()

    @torch.no_grad()
    def global_grad_norm(self) -> float:
        """L2 norm of the reduced gradient of the whole model, every element counted once (see the module
        docstring); one float64 all-reduce over the world."""
        self._require_reduced("global_grad_norm")
        sq = torch.zeros(1, dtype=torch.float64)
        tp_rank = self.parallel.tp_rank
        for b in self.buckets:
            for s in b.segments:
                if s.entry.tp_replicated and tp_rank != 0:
                    continue
                sq += torch.linalg.vector_norm(s.master.grad, dtype=torch.float32).double() ** 2
        if self.parallel.layout.world > 1:
            self._wait(dist.all_reduce(sq, group=dist.group.WORLD, async_op=True), "global gradient norm all-reduce")
        return math.sqrt(float(sq))

    @torch.no_grad()
    def clip(self, norm: float) -> float:
        """Scale this rank's gradient shards by `clip_grad / norm` when the norm exceeds `clip_grad` (0 = never);
        returns the factor applied."""
        self._require_reduced("clip")
        factor = clip_factor(norm, self.config.clip_grad)
        if factor != 1.0:
            for b in self.buckets:
                b.shard(b.grad).mul_(factor)
        return factor

    # -- the step

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on this rank's shards, then the updated parameters all-gathered into every rank's model."""
        self._require_reduced("step")
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        self.steps += 1
        self._gather_params()
        self._reduced = False

    def _gather_params(self) -> None:
        works = []
        for b in self.buckets:
            if b.master is not None:  # FP32 buckets: the masters are the parameters' own storage
                b.shard(b.params).copy_(b.master)
            if b.group is None:
                continue
            # NCCL gathers in place (input = this rank's chunk of the output); gloo gets its own copy of the input.
            shard = b.shard(b.params)
            inp = shard.clone() if dist.get_backend(b.group) == "gloo" else shard
            works.append((b, _all_gather(b.params, inp, b.group)))
        for b, work in works:
            self._wait(work, f"parameter all-gather of {b.describe()}")

    # -- state for sharded checkpoints: this rank's shards as they are

    def state_tensors(self, *, create: bool = False) -> list[StateTensor]:
        """This rank's optimizer shards, live (views into the bucket shards): for every segment of a parameter in
        this rank's shards, `<name>.exp_avg` and `.exp_avg_sq` (once stepped, or with `create`) and `.master`
        (non-FP32 buckets), 1-D with `flat = (lo, hi)`: elements `[lo, hi)` of the parameter's local tensor."""
        out = []
        for b in self.buckets:
            flats = [("exp_avg", b.exp_avg), ("exp_avg_sq", b.exp_avg_sq)] if self.steps or create else []
            if b.master is not None:
                flats.append(("master", b.master))
            for s in b.segments:
                n = s.hi - s.lo
                for key, flat in flats:
                    view = flat[s.shard_lo : s.shard_lo + n]
                    out.append(StateTensor(f"{s.entry.name}.{key}", view, s.entry.param, s.entry.expert, (s.lo, s.hi)))
        return out

    def set_steps(self, steps: int) -> None:
        """Set the step count (AdamW's of every slice too) after a load."""
        self.steps = int(steps)
        for state in self.adamw.state.values():
            state["step"].fill_(float(self.steps))

    # -- measurements

    def state_bytes_per_rank(self) -> int:
        """Bytes of optimizer state on this rank: exp_avg, exp_avg_sq and the separate FP32 masters (non-FP32
        buckets) of its shards, padding included."""
        return sum(b.shard_size * 4 * (2 + (b.master is not None)) for b in self.buckets)

    def launch_times(self) -> list[tuple[int, float]]:
        """`(bucket index, perf_counter time)` of the reduce-scatter launches of the current step."""
        return [(i, t) for name, i, t in self.events if name == "launch"]

    # -- helpers

    def _require_reduced(self, what: str) -> None:
        if not self._reduced:
            raise RuntimeError(f"ZeRO-1: {what} before finish_grad_sync()/reduce_gradients() of this step")

    def _wait(self, work, phase: str) -> None:
        try:
            ok = work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            raise CollectiveTimeout(
                f"ZeRO-1 {phase} failed or timed out after {self.zero.timeout_s:g} s (a rank did not arrive?): {exc}"
            ) from exc
        if ok is False:
            raise CollectiveTimeout(f"ZeRO-1 {phase} did not complete within {self.zero.timeout_s:g} s")

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


# torch 2.13 renamed the flat collectives (`*_single`); older versions only have `*_tensor`.
def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=True)


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=True)


def _stages_of(stage_params: Mapping[int, Iterable[nn.Parameter]] | None) -> dict[int, tuple[int, ...]]:
    """`{id(parameter): the sorted stages holding it}` of `stage_params` (see `DistributedAdamW`)."""
    stages: dict[int, set[int]] = {}
    for stage, params in (stage_params or {}).items():
        for p in params:
            stages.setdefault(id(p), set()).add(int(stage))
    return {key: tuple(sorted(value)) for key, value in stages.items()}
