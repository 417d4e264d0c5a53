"""Peak memory of one rank for a layout: model state, activations of the micro-batches in flight, transients.

Accounting of this trainer (moe/trainer/train/optim.py, moe/trainer/train/zero.py), per local parameter, b = model dtype
bytes:

    state                    weights   gradients                  optimizer (AdamW)
    MasterAdamW, FP32        4         4                          8 (moments; the parameter is its own master)
    MasterAdamW, BF16        2         2 + 4 (FP32 master grad)   8 + 4 (FP32 master)
    ZeRO-1 (DistributedAdamW) b        4 (FP32 bucket)            (8 + 4 if BF16) / shard group
The FP32 router weight counts 4 bytes whatever the model dtype (its own master). ZeRO-1 shards the dense state over
the dp ranks and the expert state over the edp ranks. Without ZeRO-1 the gradient reduction concatenates each
group's gradients into one FP32 buffer after the backward (a transient of their size).

Activations: `ModelShape.stage_activation_bytes` per token of a micro-batch, times the micro-batch's tokens, times
the micro-batches each chunk holds at the schedule's peak (`moe.trainer.plan.stage_placement.inflight`). Under expert
tensor parallelism a rank keeps etp x the expert rows (each 1/etp of the FFN wide): `ModelShape.activation_bytes`. FP8
recipes also keep an FP8 copy of every GEMM weight per micro-batch in flight (the autograd context holds it for the
backward).

Expert parameters, gradients and optimizer state: 1/(ep * etp) of every MoE layer's routed experts per rank (each
rank holds E/ep experts' shards of Fm/etp columns), reduced and ZeRO-sharded over edp = dp * tp / (ep * etp).

Transients at the backward's peak: one layer's activation gradients (the largest layer of the rank) and, on the
rank with the head, the FP32 logits gradient (twice: the softmax's and the cross entropy's). After the backward
(activations freed), the gradient reduction's own buffers may be the peak instead: MasterAdamW's concatenated
gradients, or ZeRO-1's parameter all-gathers (the shard copies, plus `DeviceSpec.all_gather_extra` of the gathered
bytes that gloo allocates inside the collective). The process baseline
(`DeviceSpec.runtime_gib`) and the allocator's share (`allocator_overhead` of the dynamic memory) complete it; the
mtdeepep buffer (`moe.layer.dispatcher.flex.nvl_bytes_hint` over the ep * etp ranks of the dispatch) counts when that
group is more than one rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from moe.layer.dispatcher.flex import nvl_bytes_hint
from moe.trainer.plan.devices import DeviceSpec
from moe.trainer.plan.framework import THIS_TRAINER, Framework
from moe.trainer.plan.model_shape import DTYPE_BYTES, FP32, RECOMPUTE_CHOICES, ModelShape
from moe.trainer.plan.space import Candidate, Workload
from moe.trainer.plan.stage_placement import Chunk, distinct_ranks, inflight, rank_chunks

GIB = 2**30


@dataclass(frozen=True)
class LocalParams:
    """Parameters one rank holds: `dense` (model dtype, reduced over dp), `router` (FP32, over dp), `experts` (model
    dtype, over edp), and `linear` (those that are GEMM weights, for the FP8 copies)."""

    dense: float
    router: float
    experts: float
    linear: float

    @property
    def total(self) -> float:
        return self.dense + self.router + self.experts


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes at the peak of the worst pipeline rank (`pp_rank`). `inflight`: micro-batch chunks it holds."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    comm_buffers: float
    runtime: float
    allocator: float
    pp_rank: int = 0
    inflight: float = 1.0

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.activations + self.transient + self.comm_buffers
                + self.runtime + self.allocator)  # fmt: skip

    @property
    def allocated(self) -> float:
        """The tensors alone: what torch.cuda.max_memory_allocated counts (no process runtime, no allocator
        caching; the mtdeepep buffer excluded too, as runs without it report)."""
        return self.weights + self.grads + self.optimizer + self.activations + self.transient

    def gib(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) / GIB for f in fields(self) if f.name not in ("pp_rank", "inflight")}
        out["total"] = self.total / GIB
        out["allocated"] = self.allocated / GIB
        return out


def chunk_params(shape: ModelShape, chunk: Chunk, cand: Candidate) -> LocalParams:
    """This rank's share of a chunk's parameters (TP-sharded weights / tp, experts / (ep * etp))."""
    return _chunk_params(shape, chunk, cand.tp, cand.ep * cand.etp)


def _chunk_params(shape: ModelShape, chunk: Chunk, tp: int, expert_split: int) -> LocalParams:
    return _params_of(shape, chunk.signature(shape.first_dense), tp, expert_split)


@functools.cache
def _params_of(shape: ModelShape, signature: tuple, tp: int, expert_split: int) -> LocalParams:
    n_dense, n_moe, first, last = signature
    dense = router = experts = linear = 0.0
    layers = [0] * n_dense + [shape.L] * n_moe + ([shape.L + k for k in range(shape.D)] if last else [])
    for i in layers:
        p = shape.layer_params(i)
        dense += p.tp_sharded / tp + p.replicated
        router += p.router
        experts += p.experts / expert_split
        norms = 2 * shape.H + shape.C + (shape.Q or 0)
        linear += p.tp_sharded / tp + p.replicated - norms + p.experts / expert_split
    if last:
        dense += shape.D * shape.mtp_extra_params() + shape.H + shape.head_params() / tp
        linear += shape.D * 2 * shape.H * shape.H
    if first:
        dense += shape.embedding_params() / tp
    return LocalParams(dense, router, experts, linear)


def rank_params(shape: ModelShape, chunks: list[Chunk], cand: Candidate) -> LocalParams:
    parts = [chunk_params(shape, c, cand) for c in chunks]
    total = LocalParams(*(sum(getattr(p, f.name) for p in parts) for f in fields(LocalParams)))
    if shape.tied and any(c.last for c in chunks) and not any(c.first for c in chunks):
        # a tied head on a rank without the embedding holds its own copy (train.py refuses it; counted anyway)
        total = LocalParams(total.dense + shape.embedding_params() / cand.tp, total.router, total.experts, total.linear)
    return total


def _chunk_activation(shape: ModelShape, chunk: Chunk, dtype: str, cand: Candidate) -> float:
    return _activation_of(shape, chunk.signature(shape.first_dense), dtype, cand.tp, cand.recompute, cand.fp8,
                          cand.etp)  # fmt: skip


@functools.cache
def _activation_of(
    shape: ModelShape, signature: tuple, dtype: str, tp: int, recompute: str, fp8: str, etp: int
) -> float:
    n_dense, n_moe, first, last = signature
    layers = [0] * n_dense + [shape.L] * n_moe
    return shape.stage_activation_bytes(layers, first=first, last=last, dtype=dtype, tp=tp, recompute=recompute,
                                        fp8=fp8, etp=etp)  # fmt: skip


@functools.cache
def ep_buffer_bytes(hidden: int, group: int) -> float:
    """The mtdeepep normal-mode buffer the 'flex' dispatcher asks for over a dispatch group of `group` ranks (the
    folded EP x ETP group, ep * etp; 0 for one rank)."""
    if group <= 1:
        return 0.0
    return float(nvl_bytes_hint(hidden, group))


def estimate_memory(
    cand: Candidate, shape: ModelShape, work: Workload, spec: DeviceSpec, framework: Framework = THIS_TRAINER
) -> MemoryBreakdown:
    """Peak bytes of the worst pipeline rank (see the module docstring)."""
    best: MemoryBreakdown | None = None
    for r, chunks in distinct_ranks(cand, shape.L, shape.first_dense):
        mem = rank_memory(cand, shape, work, spec, r, chunks, framework)
        if best is None or mem.total > best.total:
            best = mem
    return best


def memory_by_stage(
    cand: Candidate, shape: ModelShape, work: Workload, spec: DeviceSpec, framework: Framework = THIS_TRAINER
) -> list[MemoryBreakdown]:
    """Peak bytes of every pipeline rank, in rank order (one entry without a pipeline)."""
    return [rank_memory(cand, shape, work, spec, r, chunks, framework)
            for r, chunks in enumerate(rank_chunks(cand, shape.L))]  # fmt: skip


def _framework_savings(cand: Candidate, shape: ModelShape, chunks: list[Chunk], b: int, framework: Framework):
    """`(activation bytes per token, transient bytes per token)` another framework's fused kernels do not keep
    (`moe.trainer.plan.framework.Framework`): the FP32 log-softmax and logits gradients of an unfused cross entropy (the
    fused one keeps its logits gradient in the model dtype instead), the FP32 copies of the RMSNorm inputs."""
    activations = transient = 0.0
    if framework.fused_cross_entropy and any(c.last for c in chunks):
        heads = 1 + shape.D
        activations += heads * shape.V * FP32 / cand.tp - shape.V * b / cand.tp
        transient += 2 * shape.V * FP32 / cand.tp
    if framework.fused_norms and b != FP32 and cand.recompute != "full":
        modules = set(RECOMPUTE_CHOICES[cand.recompute].get("modules", ()))
        if "layernorm" not in modules:
            layers = sum(len(c.layers) for c in chunks)
            latent = (shape.Q or 0) + shape.C if cand.tp == 1 else 0
            activations += layers * ((2 * shape.H) / cand.tp + latent) * FP32
    return activations, transient


def rank_memory(
    cand: Candidate,
    shape: ModelShape,
    work: Workload,
    spec: DeviceSpec,
    r: int,
    chunks: list[Chunk],
    framework: Framework = THIS_TRAINER,
) -> MemoryBreakdown:
    """Peak bytes of pipeline rank `r`, which holds `chunks` (see the module docstring)."""
    b = DTYPE_BYTES[work.dtype]
    tokens = cand.micro_rows(work) * work.seq_len
    p = rank_params(shape, chunks, cand)
    low = b != FP32  # BF16 parameters get FP32 masters
    weights = (p.dense + p.experts) * b + p.router * FP32
    if cand.zero1:
        grads = p.total * FP32
        per = 8 + 4 * low
        optimizer = (p.dense * per + p.router * 8) / cand.dp + p.experts * per / cand.edp
    else:
        grads = (p.dense + p.experts) * (b + FP32 * low) + p.router * FP32
        optimizer = (p.dense + p.experts) * (8 + 4 * low) + p.router * 8
    counts = inflight(cand, r, work.micro_batches)
    per_chunk = [_chunk_activation(shape, c, work.dtype, cand) * tokens for c in chunks]
    activations = sum(n * a for n, a in zip(counts, per_chunk))
    saved_act, saved_transient = _framework_savings(cand, shape, chunks, b, framework)
    activations -= saved_act * tokens * sum(counts) / len(counts)
    if cand.fp8 != "none":
        activations += sum(counts) / len(counts) * p.linear * 1.0
    kinds = {shape.is_moe(i) for c in chunks for i in c.layers}
    layer_peak = max((shape.activation_bytes(shape.L if moe else 0, dtype=work.dtype, tp=cand.tp, recompute="none",
                                             etp=cand.etp) for moe in kinds), default=0.0)  # fmt: skip
    transient = layer_peak * tokens
    if any(c.last for c in chunks):
        transient += 2 * tokens * shape.V / cand.tp * FP32
    transient -= saved_transient * tokens
    if not cand.zero1:  # the post-backward concatenation of one group's gradients (activations freed by then)
        flat = max(p.dense * FP32 if cand.dp * cand.tp > 1 else 0.0, p.experts * FP32 if cand.edp > 1 else 0.0)
        transient = max(transient, flat - activations)
    else:  # after the step: every bucket's parameter all-gather in flight (the shard copy, the backend's buffers)
        gathered = (p.dense * b if cand.dp > 1 else 0.0) + (p.experts * b if cand.edp > 1 else 0.0)
        copies = (p.dense * b / cand.dp if cand.dp > 1 else 0.0) + (p.experts * b / cand.edp if cand.edp > 1 else 0)
        transient = max(transient, gathered * spec.all_gather_extra + copies - activations)
    dynamic = activations + transient
    mem = MemoryBreakdown(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        transient=transient,
        comm_buffers=ep_buffer_bytes(shape.H, cand.ep * cand.etp),
        runtime=spec.runtime_gib * GIB,
        allocator=spec.allocator_overhead * dynamic,
        pp_rank=r,
        inflight=sum(counts),
    )
    return mem
