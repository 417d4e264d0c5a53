"""Step time of a layout: compute per micro-batch and chunk, the communication the trainer leaves exposed, the
pipeline bubble, the gradient reduction and the optimizer.

Per chunk and micro-batch on one rank (its micro-batch of `rows * seq_len` tokens; TP ranks each do 1/tp of the
work, sequence-parallel parts included):
    F  forward: GEMMs at the dtype's rate (FP8 rate for the Linear GEMMs under an FP8 recipe; the head and the
       attention core stay in the model dtype, the router in FP32), a roofline against reading the chunk's weights,
       the causal attention core at `ATTENTION_EFFICIENCY` of the GEMM rate, element-wise traffic
       (`ELEMENTWISE_PASSES_FWD` x the activation bytes through memory), plus the exposed TP collectives (sequence
       parallel all-gathers / reduce-scatters) and EP dispatch + combine (FP8 rows under an FP8 recipe, FP32
       combine as the 'flex' dispatcher does) over the folded EP x ETP group. Under expert tensor parallelism
       (etp > 1) a rank's expert shards receive etp x the rows at 1/etp of the FFN width each
       (`expert_gemm_flops`), every token goes to the etp shards of each of its experts' ranks (up to etp x the
       dispatch and combine rows, `moe.trainer.plan.comm_cost.dispatch_destinations`), and the combine's sum adds the
       etp partial down-projections: no all-reduce.
    B  backward: 2x the GEMMs (input and weight gradients), 2.5x the attention core, `ELEMENTWISE_PASSES_BWD` x
       the activation bytes, the mirrored TP / EP communication, plus the recompute (selective: the core attention;
       selective+: also the MLA up projections, norms and SwiGLU; full: the whole forward, communication included).
    W  the weight-gradient share of B (ZB-H1 and DualPipeV defer it into the bubbles).
The trainer runs communication and compute of one rank in sequence (no overlap), so TP and EP time counts in full.
On a device spec with `fresh_memory_gbps` (the 'cpu' one: glibc maps large tensors afresh and this VM's page faults
are slow, ~0.7 GB/s per core) every micro-batch also pays for touching its new memory: the activations in the
forward, their gradients and the weight gradients (one per weight, in the GEMM's output) in the backward.

Step on the bottleneck pipeline rank: `m x sum over its chunks of (F + B)` + the p2p sends + the bubble of
`moe.trainer.pipeline.timeline.analytic_bubble` (DualPipe's table: 1F1B (P-1)(F+B), ZB-H1 (P-1)(F+B-2W), DualPipeV
(P-1)(F&B+B-3W) with F&B = F+B, no overlap) with the mean chunk times of the other ranks (what the bottleneck
waits for while the pipeline fills and drains); interleaved 1F1B: (P-1)(F+B) of such a chunk.
Then the gradient reduction (MasterAdamW: all-reduces after the backward; ZeRO-1: bucketed reduce-scatters
overlapped with the last micro-batch's backward when there is no pipeline, then the parameter all-gather; the
expert gradients, 1/(ep * etp) of the experts per rank, over the edp = dp * tp / (ep * etp) ranks) and the
optimizer (memory bound).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from moe.trainer.pipeline.timeline import analytic_bubble
from moe.trainer.plan.comm_cost import all_to_all_time, intra_node, p2p_time, ring_time
from moe.trainer.plan.devices import DeviceSpec
from moe.trainer.plan.framework import THIS_TRAINER, Framework
from moe.trainer.plan.memory_estimate import rank_params
from moe.trainer.plan.model_shape import DTYPE_BYTES, FP32, RECOMPUTE_CHOICES, ModelShape
from moe.trainer.plan.space import Candidate, Workload
from moe.trainer.plan.stage_placement import Chunk, distinct_ranks, rank_chunks

ATTENTION_EFFICIENCY = 0.6  # estimate: fused causal attention vs a large GEMM (FlashAttention-2/3 reach ~0.5-0.75)
ELEMENTWISE_PASSES_FWD = 2.0  # estimate: every kept tensor written once, and one more read+write in between
ELEMENTWISE_PASSES_BWD = 4.0  # estimate: read the kept tensor, write and read its gradient, accumulate
OPTIMIZER_BYTES_PER_PARAM = 28  # AdamW: read grad, read+write master, exp_avg, exp_avg_sq (FP32)


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds of one optimizer step on the bottleneck rank. `compute` includes `recompute`; the *_comm fields are
    exposed communication; `bubble` the pipeline's idle time. `gemm` and `attention`: the shares of `compute`
    (recompute excluded) spent in the GEMMs (weights-read roofline included) and in the attention core; the rest of
    `compute - recompute` is element-wise work."""

    compute: float
    recompute: float
    tp_comm: float
    ep_comm: float
    pp_comm: float
    dp_comm: float
    optimizer: float
    bubble: float
    gemm: float = 0.0
    attention: float = 0.0

    @property
    def exposed_comm(self) -> float:
        return self.tp_comm + self.ep_comm + self.pp_comm + self.dp_comm

    @property
    def step(self) -> float:
        return self.compute + self.exposed_comm + self.optimizer + self.bubble

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(exposed_comm=self.exposed_comm, step=self.step)
        return out


@dataclass(frozen=True)
class ChunkTimes:
    """One micro-batch through one chunk: compute and communication of F and B, recompute, W."""

    fwd: float
    bwd: float
    recompute: float
    weight_grad: float
    tp_fwd: float
    tp_bwd: float
    ep_fwd: float
    ep_bwd: float
    gemm: float = 0.0
    attention: float = 0.0

    @property
    def F(self) -> float:
        return self.fwd + self.tp_fwd + self.ep_fwd

    @property
    def B(self) -> float:
        return self.bwd + self.recompute + self.tp_bwd + self.ep_bwd


def chunk_times(
    chunk: Chunk,
    cand: Candidate,
    shape: ModelShape,
    work: Workload,
    spec: DeviceSpec,
    framework: Framework = THIS_TRAINER,
) -> ChunkTimes:
    b = DTYPE_BYTES[work.dtype]
    tokens = cand.micro_rows(work) * work.seq_len
    t_rank = tokens / cand.tp  # each TP rank's share of the work
    world = cand.world
    rate = spec.gemm_flops(work.dtype, world)
    linear_rate = spec.gemm_flops("fp8", world) if cand.fp8 != "none" else rate
    fp32_rate = spec.gemm_flops("float32", world)
    mem_bw = spec.memory_bytes_per_s(world)
    n_dense, n_moe, _, _ = chunk.signature(shape.first_dense)
    layers = [0] * n_dense + [shape.L] * n_moe + ([shape.L + k for k in range(shape.D)] if chunk.last else [])
    modules = set(RECOMPUTE_CHOICES[cand.recompute].get("modules", ()))

    linear = experts = core = router = head = up = 0.0  # forward FLOPs per token
    act_bytes = 0.0  # per token, what the element-wise passes move
    for i in layers:
        proj, c = shape.attention_flops(work.seq_len)
        ffn = shape.ffn_flops(i)
        linear += proj + ffn["gemm"]
        if shape.is_moe(i):  # the model's count has K whole experts per token; price this rank's shards instead
            linear -= shape.K * shape.expert_row_flops()
            experts += expert_gemm_flops(cand, shape)
        core += c
        router += ffn["router"]
        up += 2.0 * ((shape.Q or 0) * shape.N * shape.Dq + shape.C * shape.N * (shape.Dn + shape.Dv))
        act_bytes += shape.activation_bytes(i, dtype=work.dtype, tp=1, recompute="none", etp=cand.etp)
    if chunk.last:
        head = shape.head_flops() * (1 + shape.D)
        linear += shape.D * shape.mtp_extra_flops()
    p = rank_params(shape, [chunk], cand)
    weight_bytes = (p.dense + p.experts) * b + p.router * FP32

    # The grouped expert GEMM's rows per local expert shard: every rank of the ep x etp group routes its t_rank
    # tokens to K experts, and each shard of an expert gets all of that expert's rows.
    rows = cand.ep * cand.etp * t_rank * shape.K / shape.E
    expert_rate = spec.grouped_gemm_flops("fp8" if cand.fp8 != "none" else work.dtype, world, rows)
    gemm_fwd = t_rank * (linear / linear_rate + experts / expert_rate + head / rate + router / fp32_rate)
    core_fwd = t_rank * core / spec.attention_flops_per_s(work.dtype, world, ATTENTION_EFFICIENCY)
    elem = t_rank * act_bytes / mem_bw
    gemm_f = max(gemm_fwd, weight_bytes / mem_bw)
    gemm_b = max(2 * gemm_fwd, (2 * b + 2 * FP32) * (p.dense + p.experts) / mem_bw)
    fwd = gemm_f + core_fwd + ELEMENTWISE_PASSES_FWD * elem
    bwd = gemm_b + 2.5 * core_fwd
    bwd += ELEMENTWISE_PASSES_BWD * elem
    fresh = spec.fresh_bytes_per_s(world)
    if fresh is not None:  # page faults of what a micro-batch allocates afresh (see the module docstring)
        fwd += t_rank * act_bytes / fresh
        bwd += (t_rank * act_bytes + weight_bytes) / fresh

    tp_fwd = _tp_comm(chunk, layers, cand, shape, tokens, b, spec)
    ep_fwd, ep_bwd = _ep_comm(layers, cand, shape, tokens, b, spec, framework)
    if cand.recompute == "full":
        recompute = fwd
        tp_bwd, ep_bwd = 2 * tp_fwd, ep_bwd + ep_fwd  # the recomputed forward communicates again
    else:
        recompute = 0.0
        if "core_attn" in modules:
            recompute += core_fwd
        if "mla_up_proj" in modules:
            recompute += t_rank * up / linear_rate
        if "layernorm" in modules or "moe_act" in modules:
            recompute += 0.3 * ELEMENTWISE_PASSES_FWD * elem + (t_rank * router / fp32_rate) * ("moe_act" in modules)
        tp_bwd = tp_fwd
    return ChunkTimes(fwd, bwd, recompute, gemm_fwd, tp_fwd, tp_bwd, ep_fwd, ep_bwd, gemm_f + gemm_b, 3.5 * core_fwd)


def expert_gemm_flops(cand: Candidate, shape: ModelShape) -> float:
    """Forward FLOPs of one rank's routed expert shards in one MoE layer, per token the rank routes.

    The folded EP x ETP group of `ep * etp` ranks routes `K` experts per token, and each (token, expert) pair is
    computed by the `etp` ranks holding a shard of the expert, so a rank receives `K * etp` rows per routed token
    (balanced routing) of `6 H Fm / etp` FLOPs each (`ModelShape.expert_rows`, `expert_row_flops`): ETP does not
    change a rank's expert FLOPs, it narrows its GEMMs (priced at the same rate) and multiplies its rows, which the
    dispatch / combine volume (`moe.trainer.plan.comm_cost.all_to_all_time`) and the kept activations pay for."""
    return shape.expert_rows(cand.etp) * shape.expert_row_flops(cand.etp)


def _tp_comm(chunk: Chunk, layers: list[int], cand: Candidate, shape: ModelShape, tokens: int, b: int, spec) -> float:
    """Forward TP (sequence-parallel) collectives of one micro-batch through a chunk; the backward mirrors them."""
    if cand.tp == 1:
        return 0.0
    tp = cand.tp

    def coll(kind: str, width: float) -> float:
        return ring_time(kind, tokens * width * b, tp, tp, spec)

    t = 0.0
    for i in layers:
        t += coll("all_gather", shape.q_in + shape.C + shape.Dr) + coll("reduce_scatter", shape.H)  # MLA
        if not shape.is_moe(i):
            t += coll("all_gather", shape.H) + coll("reduce_scatter", shape.H)  # dense MLP
    if chunk.first:
        t += coll("reduce_scatter", shape.H)  # the vocab-parallel embedding's partial sums
    if chunk.last:
        heads = 1 + shape.D
        t += heads * coll("all_gather", shape.H) + shape.D * 2 * coll("all_gather", shape.H)  # head input, MTP reshard
        t += heads * 3 * ring_time("all_reduce", tokens * FP32, tp, tp, spec)  # vocab-parallel cross entropy
    return t


def _ep_comm(
    layers: list[int], cand: Candidate, shape: ModelShape, tokens: int, b: int, spec, framework: Framework
) -> tuple[float, float]:
    """`(forward, backward)` seconds of the dispatches and combines of one micro-batch through a chunk's MoE layers,
    over the folded EP x ETP group (none when it is one rank), with the framework's dispatcher."""
    if cand.ep * cand.etp == 1:
        return 0.0, 0.0
    moe_layers = sum(shape.is_moe(i) for i in layers)
    local = tokens / cand.tp  # under sequence parallelism every TP rank routes its own positions
    dispatch_row = shape.H + shape.H / 128 * FP32 if cand.fp8 != "none" else shape.H * b
    combine_row = shape.H * (FP32 if framework.combine_fp32 else b)  # 'flex' combines in FP32
    per_expert = framework.dispatcher == "alltoall"

    def a2a(row: float) -> float:
        return all_to_all_time(local, row, cand.ep, cand.etp, shape.E, shape.K, spec, per_expert=per_expert)

    fwd = moe_layers * (a2a(dispatch_row) + a2a(combine_row))
    bwd = moe_layers * (a2a(shape.H * b) + a2a(combine_row))
    return fwd, bwd


def estimate_time(
    cand: Candidate, shape: ModelShape, work: Workload, spec: DeviceSpec, framework: Framework = THIS_TRAINER
) -> TimeBreakdown:
    """The step time on the bottleneck pipeline rank (see the module docstring)."""
    m = work.micro_batches
    b = DTYPE_BYTES[work.dtype]
    tokens = cand.micro_rows(work) * work.seq_len
    chunks_by_rank = [chunks for _, chunks in distinct_ranks(cand, shape.L, shape.first_dense)]
    p2p_bytes = tokens / cand.tp * shape.H * b * (1 + (shape.D > 0))  # h, and the embedding for the MTP depths
    p2p = p2p_time(p2p_bytes, intra_node(cand.dp * cand.tp * 2, spec), spec) if cand.pp > 1 else 0.0

    per_rank = [[chunk_times(c, cand, shape, work, spec, framework) for c in chunks] for chunks in chunks_by_rank]

    def busy(times: list[ChunkTimes]) -> float:
        return m * sum(t.F + t.B for t in times) + m * len(times) * 2 * p2p

    times = max(per_rank, key=busy)
    compute = m * sum(t.fwd + t.bwd + t.recompute for t in times)
    recompute = m * sum(t.recompute for t in times)
    tp_comm = m * sum(t.tp_fwd + t.tp_bwd for t in times)
    ep_comm = m * sum(t.ep_fwd + t.ep_bwd for t in times)
    pp_comm = m * len(times) * 2 * p2p

    bubble = 0.0
    if cand.pp > 1:
        # Every rank's chunk times (ranks with the same chunks share one estimate).
        estimated = {_signature(chunks, shape): t for chunks, t in zip(chunks_by_rank, per_rank)}
        every_rank = [estimated[_signature(chunks, shape)] for chunks in rank_chunks(cand, shape.L)]
        F, B, W = _upstream_chunk(every_rank, times)
        F, B = F + p2p, B + p2p
        if cand.schedule == "interleaved":
            bubble = (cand.pp - 1) * (F + B)
        else:
            bubble = max(0.0, analytic_bubble(cand.schedule, cand.pp, F, B, min(W, B)))

    overlap = sum(t.B for t in times) if framework.overlap_grad_reduce else 0.0
    dp_comm = _dp_comm(cand, shape, chunks_by_rank, work, spec, last_backward=overlap)
    optimizer = _optimizer_time(cand, shape, chunks_by_rank, work, spec, framework)
    gemm = m * sum(t.gemm for t in times)
    attention = m * sum(t.attention for t in times)
    return TimeBreakdown(compute, recompute, tp_comm, ep_comm, pp_comm, dp_comm, optimizer, bubble, gemm, attention)


def _signature(chunks, shape: ModelShape) -> tuple:
    return tuple(c.signature(shape.first_dense) for c in chunks)


def _upstream_chunk(every_rank: list[list[ChunkTimes]], bottleneck: list[ChunkTimes]) -> tuple[float, float, float]:
    """`(F, B, W)` of the chunks the bottleneck rank waits for: the mean over the other ranks' chunks (`every_rank`:
    per pipeline rank, its chunks' times; `bottleneck`: the bottleneck rank's entry in it).

    The bottleneck rank idles while the pipeline fills and drains through the other ranks' stages, so its bubble is
    made of their chunk times, not its own (DualPipe's table assumes equal stages, where the two are the same). With
    a heavy last stage (head, MTP) the slowest chunk's times would count that stage's extra work as idle time too:
    measured on the CPU, the PP2 runs of bench/plan_check.py step in about the bottleneck's busy time alone."""
    index = next(i for i, ts in enumerate(every_rank) if ts is bottleneck)
    others = [t for ts in every_rank[:index] + every_rank[index + 1 :] for t in ts] or bottleneck
    n = len(others)
    return (sum(t.F for t in others) / n, sum(t.B for t in others) / n, sum(t.weight_grad for t in others) / n)


def _dp_comm(cand, shape, chunks_by_rank, work, spec, last_backward: float) -> float:
    """Exposed seconds of the gradient reduction and (ZeRO-1) the parameter all-gather, on the rank that has most."""
    b = DTYPE_BYTES[work.dtype]
    worst = 0.0
    block = cand.dp * cand.tp
    for chunks in chunks_by_rank:
        p = rank_params(shape, chunks, cand)
        dense, experts = (p.dense + p.router) * FP32, p.experts * FP32
        # Sequence-parallel gradients of the TP-replicated parameters: summed over the TP group.
        replicated = sum(shape.layer_params(i).replicated for c in chunks for i in c.layers) * FP32
        t_sp = ring_time("all_reduce", replicated, cand.tp, cand.tp, spec)
        if not cand.zero1:
            t = ring_time("all_reduce", dense, cand.dp, block, spec) + ring_time("all_reduce", experts, cand.edp,
                                                                                  block, spec) + t_sp  # fmt: skip
        else:
            rs = ring_time("reduce_scatter", dense, cand.dp, block, spec)
            rs += ring_time("reduce_scatter", experts, cand.edp, block, spec) + t_sp
            if cand.pp == 1:  # bucket reduce-scatters overlap the last micro-batch's backward
                rs = max(0.0, rs - last_backward)
            ag = ring_time("all_gather", dense / FP32 * b, cand.dp, block, spec)
            ag += ring_time("all_gather", experts / FP32 * b, cand.edp, block, spec)
            t = rs + ag
        worst = max(worst, t)
    small = 4 * spec.comm_latency_us * 1e-6 if cand.world > 1 else 0.0  # loss sums, counts, expert loads, norm
    return worst + small


def _optimizer_time(cand, shape, chunks_by_rank, work, spec, framework: Framework = THIS_TRAINER) -> float:
    """Seconds of the optimizer step on the rank with most: the bytes per local (sharded) parameter AdamW moves,
    plus the framework's own per-step passes (`Framework.step_bytes_per_param`: every local gradient zeroed, ...)."""
    bw = spec.memory_bytes_per_s(cand.world)
    worst = 0.0
    for chunks in chunks_by_rank:
        p = rank_params(shape, chunks, cand)
        if cand.zero1:
            local = (p.dense + p.router) / cand.dp + p.experts / cand.edp
        else:
            local = p.total
        step_bytes = local * (OPTIMIZER_BYTES_PER_PARAM + framework.shard_bytes_per_param)
        step_bytes += (p.total if cand.zero1 else local) * framework.buffer_bytes_per_param
        worst = max(worst, step_bytes / bw)
    return worst
