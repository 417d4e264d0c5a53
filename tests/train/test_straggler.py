"""Slow-rank detection: the per-rank phase timer (moe/layer/phase_timer.py), the report rule
(moe/trainer/train/straggler.py) and the MoE layer's timing. The end-to-end check (two ranks, an injected delay each) is
in test_rewind.py's two-process run, which has detection on."""

from __future__ import annotations

import pytest
import torch

from moe import MoELayer
from moe.layer.phase_timer import PHASES, PhaseTimer, mark_backward
from moe.trainer.train.straggler import SlowRank, find_slow_ranks, stage_peers
from tests.moe.moe_testlib import SIGMOID_V3, SMALL_LAYER, moe_config


class FakeClock:
    """`time` for moe.layer.phase_timer: `perf_counter` reads `now`, `sleep` advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    import moe.layer.phase_timer as module

    fake = FakeClock()
    monkeypatch.setattr(module, "time", fake)
    return fake


def _seconds(timer: PhaseTimer) -> dict[str, float]:
    totals, _, _ = timer.take()
    return {p: t for p, t in zip(PHASES, totals) if t}


def test_phases_are_exclusive(clock):
    timer = PhaseTimer()
    clock.now += 5.0  # outside every phase: not counted
    with timer.phase("forward"):
        clock.now += 1.0
        with timer.phase("dispatch"):
            clock.now += 0.25
        clock.now += 2.0
        timer.push("combine")
        clock.now += 0.5
        timer.push("backward")  # e.g. the deferred weight-gradient GEMMs inside a communication phase
        clock.now += 4.0
        timer.pop("backward")
        clock.now += 0.125
        timer.pop("combine")
    assert _seconds(timer) == {"forward": 3.0, "dispatch": 0.25, "combine": 0.625, "backward": 4.0}
    assert timer.depth == 0
    # take() resets; a phase open across it is split between the takes.
    timer.push("optimizer")
    clock.now += 1.5
    totals, events, mismatches = timer.take()
    assert totals[PHASES.index("optimizer")] == 1.5 and events == 1 and mismatches == 0
    clock.now += 0.5
    timer.pop("optimizer")
    assert _seconds(timer) == {"optimizer": 0.5}


def test_two_threads_taking_turns_keep_their_own_phases(clock):
    """DualPipeV's overlapped chunks run two micro-batches on two threads that take turns (moe/layer/interleave.py):
    each thread's phases nest on their own, and the time between two events goes to the thread that ran."""
    import threading

    timer = PhaseTimer()
    turn = {"a": threading.Event(), "b": threading.Event()}

    def hand_over(to: str, me: str) -> None:
        turn[me].clear()
        turn[to].set()
        assert turn[me].wait(10)

    def side_a():
        timer.push("forward")
        clock.now += 1.0
        timer.push("dispatch")  # started; the other side computes while it is in flight
        hand_over("b", "a")
        clock.now += 0.25  # A's wait for the dispatch
        timer.pop("dispatch")
        clock.now += 2.0
        timer.pop("forward")
        turn["b"].set()

    def side_b():
        assert turn["b"].wait(10)
        timer.push("backward")
        clock.now += 4.0
        timer.push("combine")
        hand_over("a", "b")
        clock.now += 0.5
        timer.pop("combine")
        timer.pop("backward")

    threads = [threading.Thread(target=side_a), threading.Thread(target=side_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert _seconds(timer) == {"forward": 3.0, "dispatch": 0.25, "backward": 4.0, "combine": 0.5}
    assert timer.take()[2] == 0  # no mismatch: the sides never unwound each other's phases


def test_mismatched_pops_are_counted_not_raised(clock):
    timer = PhaseTimer()
    timer.pop("forward")  # nothing open
    timer.push("forward")
    timer.push("dispatch")
    clock.now += 1.0
    timer.pop("forward")  # unwinds the dispatch too
    assert timer.depth == 0
    _, _, mismatches = timer.take()
    assert mismatches == 2
    with pytest.raises(ValueError, match="unknown phase"):
        timer.phase("fwd")


def test_delays_sleep_at_the_end_of_each_occurrence(clock):
    timer = PhaseTimer(delays={"backward": 0.5})
    for _ in range(3):
        with timer.phase("backward"):
            clock.now += 1.0
        with timer.phase("forward"):
            clock.now += 1.0
    assert _seconds(timer) == {"backward": 4.5, "forward": 3.0}
    timer.set_delays({})
    with timer.phase("backward"):
        clock.now += 1.0
    assert _seconds(timer) == {"backward": 1.0}
    with pytest.raises(ValueError, match=">= 0 seconds"):
        timer.set_delays({"forward": -1.0})


def _table(rows: dict[int, dict[str, float]], world: int) -> list[list[float]]:
    return [[rows.get(r, {}).get(p, 0.1) for p in PHASES] for r in range(world)]


def test_report_names_the_rank_and_phase_above_the_median():
    # 4 ranks: rank 2 slow in backward; ranks 0, 1, 3 waited for it in grad_sync (the median absorbs the wait).
    table = _table({0: {"grad_sync": 0.4}, 1: {"grad_sync": 0.41}, 2: {"backward": 0.4}, 3: {"grad_sync": 0.39}}, 4)
    found = find_slow_ranks(table, stage_peers(4, 1), factor=1.5, min_seconds=0.01)
    assert found == [SlowRank(2, "backward", 0.4, 0.1)]
    assert found[0].compute and found[0].ratio == pytest.approx(4.0)
    assert found[0].describe().startswith("rank 2 is slow in backward: 400.0 ms/step vs the median 100.0 ms/step")
    # The absolute floor: 0.16 s/step against a median of 0.1 is 1.6x but only 0.06 s/step more.
    slight = _table({1: {"forward": 0.16}}, 4)
    assert find_slow_ranks(slight, stage_peers(4, 1), 1.5, 0.07) == []
    assert [(s.rank, s.phase) for s in find_slow_ranks(slight, stage_peers(4, 1), 1.5, 0.01)] == [(1, "forward")]
    # Compute findings first, then communication, each by excess.
    mixed = _table({0: {"combine": 0.9}, 1: {"forward": 0.3}, 3: {"optimizer": 0.5}}, 4)
    assert [(s.rank, s.phase) for s in find_slow_ranks(mixed, stage_peers(4, 1), 1.5, 0.01)] == [
        (3, "optimizer"), (1, "forward"), (0, "combine")
    ]  # fmt: skip


def test_pipeline_stages_are_judged_apart():
    # PP2 over 4 ranks: stage 1 (ranks 2, 3) holds more layers and is slower than stage 0 by design.
    table = _table({2: {"forward": 0.4}, 3: {"forward": 0.41}}, 4)
    assert stage_peers(4, 2) == [[0, 1], [2, 3]]
    assert find_slow_ranks(table, stage_peers(4, 2), 1.5, 0.01) == []
    assert [(s.rank, s.phase) for s in find_slow_ranks(table, stage_peers(4, 1), 1.5, 0.01)] == [
        (3, "forward"), (2, "forward")
    ]  # fmt: skip
    assert find_slow_ranks(table, stage_peers(2, 2), 1.5, 0.01) == []  # one rank per stage: no peers


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "layer_recompute"])
def test_moe_layer_times_dispatch_and_combine_without_changing_results(recompute):
    torch.manual_seed(0)
    cfg = moe_config(SMALL_LAYER, **SIGMOID_V3, moe_shared_expert_intermediate_size=16, moe_layer_recompute=recompute)
    layer = MoELayer(cfg)
    x = torch.randn(2, 24, cfg.hidden_size)

    def run():
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.square().sum().backward()
        return out.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    plain = run()
    timer = PhaseTimer()
    layer.set_phase_timer(timer)
    assert layer.dispatcher.phase_timer is timer
    with timer.phase("forward"):
        timed = run()  # the backward runs inside the forward phase here: the comm phases nest in either
    assert torch.equal(plain[0], timed[0]) and torch.equal(plain[1], timed[1])
    assert all(torch.equal(plain[2][n], timed[2][n]) for n in plain[2])
    totals, events, mismatches = timer.take()
    seconds = dict(zip(PHASES, totals))
    assert mismatches == 0 and timer.depth == 0
    assert seconds["dispatch"] > 0 and seconds["combine"] > 0 and seconds["forward"] > 0
    # Forward: dispatch begin + end and combine begin + end; backward: the two marks around the combine (once per
    # forward run: the layer's recomputation runs the forward, and its marks, again without a graph to run).
    assert events == 2 * (4 + 1) + (2 * 4 if recompute else 0) + 2
    layer.set_phase_timer(None)
    assert layer.phase_timer is None and layer.dispatcher.phase_timer is None


def test_backward_marks_bracket_an_operation():
    timer = PhaseTimer()
    x = torch.randn(5, requires_grad=True)
    y = mark_backward(x, timer, "combine", enter=False)
    z = mark_backward(y * 3.0, timer, "combine", enter=True)
    assert mark_backward(x.detach(), timer, "combine", enter=True).grad_fn is None  # nothing recorded: no mark
    timer.push("backward")
    z.sum().backward()
    timer.pop("backward")
    _, events, mismatches = timer.take()
    assert events == 4 and mismatches == 0 and torch.equal(x.grad, torch.full((5,), 3.0))
