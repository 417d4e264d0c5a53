"""Expert tensor parallelism in the planner: its two rules, how it prices a rank's expert work, dispatch traffic,
memory and buffer when etp doubles, and a model with wide experts where the search puts an ETP layout first."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from moe.layer.dispatcher.flex import nvl_bytes_hint
from moe.trainer.models.deepseek_v3 import DeepseekV3Config
from moe.trainer.plan import report
from moe.trainer.plan.comm_cost import all_to_all_time, dispatch_destinations
from moe.trainer.plan.devices import CPU, H100
from moe.trainer.plan.memory_estimate import estimate_memory, rank_params
from moe.trainer.plan.model_shape import ModelShape
from moe.trainer.plan.search import estimate, plan
from moe.trainer.plan.space import Candidate, Workload, enumerate_candidates
from moe.trainer.plan.stage_placement import rank_chunks
from moe.trainer.plan.timing import chunk_times, expert_gemm_flops

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "configs"
TINY = DeepseekV3Config.from_toml(CONFIGS / "tiny.toml")
SHAPE = ModelShape.from_config(TINY)
WORK16 = Workload(global_batch=64, micro_batches=4, seq_len=128, dtype="bfloat16")


def test_etp_rules():
    """etp must divide moe_intermediate_size (128: etp 3 of 6 ranks cannot), and under block-wise FP8 every shard
    must hold whole 128-wide tiles (128 / 2 = 64 cannot; 256 / 2 = 128 can; per-tensor scaling has no tiles).
    Without ETP nothing changes for FP8."""
    work = Workload(global_batch=48, micro_batches=4, seq_len=128, dtype="bfloat16")
    space = enumerate_candidates(TINY, work, 6, H100)
    assert space.rejected["etp_ffn"] > 0 and "etp3" in space.examples["etp_ffn"]
    assert not any(c.etp in (3, 6) for c in space.accepted)
    assert space.rejected["etp_fp8"] > 0 and "etp2" in space.examples["etp_fp8"]
    etp2 = [c for c in space.accepted if c.etp == 2]
    assert etp2 and {c.fp8 for c in etp2} == {"none", "delayed"}
    assert {c.fp8 for c in space.accepted if c.etp == 1} == {"none", "delayed", "blockwise"}

    wide = enumerate_candidates(dataclasses.replace(TINY, moe_intermediate_size=256), work, 6, H100)
    assert {c.fp8 for c in wide.accepted if c.etp == 2} == {"none", "delayed", "blockwise"}
    assert "etp_fp8" not in wide.rejected
    with pytest.raises(ValueError, match="divisor of moe_intermediate_size"):
        SHAPE.activation_bytes(1, dtype="bfloat16", tp=1, recompute="none", etp=3)


def _off_rank_rows_by_enumeration(ep: int, etp: int) -> tuple[float, float]:
    """(destination ranks, off-rank destinations) of one token, averaged over every top-K expert set and every
    source rank of the ep * etp group: expert e lives on EP index e // (E / ep), whose etp shards are the
    consecutive ranks j * etp ... j * etp + etp - 1. An independent count of `dispatch_destinations`."""
    per = SHAPE.E // ep
    group = ep * etp
    dest = off = n = 0
    for experts in itertools.combinations(range(SHAPE.E), SHAPE.K):
        ranks = {(e // per) * etp + s for e in experts for s in range(etp)}
        for source in range(group):
            dest += len(ranks)
            off += len(ranks - {source})
            n += 1
    return dest / n, off / n


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_doubling_etp_scales_expert_work_and_traffic(ep):
    """etp 1 -> 2 at the same ep: a rank's expert shards receive 2x the rows at half the FFN width (the same expert
    FLOPs), every token goes to 2x the destination ranks over the 2x larger group (the off-rank rows follow an
    independent count), the rank holds half the expert parameters over half the edp ranks, keeps the H-wide expert
    rows twice over, and its mtdeepep buffer is sized for the folded group."""
    one, two = (Candidate(world=8, tp=1, pp=1, ep=ep, etp=etp) for etp in (1, 2))
    assert SHAPE.expert_rows(2) == 2 * SHAPE.expert_rows(1) == 2 * SHAPE.K
    assert SHAPE.expert_row_flops(2) == SHAPE.expert_row_flops(1) / 2 == 3 * SHAPE.H * SHAPE.Fm
    assert expert_gemm_flops(two, SHAPE) == expert_gemm_flops(one, SHAPE) == SHAPE.K * 6 * SHAPE.H * SHAPE.Fm

    # the weight-gradient GEMM time (= the forward GEMMs) is the same: the same FLOPs at the same rate
    chunk = rank_chunks(one, SHAPE.L)[0][0]
    t1, t2 = (chunk_times(chunk, c, SHAPE, WORK16, H100) for c in (one, two))
    assert t2.weight_grad == pytest.approx(t1.weight_grad, rel=1e-12)

    # dispatch rows: destinations double, the off-rank rows as counted over every expert set and source rank
    for cand in (one, two):
        dest, off = dispatch_destinations(cand.ep, cand.etp, SHAPE.E, SHAPE.K)
        assert (dest, off) == pytest.approx(_off_rank_rows_by_enumeration(cand.ep, cand.etp))
    assert dispatch_destinations(ep, 2, SHAPE.E, SHAPE.K)[0] == 2 * dispatch_destinations(ep, 1, SHAPE.E, SHAPE.K)[0]
    tokens, row = 4096.0, SHAPE.H * 2.0
    lat = H100.comm_latency_us * 1e-6
    bw = H100.link_bytes_per_s(True, expert_parallel=True)  # 8 ranks: inside one node
    for cand in (one, two):
        expected = tokens * dispatch_destinations(cand.ep, cand.etp, SHAPE.E, SHAPE.K)[1] * row / bw
        got = all_to_all_time(tokens, row, cand.ep, cand.etp, SHAPE.E, SHAPE.K, H100)
        assert got == (0.0 if cand.ep * cand.etp == 1 else pytest.approx(expected + lat))
    assert t2.ep_fwd > t1.ep_fwd and t2.ep_bwd > t1.ep_bwd

    # memory: expert state over ep * etp ranks, reduced over edp = dp * tp / (ep * etp)
    p1, p2 = (rank_params(SHAPE, [chunk], c) for c in (one, two))
    assert p2.experts == p1.experts / 2 and p2.dense == p1.dense and two.edp * 2 == one.edp
    b = 2  # bfloat16: one extra input row and one extra partial output row per routed expert, H wide
    a1, a2 = (SHAPE.activation_bytes(1, dtype="bfloat16", tp=1, recompute="none", etp=e) for e in (1, 2))
    assert a2 - a1 == SHAPE.K * 2 * SHAPE.H * b
    m1, m2 = (estimate_memory(c, SHAPE, WORK16, H100) for c in (one, two))
    assert m2.comm_buffers == nvl_bytes_hint(SHAPE.H, 2 * ep)
    assert m1.comm_buffers == (nvl_bytes_hint(SHAPE.H, ep) if ep > 1 else 0)


def test_dispatch_crossing_nodes_with_etp():
    """A folded group beyond a node (ep 4 x etp 4 on 8-GPU nodes): the rows cross the NIC once per other node
    reached; shards of one expert wider than a node (etp 16) reach etp / 8 nodes per expert."""
    tokens, row = 1000.0, 1000.0
    spec = H100
    inter_bw = spec.link_bytes_per_s(False)
    t = all_to_all_time(tokens, row, 4, 4, 8, 2, spec)  # 2 nodes, 2 EP indices each
    lat2 = 2 * spec.comm_latency_us * 1e-6
    assert t >= tokens * (1 - 6 / 28) * row / inter_bw + lat2  # the other node is reached w.p. 1 - C(4,2)/C(8,2)
    assert t > all_to_all_time(tokens, row, 2, 4, 8, 2, spec)  # the same experts' shards inside one node
    wide = all_to_all_time(tokens, row, 2, 16, 8, 2, spec)  # every EP index spans 2 nodes
    distinct = dispatch_destinations(2, 1, 8, 2)[0]
    assert wide >= tokens * (2 * distinct - distinct / 2) * row / inter_bw + lat2


# Wide experts on one node of 8 H100s: 4 experts of 3 x 4096 x 57344 (0.7B parameters each) in 4 MoE layers.
WIDE = dataclasses.replace(
    TINY, hidden_size=4096, moe_intermediate_size=57344, intermediate_size=16384, num_hidden_layers=4,
    first_k_dense_replace=0, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
    num_nextn_predict_layers=0, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192,
)  # fmt: skip
WIDE_WORK = Workload(global_batch=64, micro_batches=8, seq_len=4096, dtype="bfloat16")


def test_wide_experts_rank_an_etp_layout_first():
    """With at most ep 4 (4 experts), a rank holds a whole expert per layer without ETP, and only full recompute
    makes room for the activations; ETP halves the expert state per rank, so a lighter recompute fits and is faster.
    The fastest layout is an ETP one, the same layout without ETP does not fit, and the table and command show it."""
    result = plan(WIDE, WIDE_WORK, 8, H100)
    best = result.ranked[0]
    assert best.candidate.etp > 1 and best.candidate.recompute != "full"
    assert all(e.candidate.recompute == "full" for e in result.ranked if e.candidate.etp == 1)
    fastest_without = next(e for e in result.ranked if e.candidate.etp == 1)
    assert best.time.step < fastest_without.time.step
    twin = estimate(dataclasses.replace(best.candidate, etp=1), WIDE, WIDE_WORK, H100)
    assert twin.memory.total > H100.memory_capacity_bytes(8) >= best.memory.total

    shape = ModelShape.from_config(WIDE)
    text = report.ranked_table(result, 3, shape, WIDE_WORK, H100)
    header, _, first = text.splitlines()[:3]
    assert header.split()[:3] == ["#", "layout", "etp"]
    column = header.index("etp")
    assert first[column : column + 3].strip() == str(best.candidate.etp)
    assert f"--etp {best.candidate.etp}" in report.flags_line(best, "wide.toml")


def test_etp_moves_more_rows_than_ep_over_the_same_group():
    """ETP against plain EP over a group of the same size (the same expert state per rank): every token reaches
    all etp shards of its experts' ranks, so more dispatch and combine rows and more kept expert rows."""
    work = Workload(global_batch=32, micro_batches=4, seq_len=128, dtype="float32")
    for ep in (1, 2):
        with_etp = estimate(Candidate(world=4, tp=1, pp=1, ep=ep, etp=2), TINY, work, CPU)
        without = estimate(Candidate(world=4, tp=1, pp=1, ep=2 * ep), TINY, work, CPU)
        assert with_etp.time.ep_comm > without.time.ep_comm
        assert with_etp.memory.activations > without.memory.activations
        assert with_etp.memory.weights == pytest.approx(without.memory.weights)
