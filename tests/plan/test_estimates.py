"""Memory and step-time estimates: hand-computed model-state bytes, in-flight micro-batches per schedule, the
bubble against the DualPipe table, and the directions every term must move in."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe.trainer.models.deepseek_v3 import DeepseekV3Config, parameter_counts
from moe.trainer.pipeline.timeline import analytic_bubble
from moe.trainer.plan.comm_cost import expected_distinct, ring_time
from moe.trainer.plan.devices import CPU, H100
from moe.trainer.plan.memory_estimate import estimate_memory
from moe.trainer.plan.model_shape import ModelShape
from moe.trainer.plan.space import Candidate, Workload
from moe.trainer.plan.stage_placement import inflight, rank_chunks
from moe.trainer.plan.timing import chunk_times, estimate_time

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "configs"
TINY = DeepseekV3Config.from_toml(CONFIGS / "tiny.toml")
SHAPE = ModelShape.from_config(TINY)
WORK32 = Workload(global_batch=32, micro_batches=4, seq_len=128, dtype="float32")
WORK16 = Workload(global_batch=32, micro_batches=4, seq_len=128, dtype="bfloat16")


def counts():
    """(all parameters incl. MTP, router parameters, expert parameters) of tiny."""
    c = parameter_counts(TINY)
    moe_layers = sum(SHAPE.is_moe(i) for i in range(SHAPE.L + SHAPE.D))
    return c.total + c.mtp_total, moe_layers * SHAPE.E * SHAPE.H, moe_layers * SHAPE.E * 3 * SHAPE.H * SHAPE.Fm


def test_model_state_bytes_hand_computed():
    """moe/trainer/plan/memory_estimate.py's table: FP32 4 + 4 + 8 bytes; BF16 2 + (2 + 4) + (8 + 4) with an FP32 router
    (4, 4, 8); ZeRO-1 shards the optimizer over dp (dense) and edp (experts); EP splits the experts."""
    P, R, X = counts()
    one = Candidate(world=1, tp=1, pp=1, ep=1)
    m = estimate_memory(one, SHAPE, WORK32, CPU)
    assert (m.weights, m.grads, m.optimizer) == (4 * P, 4 * P, 8 * P)
    m = estimate_memory(one, SHAPE, WORK16, CPU)
    assert (m.weights, m.grads, m.optimizer) == (2 * (P - R) + 4 * R, 6 * (P - R) + 4 * R, 12 * (P - R) + 8 * R)
    zero = estimate_memory(Candidate(world=2, tp=1, pp=1, ep=1, zero1=True), SHAPE, WORK32, CPU)
    assert (zero.weights, zero.grads, zero.optimizer) == (4 * P, 4 * P, 4 * P)
    ep2 = estimate_memory(Candidate(world=2, tp=1, pp=1, ep=2, zero1=True), SHAPE, WORK32, CPU)
    local = P - X / 2  # half of the experts; edp = 1, so their optimizer state is not sharded
    assert ep2.weights == 4 * local
    assert ep2.optimizer == pytest.approx(8 * (P - X) / 2 + 8 * X / 2)
    assert ep2.comm_buffers > 0 and zero.comm_buffers == 0  # the mtdeepep buffer


def test_inflight_micro_batches_per_schedule():
    assert inflight(Candidate(1, 1, 1, 1), 0, 8) == [1.0]
    assert [inflight(Candidate(4, 1, 4, 1, schedule="1f1b"), r, 8) for r in range(4)] == [[4.0], [3.0], [2.0], [1.0]]
    assert inflight(Candidate(4, 1, 4, 1, schedule="1f1b"), 0, 2) == [2.0]  # never more than the micro-batches
    assert inflight(Candidate(2, 1, 2, 1, schedule="dualpipev", vpp=2), 0, 4) == [3.0, 2.0]  # PP + 1 = 2 pp + 1
    # interleaved (Megatron): 2 (pp - r - 1) + (v - 1) pp + 1 chunk-micro-batches, spread over the v chunks
    assert inflight(Candidate(2, 1, 2, 1, schedule="interleaved", vpp=2), 0, 4) == [2.5, 2.5]


def test_chunks_follow_the_trainer_placement():
    """DualPipeV: rank 0 holds the first and the last stage (embedding and head); 1F1B: one stage per rank."""
    v = rank_chunks(Candidate(2, 1, 2, 1, schedule="dualpipev", vpp=2), SHAPE.L)
    assert [c.stage for c in v[0]] == [0, 3] and v[0][0].first and v[0][1].last
    assert [c.layers for c in v[1]] == [(1,), (2,)]
    f = rank_chunks(Candidate(2, 1, 2, 1, schedule="1f1b"), SHAPE.L)
    assert [c.layers for cs in f for c in cs] == [(0, 1), (2, 3)] and f[1][0].last


def test_recompute_trades_memory_for_time():
    mems, times = [], []
    for rc in ("none", "selective", "selective+", "full"):
        cand = Candidate(world=1, tp=1, pp=1, ep=1, recompute=rc)
        mems.append(estimate_memory(cand, SHAPE, WORK32, CPU).activations)
        times.append(estimate_time(cand, SHAPE, WORK32, CPU))
    assert mems == sorted(mems, reverse=True) and len(set(mems)) == 4
    assert [t.compute for t in times] == sorted(t.compute for t in times) and times[0].recompute == 0


def test_bubble_is_the_dualpipe_table():
    for schedule, vpp in (("1f1b", 1), ("zbh1", 1), ("dualpipev", 2)):
        cand = Candidate(world=2, tp=1, pp=2, ep=1, schedule=schedule, vpp=vpp)
        t = estimate_time(cand, SHAPE, WORK32, CPU)
        per_rank = [[chunk_times(c, cand, SHAPE, WORK32, CPU) for c in cs] for cs in rank_chunks(cand, SHAPE.L)]
        # The bottleneck rank (the most work) waits for the other rank's chunks while the pipeline fills and drains.
        busy = [sum(x.F + x.B for x in ts) for ts in per_rank]
        other = per_rank[1 - busy.index(max(busy))]
        p2p = t.pp_comm / (WORK32.micro_batches * vpp * 2)
        F = sum(x.F for x in other) / len(other) + p2p
        B = sum(x.B for x in other) / len(other) + p2p
        W = sum(x.weight_grad for x in other) / len(other)
        assert t.bubble == pytest.approx(max(0.0, analytic_bubble(schedule, 2, F, B, min(W, B))))
    b1 = estimate_time(Candidate(2, 1, 2, 1, schedule="1f1b"), SHAPE, WORK32, CPU).bubble
    bz = estimate_time(Candidate(2, 1, 2, 1, schedule="zbh1"), SHAPE, WORK32, CPU).bubble
    assert 0 < bz < b1


def test_communication_terms_appear_with_their_parallelism():
    work = Workload(global_batch=64, micro_batches=4, seq_len=128, dtype="bfloat16")
    base = estimate_time(Candidate(8, 1, 1, 1), SHAPE, work, H100)
    assert base.tp_comm == base.ep_comm == base.pp_comm == 0 and base.bubble == 0
    tp = estimate_time(Candidate(8, 2, 1, 1), SHAPE, work, H100)
    ep = estimate_time(Candidate(8, 1, 1, 8), SHAPE, work, H100)
    ep_fp8 = estimate_time(Candidate(8, 1, 1, 8, fp8="blockwise"), SHAPE, work, H100)
    assert tp.tp_comm > 0 and ep.ep_comm > 0
    assert ep_fp8.ep_comm < ep.ep_comm  # FP8 rows: H + H/128 scales bytes instead of 2H
    zero = estimate_time(Candidate(8, 1, 1, 1, zero1=True), SHAPE, work, H100)
    assert zero.optimizer < base.optimizer  # each rank steps 1/dp of the state


def test_collective_helpers():
    assert expected_distinct(8, 8, 2) == pytest.approx(2.0)  # one expert per rank: two distinct ranks
    assert expected_distinct(1, 8, 2) == 1.0
    assert expected_distinct(2, 8, 8) == pytest.approx(2.0)  # every expert chosen: both ranks
    assert ring_time("all_reduce", 1e9, 1, 1, H100) == 0.0
    rs, ar = ring_time("reduce_scatter", 1e9, 8, 8, H100), ring_time("all_reduce", 1e9, 8, 8, H100)
    lat = H100.comm_latency_us * 1e-6
    assert ar - lat == pytest.approx(2 * (rs - lat))
    assert ring_time("all_gather", 1e9, 16, 16, H100) > ring_time("all_gather", 1e9, 16, 8, H100)  # off the node
    # gloo's reduce-scatter is an all-reduce (moe/trainer/train/zero.py)
    assert ring_time("reduce_scatter", 1e8, 2, 2, CPU) == ring_time("all_reduce", 1e8, 2, 2, CPU)


def test_fresh_memory_term_on_cpu():
    """The 'cpu' spec's page-fault term: every micro-batch touches its activations twice (forward outputs, their
    gradients) and its weight gradients once in fresh memory, at the machine-wide rate the ranks share."""
    from moe.trainer.plan.memory_estimate import rank_params

    cand = Candidate(world=1, tp=1, pp=1, ep=1)
    with_faults = estimate_time(cand, SHAPE, WORK32, CPU)
    without = estimate_time(cand, SHAPE, WORK32, CPU.replace(fresh_memory_gbps=None))
    tokens = cand.micro_rows(WORK32) * WORK32.seq_len
    chunk = rank_chunks(cand, SHAPE.L)[0][0]
    layers = list(chunk.layers) + [SHAPE.L + k for k in range(SHAPE.D)]
    act = sum(SHAPE.activation_bytes(i, dtype="float32", tp=1, recompute="none") for i in layers)
    p = rank_params(SHAPE, [chunk], cand)
    per_mb = (2 * tokens * act + 4 * (p.dense + p.experts) + 4 * p.router) / (CPU.fresh_memory_gbps * 1e9)
    assert with_faults.compute - without.compute == pytest.approx(WORK32.micro_batches * per_mb)
    assert CPU.fresh_bytes_per_s(2) == CPU.fresh_bytes_per_s(1) / 2  # shared by the ranks
    assert H100.fresh_bytes_per_s(8) is None  # a caching allocator: no page faults per micro-batch
