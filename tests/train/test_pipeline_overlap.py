"""DualPipeV's MoE communication overlap (moe/trainer/pipeline/overlap.py, moe/layer/interleave.py).

- The interleaver: the two sides alternate at their communication points, in a fixed order; errors reach the
  caller and unwind the other side; the sequential baseline and `in_flight` outside an interleaver do nothing else.
- PP2 x EP2 x DP2 (4 ranks): one step with the overlap on gives the loss sums, gradients and expert loads of one with
  it off, bit for bit (also with the MoE layers recomputed, whose recomputation communicates inside the backward),
  and inside every F&B each side's communication was in flight while the other side computed (the events the
  implementation records). The timeline holds one F&B slot per overlapped action and the MoE 'comm' slots.
- Fallback rules and a bad configuration.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from moe.layer.interleave import Interleaver, comms_of, compute_spans
from moe.trainer.pipeline.overlap import plot_fb, sequential_reason, summarize
from mtdeepep.in_flight import has_work, in_flight, run_at_next_in_flight, while_in_flight, withdraw, workers
from tests.train import pipeline_overlap_cases as cases

pytestmark = pytest.mark.slow  # slow: DualPipeV overlap runs on 2 ranks

# ---------------------------------------------------------------------------------------------------------------
# The interleaver, in one process (no communication: `in_flight` marks the points)


def _side(log: list, name: str, points: int):
    def run():
        for i in range(points):
            log.append(f"{name} compute {i}")
            with in_flight(f"{name.lower()}{i}"):
                log.append(f"{name} wait {i}")
        log.append(f"{name} compute {points}")
        return name

    return run


def test_sides_alternate_at_their_communication_points():
    log: list[str] = []
    inter = Interleaver()
    assert inter.run(_side(log, "F", 2), _side(log, "B", 3)) == ("F", "B")
    # F starts; each side computes until it has a communication in flight, then the other side runs.
    assert log == ["F compute 0", "B compute 0", "F wait 0", "F compute 1", "B wait 0", "B compute 1",
                   "F wait 1", "F compute 2",  # F ends: B runs to its end, waiting for its own communications
                   "B wait 1", "B compute 2", "B wait 2", "B compute 3"]  # fmt: skip
    kinds = [(e.side, e.kind, e.name) for e in inter.events]
    assert kinds[:4] == [("F", "start", ""), ("F", "issue", "f0"), ("B", "start", ""), ("B", "issue", "b0")]
    comms = comms_of(inter.events)
    assert [(c.side, c.name) for c in comms] == [("F", "f0"), ("B", "b0"), ("F", "f1"), ("B", "b1"), ("B", "b2")]
    assert all(c.issue <= c.resume <= c.done for c in comms)
    f0 = comms[0]
    b_spans = compute_spans(inter.events, "B")
    assert b_spans[0][0] >= f0.issue and b_spans[0][1] <= f0.resume  # B computed while F's f0 was in flight
    # The same interleaver runs again (its worker thread is kept), starting with the second side.
    log.clear()
    inter.run(_side(log, "F", 1), _side(log, "B", 1), start=1)
    assert log == ["B compute 0", "F compute 0", "B wait 0", "B compute 1", "F wait 0", "F compute 1"]
    inter.close()


def test_sequential_baseline_and_no_interleaver():
    log: list[str] = []
    inter = Interleaver()
    inter.run(_side(log, "F", 2), _side(log, "B", 1), interleave=False)
    assert log == ["F compute 0", "F wait 0", "F compute 1", "F wait 1", "F compute 2",
                   "B compute 0", "B wait 0", "B compute 1"]  # fmt: skip
    assert [c.name for c in comms_of(inter.events)] == ["f0", "f1", "b0"]
    assert all(c.resume - c.issue < 0.01 for c in comms_of(inter.events))  # nothing ran in between
    log.clear()
    _side(log, "X", 2)()  # outside an interleaver `in_flight` does nothing
    assert log == ["X compute 0", "X wait 0", "X compute 1", "X wait 1", "X compute 2"]
    with pytest.raises(ValueError, match="different names"):
        Interleaver(("F", "F"))


def test_an_error_of_one_side_reaches_the_caller_and_unwinds_the_other():
    log: list[str] = []

    def failing():
        log.append("B compute 0")
        raise ValueError("boom in the backward")

    inter = Interleaver()
    with pytest.raises(ValueError, match="boom in the backward"):
        inter.run(_side(log, "F", 2), failing)
    # F handed over at its first point, B failed; F was unwound there: it never waited nor computed again.
    assert log == ["F compute 0", "B compute 0"]
    log.clear()
    assert inter.run(_side(log, "F", 1), _side(log, "B", 1)) == ("F", "B")  # usable after a failure
    inter.close()


def test_in_flight_work_is_per_thread_ordered_and_nests():
    """The seam (mtdeepep/in_flight.py): queued one-shot work runs first (oldest first, once), then the workers'
    enters outermost first, the block, their exits innermost first; per thread; nesting restores the outer set."""
    log: list[str] = []

    def worker(tag):
        @contextlib.contextmanager
        def enter(name):
            log.append(f"{tag} enter {name}")
            yield
            log.append(f"{tag} exit {name}")

        return enter

    def work(tag):
        return lambda: log.append(f"work {tag}")

    outer, inner = worker("outer"), worker("inner")
    seen = []
    assert not has_work()
    with while_in_flight(outer):
        with while_in_flight(inner):
            assert workers() == (outer, inner) and has_work()
            worker_thread = threading.Thread(target=lambda: seen.append((workers(), has_work())))
            worker_thread.start()
            worker_thread.join()
            first, dropped = work("a"), work("dropped")
            run_at_next_in_flight(first)
            run_at_next_in_flight(dropped)
            run_at_next_in_flight(work("b"))
            withdraw(dropped)
            with in_flight("x"):
                log.append("wait x")
            with in_flight("y", active=False):  # nothing in flight: nothing runs
                log.append("wait y")
        assert workers() == (outer,)
    assert workers() == () and not has_work() and seen == [((), False)]
    assert log == ["work a", "work b", "outer enter x", "inner enter x", "wait x", "inner exit x", "outer exit x",
                   "wait y"]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# PP2 x EP2 x DP2 on tiny's model


@pytest.mark.parametrize("recompute", [None, ("moe",)], ids=["no_recompute", "moe_recompute"])
def test_overlap_is_bit_identical_and_hides_each_sides_comm(rank_pools, tmp_path, recompute):
    results = rank_pools[4].run(cases.overlap_case, recompute)
    assert [r["pp_rank"] for r in results] == [0, 0, 1, 1]
    for r in results:
        assert r["reason"] is None
        assert r["sums_equal"] and r["loads_equal"] and r["grad_names_equal"], r
        assert r["num_grads"] > 20 and r["grads_differ"] == [], r["grads_differ"]
        records = r["records"]
        assert records and all(rec["interleaved"] for rec in records)
        for rec in records:  # no communication was started with the other side still running and left uncovered
            assert rec["uncovered"] == [], rec
        # The timeline: each overlapped action is one F&B slot instead of an F and a B slot, plus its comm slots.
        on, off = r["slots_on"], r["slots_off"]
        fb = [s for s in on if s[0] == "F&B"]
        assert len(fb) == len(records) and not any(s[0] == "F&B" for s in off)
        for kind in "FB":
            assert sum(s[0] == kind for s in on) == sum(s[0] == kind for s in off) - len(records), kind
        assert sum(s[0] == "comm" for s in on) == sum(
            len(rec["comms"]["F"]) + len(rec["comms"]["B"]) for rec in records
        )
    # Pipeline rank 1 holds stages 1 and 2 (one MoE layer each): both sides of every F&B communicate, and each
    # side's communications ran while the other side computed.
    for r in results[2:]:
        for rec in r["records"]:
            assert rec["comms"]["F"] == ["dispatch", "combine"]
            backward = ["combine_backward", "dispatch_backward"]
            if recompute:  # the MoE layer's recomputation dispatches and combines again, inside the backward
                backward = ["dispatch", "combine", *backward]
            assert rec["comms"]["B"] == backward
            assert {side for side, _ in rec["covered"]} == {"F", "B"} and len(rec["covered"]) == 4, rec
    # Pipeline rank 0: stage 0 (the embedding and the dense layer) does not communicate, stage 3 (layer 3, head,
    # MTP) does: the communicating side starts, and its first communication runs under the other side's compute.
    for r in results[:2]:
        for rec in r["records"]:
            talking = "B" if rec["stages"][1] == 3 else "F"
            assert not rec["comms"]["F" if talking == "B" else "B"]
            assert rec["covered"] and rec["covered"][0][0] == talking, rec
    record = results[2]["one_record"]
    summary = summarize([record])
    assert summary["comms"] == len(record.comms()) >= 4 and 0 < summary["comm_hidden_s"] <= summary["comm_in_flight_s"]
    plot_fb(tmp_path / "fb.png", record, "test")
    assert (tmp_path / "fb.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------------------------
# Fallback rules, bad configuration


def _module(*layers):
    return SimpleNamespace(stage=0, moe_layers=list(layers))


def _deepep():
    from moe.layer.dispatcher.flex import FlexDispatcher

    return FlexDispatcher.__new__(FlexDispatcher)  # only its type matters here


def _layer(group_size=2, dispatcher=None, jitter=None):
    dispatcher = _deepep() if dispatcher is None else dispatcher
    return SimpleNamespace(dispatch_group_size=group_size, dispatcher=dispatcher,
                           config=SimpleNamespace(moe_input_jitter_eps=jitter))  # fmt: skip


def test_fallback_rules():
    from moe.layer.dispatcher.etp import ExpertTensorParallelDispatcher

    assert sequential_reason([_module(_layer())]) is None
    # Expert tensor parallelism wraps the 'flex' dispatcher (its begin / end are the inner one's): interleaved too.
    etp = ExpertTensorParallelDispatcher.__new__(ExpertTensorParallelDispatcher)
    etp.inner = _deepep()
    assert sequential_reason([_module(_layer(dispatcher=etp))]) is None
    assert "no expert-parallel communication" in sequential_reason([_module(_layer(group_size=1)), _module()])
    assert "only 'flex'" in sequential_reason([_module(_layer(dispatcher=object()))])
    assert "global random generator" in sequential_reason([_module(_layer(), _layer(jitter=0.01))])


def test_overlap_needs_dualpipev():
    from moe.trainer.pipeline import PipelineRunner
    from moe.trainer.pipeline.split import split_layers

    parallel = SimpleNamespace(layout=SimpleNamespace(pp=2), pp_rank=0, pp_group=None)
    model = SimpleNamespace(lm_head=object())
    with pytest.raises(ValueError, match="overlap_moe_comm overlaps DualPipeV's forward-backward chunks; 1f1b"):
        PipelineRunner(model, parallel, schedule="1f1b", split=split_layers(4, 2), micro_batches=2, micro_rows=1,
                       seq_len=8, mtp_loss_weight=0.1, num_mtp=1, overlap_moe_comm=True)  # fmt: skip
