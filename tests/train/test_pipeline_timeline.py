"""The pipeline timeline: recording, the measured bubble against DualPipe's analytic bubbles on simulated schedules,
the Chrome trace, the PNG, validation, and gathering over two gloo ranks."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from moe.trainer.pipeline.timeline import (
    KINDS,
    Slot,
    TimelineRecorder,
    analytic_bubble,
    analytic_bubble_fraction,
    bubble_fraction,
    chrome_trace,
    expected_bubble_fraction,
    interleaved_bubble_ratio,
    plot_timeline,
    write_chrome_trace,
)
from tests.train import pipeline_timeline_cases as cases

# ---------------------------------------------------------------------------------------------------------------
# A list scheduler: each rank runs its actions in order, each as soon as the rank is free and its inputs exist.
# Actions are `(kind, stage, micro-batch)`: F(s, j) needs F(s-1, j); B or I (s, j) needs F(s, j) and the same backward
# of (s+1, j); W(s, j) needs I(s, j), whichever rank holds them. It gives exact slot times of a schedule with unit
# costs, independent of the code under test.


def simulate_chunks(orders: list[list[tuple[str, int, int]]], stages: int, cost: dict[str, float]) -> list[list[Slot]]:
    P = len(orders)
    end: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * P, [0.0] * P
    out: list[list[Slot]] = [[] for _ in range(P)]
    while any(pos[r] < len(orders[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while pos[r] < len(orders[r]):
                kind, s, j = orders[r][pos[r]]
                if kind == "F":
                    deps = [("F", s - 1, j)] if s > 0 else []
                elif kind in ("B", "I"):
                    deps = [("F", s, j)] + ([(kind, s + 1, j)] if s < stages - 1 else [])
                else:
                    deps = [("I", s, j)]
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                free[r] = end[(kind, s, j)] = start + cost[kind]
                out[r].append(Slot(r, kind, s, j, start, free[r]))
                pos[r] += 1
                progressed = True
        assert progressed, "the orders deadlock"
    return out


def simulate(orders: list[list[tuple[str, int]]], cost: dict[str, float]) -> list[list[Slot]]:
    """`simulate_chunks` with one stage per rank (rank r holds stage r): actions `(kind, micro-batch)`."""
    return simulate_chunks([[(kind, r, j) for kind, j in order] for r, order in enumerate(orders)], len(orders), cost)


def one_f_one_b(P: int, m: int) -> list[list[tuple[str, int]]]:
    """1F1B: P-1-r warm-up forwards, then one forward one backward, then the remaining backwards."""
    orders = []
    for r in range(P):
        warm = min(P - 1 - r, m)
        order = [("F", j) for j in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i), ("B", i)]
        order += [("B", j) for j in range(m - warm, m)]
        orders.append(order)
    return orders


def zb_h1(P: int, m: int) -> list[list[tuple[str, int]]]:
    """ZB-H1: 1F1B's order with the backward split into I and W, rank r holding back r weight gradients (W) to
    fill its drain bubble. (Its bubble is the table's (P-1)(F+B-2W) while W <= F and W <= I.)"""
    orders = []
    for r in range(P):
        warm = min(P - 1 - r, m)
        order = [("F", j) for j in range(warm)]
        done_w = 0
        for i in range(m):
            if warm + i < m:
                order.append(("F", warm + i))
            order.append(("I", i))
            if i >= r:
                order.append(("W", done_w))
                done_w += 1
        order += [("W", j) for j in range(done_w, m)]
        orders.append(order)
    return orders


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_1f1b_measured_bubble_equals_analytic(P, mult):
    m = mult * P
    F, B = 1.0, 2.0
    report = bubble_fraction(simulate(one_f_one_b(P, m), {"F": F, "B": B}))
    bubble = analytic_bubble("1f1b", P, F, B)
    assert bubble == (P - 1) * (F + B)
    # Unit costs and sums of a few small integers: exact in binary floating point.
    assert report.idle_per_rank == [bubble] * P
    assert report.span == m * (F + B) + bubble
    assert report.fraction == bubble / (bubble + m * (F + B))
    assert report.fraction == analytic_bubble_fraction("1f1b", P, m, F, B)
    assert report.count_by_kind == {"F": P * m, "B": P * m}
    assert report.busy_by_kind == {"F": P * m * F, "B": P * m * B}
    assert report.unit_times() == {"F": F, "B": B, "W": 0.0, "F_and_B": None}


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("m_mult", [1, 3])
@pytest.mark.parametrize(("F", "Ig", "W"), [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0)])
def test_zbh1_measured_bubble_equals_analytic(P, m_mult, F, Ig, W):  # Ig: the input-gradient backward (I)
    m = m_mult * P
    timelines = simulate(zb_h1(P, m), {"F": F, "I": Ig, "W": W})
    report = bubble_fraction(timelines)
    units = report.unit_times()
    assert units == {"F": F, "B": Ig + W, "W": W, "F_and_B": None}
    bubble = analytic_bubble("zbh1", P, **units)
    assert bubble == (P - 1) * (F + Ig - W)
    assert report.idle_per_rank == [bubble] * P
    assert report.fraction == pytest.approx(analytic_bubble_fraction("zbh1", P, m, **units), rel=1e-12)
    # Same costs under 1F1B with the backward unsplit: ZB-H1 removes 2W per bubble step.
    one_f = bubble_fraction(simulate(one_f_one_b(P, m), {"F": F, "B": Ig + W}))
    assert one_f.idle_per_rank == [analytic_bubble("1f1b", P, F, Ig + W)] * P
    assert one_f.idle_per_rank[0] - bubble == (P - 1) * 2 * W
    if F == Ig == W:  # the ZB paper's headline: a third of 1F1B's bubble
        assert bubble * 3 == one_f.idle_per_rank[0]


def interleaved_1f1b(P: int, V: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Megatron-core's interleaved 1F1B (m a multiple of P): rank r holds stages r, r + P, ...; its k-th forward runs
    chunk (k // P) % V on micro-batch (k // PV) P + k % P, its k-th backward the chunks in reverse; 2(P-r-1) +
    (V-1)P warm-up forwards, then one forward one backward, then the remaining backwards."""
    orders = []
    for r in range(P):
        total = m * V
        warm = min(2 * (P - r - 1) + (V - 1) * P, total)

        def mb(k):
            return (k // (P * V)) * P + k % P

        fwd = [("F", ((k // P) % V) * P + r, mb(k)) for k in range(total)]
        bwd = [("B", (V - 1 - (k // P) % V) * P + r, mb(k)) for k in range(total)]
        order = fwd[:warm]
        for i in range(total - warm):
            order += [fwd[warm + i], bwd[i]]
        orders.append(order + bwd[total - warm :])
    return orders


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("V", [1, 2, 3])
@pytest.mark.parametrize("mult", [1, 3])
def test_interleaved_1f1b_measured_bubble_equals_megatrons_formula(P, V, mult):
    m = mult * P
    F, B = 1.0, 2.0
    report = bubble_fraction(simulate_chunks(interleaved_1f1b(P, V, m), P * V, {"F": F, "B": B}))
    # The bubble is (P-1)(F+B) of ONE chunk on every rank, the compute V m (F+B): (P-1)/(V m) relative.
    assert report.idle_per_rank == [(P - 1) * (F + B)] * P
    assert interleaved_bubble_ratio(P, m, V) == (P - 1) / (V * m)
    assert report.fraction == pytest.approx(expected_bubble_fraction(P, m, V), rel=1e-12)
    assert report.fraction == pytest.approx(analytic_bubble_fraction("1f1b", P, m, F, B, virtual_stages=V), rel=1e-12)
    assert report.count_by_kind == {"F": P * V * m, "B": P * V * m}
    if V > 1:  # V chunks cut the bubble V-fold against plain 1F1B on the same layers (chunks V times longer)
        plain = bubble_fraction(simulate(one_f_one_b(P, m), {"F": V * F, "B": V * B}))
        assert plain.idle_per_rank[0] == V * report.idle_per_rank[0]
    with pytest.raises(ValueError, match="DualPipeV already holds 2 stages"):
        analytic_bubble_fraction("dualpipev", P, m, F, B, virtual_stages=2)


def test_analytic_formulas_and_dualpipev_pp_meaning():
    F, B, W, FB = 1.5, 3.0, 1.25, 3.5
    assert analytic_bubble("1f1b", 4, F, B, W) == 3 * (F + B)
    assert analytic_bubble("zbh1", 4, F, B, W) == 3 * (F + B - 2 * W)
    # DualPipe's PP counts stages; DualPipeV's pp ranks hold 2*pp stages: (2pp/2 - 1) = (pp - 1).
    assert analytic_bubble("dualpipev", 4, F, B, W, FB) == 3 * (FB + B - 3 * W)
    assert analytic_bubble("dualpipev", 4, F, B, W) == 3 * (F + B + B - 3 * W)  # no overlap gain by default
    assert analytic_bubble("1f1b", 1, F, B) == 0.0
    # Per-rank compute of DualPipeV counts both chunks of a rank.
    frac = analytic_bubble_fraction("dualpipev", 4, 8, F, B, W, FB)
    bubble = 3 * (FB + B - 3 * W)
    assert frac == pytest.approx(bubble / (bubble + 2 * 8 * (F + B)), rel=1e-15)
    assert analytic_bubble_fraction("1f1b", 4, 8, F, B, compute=10.0) == pytest.approx(13.5 / 23.5, rel=1e-15)


def test_bubble_counts_overlaps_once_and_comm_as_idle():
    timelines = [
        [Slot(0, "F", 0, 0, 0.0, 2.0), Slot(0, "W", 0, 1, 1.0, 3.0), Slot(0, "comm", 0, 1, 3.0, 5.0)],
        [Slot(1, "F&B", (1, 2), (0, 1), 1.0, 4.0)],
    ]
    report = bubble_fraction(timelines)
    assert (report.span_start, report.span_end) == (0.0, 5.0)
    assert [r.busy for r in report.per_rank] == [3.0, 3.0]  # [0, 3] union; comm is a wait
    assert report.idle_per_rank == [2.0, 2.0]
    assert report.fraction == 4.0 / 10.0
    assert report.per_rank[0].busy_by_kind == {"F": 2.0, "W": 2.0, "comm": 2.0}
    assert report.mean_by_kind["F&B"] == 3.0
    with pytest.raises(ValueError, match="no backward"):
        report.unit_times()  # neither 'B' nor 'I' slots


def test_recorder_records_and_resets():
    ticks = iter(range(100))
    rec = TimelineRecorder(3, clock=lambda: float(next(ticks)))
    rec.start_step()  # tick 0
    with rec.slot("F", 1, 0):  # ticks 1, 2
        pass
    with rec.slot("F&B", (1, 6), (2, 0)):  # ticks 3, 4
        pass
    with pytest.raises(RuntimeError), rec.slot("B", 1, 0):  # a failed slot is not kept
        raise RuntimeError("boom")
    rec.add("W", 1, 0, 10.0, 12.0)
    assert rec.step_start == 0.0
    assert rec.slots == [
        Slot(3, "F", 1, 0, 1.0, 2.0),
        Slot(3, "F&B", (1, 6), (2, 0), 3.0, 4.0),
        Slot(3, "W", 1, 0, 10.0, 12.0),
    ]
    rec.start_step()
    assert rec.slots == [] and rec.step_start == 7.0
    rec.reset()
    assert rec.slots == [] and rec.step_start is None


def test_disabled_recorder_costs_nothing():
    calls = []
    rec = TimelineRecorder(0, enabled=False, clock=lambda: calls.append(1) or 0.0)
    a, b = rec.slot("F", 0, 0), rec.slot("B", 0, 1)
    assert a is b  # one shared no-op context manager: nothing allocated per slot
    with a:
        pass
    rec.add("F", 0, 0, 0.0, 1.0)
    rec.start_step()
    assert calls == [] and rec.slots == []


def test_enabled_recorder_overhead_is_small():
    rec = TimelineRecorder(0)
    n = 20000
    t0 = time.perf_counter()
    for j in range(n):
        with rec.slot("F", 0, j):
            pass
    per_slot = (time.perf_counter() - t0) / n
    assert len(rec.slots) == n
    assert per_slot < 50e-6, f"{per_slot * 1e6:.1f} us per slot"  # about 1-2 us on an idle core


def test_chrome_trace(tmp_path):
    timelines = simulate(one_f_one_b(2, 4), {"F": 1e-3, "B": 2e-3})
    timelines[1].append(Slot(1, "comm", 1, 0, 0.0, 1e-3))
    timelines[0].append(Slot(0, "F&B", (0, 3), (4, 1), 15e-3, 16e-3))
    path = tmp_path / "trace.json"
    write_chrome_trace(path, timelines, metadata={"schedule": "1f1b", "analytic_bubble_fraction": 0.2})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]  # no temporary left behind
    doc = json.loads(path.read_text())
    assert doc == chrome_trace(timelines, {"schedule": "1f1b", "analytic_bubble_fraction": 0.2})
    names = {(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "pp rank 0"), (1, "pp rank 1")}
    slots = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slots) == sum(len(t) for t in timelines)
    f3 = next(e for e in slots if e["pid"] == 1 and e["name"] == "F3 s1")
    ref = next(s for s in timelines[1] if s.kind == "F" and s.microbatch == 3)
    assert f3["cat"] == "F" and f3["tid"] == 0 and f3["args"]["stage"] == 1 and f3["args"]["microbatch"] == 3
    assert f3["ts"] == pytest.approx(ref.start * 1e6) and f3["dur"] == pytest.approx(ref.duration * 1e6)
    comm = next(e for e in slots if e["cat"] == "comm")
    assert comm["tid"] == 1 and comm["name"] == "comm0 s1"
    fb = next(e for e in slots if e["cat"] == "F&B")
    assert fb["name"] == "F&B 4/1 s(0,3)" and fb["args"]["microbatch"] == [4, 1]
    assert len({e["cname"] for e in slots}) == 4  # one colour per kind: F, B, comm, F&B
    other = doc["otherData"]
    assert other["schedule"] == "1f1b" and other["analytic_bubble_fraction"] == 0.2
    assert other["bubble"]["bubble_fraction"] == pytest.approx(bubble_fraction(timelines).fraction)
    assert len(other["bubble"]["per_rank_bubble_fraction"]) == 2


def test_plot_writes_png(tmp_path):
    timelines = simulate(zb_h1(4, 8), {"F": 1e-3, "I": 1e-3, "W": 1e-3})
    timelines[2].append(Slot(2, "comm", 2, 0, 0.0, 2e-3))
    path = tmp_path / "timeline.png"
    plot_timeline(path, timelines, "ZB-H1 pp=4")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Slot(0, "X", 0, 0, 0.0, 1.0), "unknown slot kind 'X'"),
        (lambda: Slot(0, "F", 0, 0, 2.0, 1.0), "ends before it starts"),
        (lambda: Slot(0, "F&B", 0, 1, 0.0, 1.0), "pair"),
        (lambda: Slot(0, "F", 0, (1, 2), 0.0, 1.0), "must be an int"),
        (lambda: Slot(-1, "F", 0, 0, 0.0, 1.0), "rank"),
        (lambda: Slot(0, "F", 0, 0, 0.0, float("nan")), "finite"),
        (lambda: TimelineRecorder(0).slot("fwd", 0, 0), "unknown slot kind 'fwd'"),
        (lambda: TimelineRecorder(0).add("F", 0, 0, 1.0, 0.5), "ends before it starts"),
        (lambda: bubble_fraction([]), "no timelines"),
        (lambda: bubble_fraction([[], []]), "every timeline is empty"),
        (lambda: bubble_fraction([[("F", 0, 0, 0.0, 1.0)]]), "expected Slot"),
        (lambda: bubble_fraction([[Slot(0, "F", 0, 0, 1.0, 1.0)]]), "span no time"),
        (lambda: write_chrome_trace("/nonexistent-dir/t.json", []), "no timelines"),
        (lambda: plot_timeline("/nonexistent-dir/t.png", [[]], ""), "every timeline is empty"),
        (lambda: analytic_bubble("gpipe", 4, 1.0, 2.0), "unknown schedule 'gpipe'"),
        (lambda: analytic_bubble("1f1b", 0, 1.0, 2.0), "positive int"),
        (lambda: analytic_bubble("zbh1", 4, 1.0, 2.0, 3.0), "cannot exceed B"),
        (lambda: analytic_bubble("1f1b", 4, -1.0, 2.0), "F must be"),
        (lambda: analytic_bubble("dualpipev", 4, 1.0, 2.0, 0.5, float("inf")), "F_and_B"),
        (lambda: analytic_bubble_fraction("1f1b", 4, 0, 1.0, 2.0), "num_microbatches"),
    ],
)
def test_bad_input_raises(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_kinds():
    assert KINDS == ("F", "B", "I", "W", "F&B", "comm")


@pytest.mark.parametrize("two_hosts", [False, True])
def test_gather_two_ranks(rank_pools, two_hosts):
    (g0, raw0), (g1, raw1) = rank_pools[2].run(cases.gather_case, two_hosts)
    assert g0 == g1  # every rank gets every timeline
    assert [[s.kind for s in t] for t in g0] == [["F", "comm"], ["comm", "F", "B"]]
    assert all(s.rank == r for r, t in enumerate(g0) for s in t)
    assert min(s.start for t in g0 for s in t) >= 0.0  # origin: the earliest step start
    f0, f1 = g0[0][0], g0[1][1]
    if not two_hosts:
        # One machine, one clock: a single shift maps the raw readings of both ranks (exact up to rounding).
        shift = g0[0][0].start - raw0[0].start
        for gathered, raw in ((g0[0], raw0), (g0[1], raw1)):
            for g, s in zip(gathered, raw):
                assert g.start == pytest.approx(s.start + shift, abs=1e-9)
                assert g.end == pytest.approx(s.end + shift, abs=1e-9)
        assert f1.start >= f0.end  # rank 1's F waited for rank 0's message
    else:
        # Rank 1's clock read SKEW_S ahead; the barrier reference takes it out up to the barrier's release skew.
        assert raw1[1].start - raw0[0].end > cases.SKEW_S - 1
        assert -0.05 < f1.start - f0.end < 0.5
