"""Two pieces of work interleaved at their communication points: one computes while the other's data moves.

DeepSeek's DualPipe runs the forward of one micro-batch and the backward of another as one "overlapped forward-
backward" chunk, so that each one's MoE all-to-all (dispatch, combine, and their backwards) is hidden behind the
other's compute. `Interleaver.run(first, second)` does that for two callables ("sides"):

    first:   compute ... start comm A ─┐                        ┌─ wait A ... compute ... start comm C ─┐
    second:                            └─ compute ... start B ──┘                                      └─ wait B ...

A side runs until it has *started* a communication it will wait for, then hands over to the other side, which runs
until it has started one of its own and hands back; the first side then waits (its data has been moving all along)
and goes on. The points where a side may hand over are the in-flight points of the code that communicates
(`mtdeepep.in_flight`, the one seam for "run this while a communication is in flight"):

    with in_flight("dispatch"):           # moe/layer/moe_layer.py: the forward's dispatch / combine
        dispatched = dispatcher.dispatch_end(pending)

and, for the backward's communication inside autograd, mtdeepep's ops (the combine of the dispatch's backward, the
cached dispatch of the combine's backward). Each side registers its hand-over as the in-flight worker of its thread
(`while_in_flight`); on any other thread the points do not hand over.

Why threads: the communication points lie deep in a call stack (an MoE layer inside a decoder layer inside a
pipeline stage's forward, or inside an autograd node of a backward). A thread per side keeps each side's stack
intact, so each side runs exactly the code it runs alone: the same operations in the same order, hence the same
results bit for bit. The threads never run at the same time (one baton), so the program fixes the order of every
collective call of the process; ranks that run the same sides issue them in the same order (an EP group's ranks
run the same stages on the same schedule). Thread-local state (grad mode, saved-tensor hooks, dispatch modes, the
autograd engine's graph task) stays with its side, as it must; process-global state must not be changed by one side
while the other relies on it (the global random generator: see `moe/trainer/pipeline/overlap.py` for what falls back to
running the sides one after the other).

`events` records, per side, when it started and ended, and for every communication when it was started ('issue'),
when the side got the baton back ('resume') and when its wait returned ('done'): the time a communication was in
flight (issue -> done) and the part of it the side was blocked waiting (resume -> done, the exposed part).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mtdeepep.in_flight import while_in_flight, workers

EVENT_KINDS = ("start", "issue", "resume", "done", "end")


@dataclass(frozen=True)
class Event:
    """One point of a side's run. side: the side's name; kind: one of `EVENT_KINDS`; name: the communication
    ('dispatch', 'combine', 'dispatch_backward', 'combine_backward'; '' for 'start' and 'end'); t: seconds of the
    interleaver's clock."""

    side: str
    kind: str
    name: str
    t: float


@dataclass(frozen=True)
class Comm:
    """One communication of a side, from `Interleaver.comms()`: started at `issue`, the side resumed at `resume`
    (the other side ran in between) and its wait returned at `done`; `exposed = done - resume`."""

    side: str
    name: str
    issue: float
    resume: float
    done: float

    @property
    def in_flight(self) -> float:
        return self.done - self.issue

    @property
    def exposed(self) -> float:
        return self.done - self.resume


class _Aborted(BaseException):
    """Unwinds a side whose partner failed (a BaseException: not caught by the side's own `except Exception`)."""


class _Side:
    def __init__(self, owner: Interleaver, name: str) -> None:
        self.owner = owner
        self.name = name

    def hand_over(self) -> None:
        self.owner._hand_over(self)

    def record(self, kind: str, name: str = "") -> None:
        self.owner._record(self.name, kind, name)

    @contextlib.contextmanager
    def in_flight(self, name: str) -> Iterator[None]:
        """This side's in-flight worker (`mtdeepep.in_flight.while_in_flight`): at a communication this side started
        and is about to wait for, hand the baton to the other side and return when it comes back; the events
        'issue', 'resume' and (after the wait) 'done' are recorded."""
        self.record("issue", name)
        self.hand_over()
        self.record("resume", name)
        yield
        self.record("done", name)


def _is_side(worker) -> bool:
    return isinstance(getattr(worker, "__self__", None), _Side)


class Interleaver:
    """Runs two callables interleaved at their communication points (see the module docstring).

    `run(first, second)`: `first` (side `names[0]`) on the calling thread, `second` (side `names[1]`) on a worker
    thread the interleaver keeps (one thread for its lifetime: a new thread per run would rebuild its intra-op
    thread pool each time); side `names[start]` holds the baton first. Returns `(first(), second())`. If a side
    raises, the other is unwound at its next hand-over point and the error is raised here (a side blocked in a
    communication with other ranks waits for that call's own timeout first).

    `interleave=False` runs `first()` then `second()` on the calling thread with the same event records and no
    hand-over: the sequential baseline, same code, for measurements.

    Args:
        names: the two sides' names in the events (default 'F', 'B': a forward and a backward).
        clock: seconds, monotonic (`time.perf_counter`).
        record: keep `events` (cleared at every run).
    """

    def __init__(self, names: tuple[str, str] = ("F", "B"), clock: Callable[[], float] = time.perf_counter,
                 record: bool = True) -> None:  # fmt: skip
        if len(names) != 2 or names[0] == names[1]:
            raise ValueError(f"an interleaver has two sides with different names, got {names!r}")
        self.names = tuple(names)
        self.clock = clock
        self.record = record
        self.events: list[Event] = []
        self._cond = threading.Condition()
        self._turn: str | None = None
        self._finished: set[str] = set()
        self._failed = False
        self._interleaving = False  # False: the sides run one after the other, hand-overs do nothing
        self._sides = {n: _Side(self, n) for n in self.names}
        self._work: tuple[Callable[[], Any], bool] | None = None  # the worker's next callable, grad mode
        self._outcome: tuple[bool, Any] | None = None  # the worker's (ok, result or exception)
        self._worker: threading.Thread | None = None
        self._closed = False

    # -- running ------------------------------------------------------------------------------------------------

    def run(self, first: Callable[[], Any], second: Callable[[], Any], *, interleave: bool = True,
            start: int = 0) -> tuple[Any, Any]:  # fmt: skip
        if any(_is_side(worker) for worker in workers()):
            raise RuntimeError("Interleaver.run inside a side of an interleaver: sides do not nest")
        self.events = []
        a, b = (self._sides[n] for n in self.names)
        self._interleaving = interleave
        if not interleave:
            return self._run_on_this_thread(a, first), self._run_on_this_thread(b, second)
        if self._closed:
            raise RuntimeError("the interleaver is closed")
        if start not in (0, 1):
            raise ValueError(f"start must be 0 (the first side) or 1 (the second), got {start!r}")
        self._start_worker()
        with self._cond:
            self._turn, self._finished, self._failed = self.names[start], set(), False
            self._outcome = None
            self._work = (second, torch.is_grad_enabled())
            self._cond.notify_all()
        ok_a, value_a = self._run_side(a, first)
        with self._cond:  # the worker reports when its side ended (normally or not)
            while self._outcome is None:
                self._cond.wait()
            ok_b, value_b = self._outcome
            self._outcome = None
        for ok, value in ((ok_a, value_a), (ok_b, value_b)):
            if not ok and not isinstance(value, _Aborted):
                raise value
        return value_a, value_b

    def close(self) -> None:
        """Stops the worker thread (it also ends with the process: a daemon)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def comms(self) -> list[Comm]:
        """The recorded communications of the last run, in the order they were started."""
        return comms_of(self.events)

    # -- internals ----------------------------------------------------------------------------------------------

    def _record(self, side: str, kind: str, name: str) -> None:
        if self.record:
            self.events.append(Event(side, kind, name, self.clock()))

    def _run_on_this_thread(self, side: _Side, fn: Callable[[], Any]) -> Any:
        side.record("start")
        with while_in_flight(side.in_flight):
            result = fn()
        side.record("end")
        return result

    def _run_side(self, side: _Side, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Waits for the baton, runs `fn` as `side`, then passes the baton on for good."""
        try:
            with self._cond:
                while self._turn != side.name:
                    self._cond.wait()
            if self._failed:
                raise _Aborted()
            return True, self._run_on_this_thread(side, fn)
        except BaseException as exc:  # noqa: BLE001 - reported to run(), which raises it
            with self._cond:
                self._failed = True
            return False, exc
        finally:
            with self._cond:
                self._finished.add(side.name)
                self._turn = self._other(side.name)
                self._cond.notify_all()

    def _hand_over(self, side: _Side) -> None:
        if not self._interleaving:
            return
        other = self._other(side.name)
        with self._cond:
            if other in self._finished:
                if self._failed:
                    raise _Aborted()
                return  # nothing else to run: just wait for the communication
            self._turn = other
            self._cond.notify_all()
            while self._turn != side.name:
                self._cond.wait()
            if self._failed:
                raise _Aborted()

    def _other(self, name: str) -> str:
        return self.names[1] if name == self.names[0] else self.names[0]

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._worker_main, name="interleave-" + self.names[1], daemon=True)
            self._worker.start()

    def _worker_main(self) -> None:
        side = self._sides[self.names[1]]
        while True:
            with self._cond:
                while self._work is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                fn, grad_enabled = self._work
                self._work = None
            with torch.set_grad_enabled(grad_enabled):  # grad mode is per thread: the caller's
                outcome = self._run_side(side, fn)
            with self._cond:
                self._outcome = outcome
                self._cond.notify_all()


def comms_of(events: list[Event]) -> list[Comm]:
    """The communications in `events` (issue, resume, done of each), in the order they were started."""
    open_: dict[tuple[str, str], list[float]] = {}
    out: list[Comm] = []
    for e in events:
        key = (e.side, e.name)
        if e.kind == "issue":
            open_[key] = [e.t]
        elif e.kind == "resume" and key in open_:
            open_[key].append(e.t)
        elif e.kind == "done" and key in open_ and len(open_[key]) == 2:
            issue, resume = open_.pop(key)
            out.append(Comm(e.side, e.name, issue, resume, e.t))
    return sorted(out, key=lambda c: c.issue)


def compute_spans(events: list[Event], side: str) -> list[tuple[float, float]]:
    """When `side` held the baton and was not waiting for a communication: from its start or a 'done' (its wait
    returned) to the next 'issue' (it handed over) or its end. `[(start, end)]` in time order."""
    spans: list[tuple[float, float]] = []
    begin = None
    for e in events:
        if e.side != side:
            continue
        if e.kind in ("start", "done"):
            begin = e.t
        elif e.kind in ("issue", "end") and begin is not None:
            spans.append((begin, e.t))
            begin = None
    return spans
