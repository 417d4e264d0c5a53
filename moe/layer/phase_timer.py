"""Per-rank wall time of the phases of a training step, for slow-rank detection (moe/trainer/train/straggler.py).

Phases:
    forward     forward compute (the model's forward, or a pipeline stage's F action)
    backward    backward compute (loss.backward(), a pipeline stage's B / I / W action, the experts' deferred
                weight-gradient GEMMs)
    dispatch    the MoE dispatch: `dispatch_begin` + `dispatch_end` in the forward, the dispatch's backward (a
                combine of the gradients) in the backward
    combine     the MoE combine: `combine_begin` + `combine_end` in the forward, its backward (a dispatch of the
                gradients)
    grad_sync   the data-parallel gradient reduction the optimizer waits for, and the global gradient norm (its
                all-reduce over the world is where every rank waits for a late one)
    optimizer   clipping and the AdamW step (ZeRO-1: with its parameter all-gather)
    p2p         a pipeline schedule's step outside its compute actions: the sends, receives and their waits

Time is *exclusive*: a phase entered inside another (a dispatch inside the forward) stops the outer one's clock
until it ends, so the forward's figure is compute and the dispatch's is communication. That is what makes a slow rank
stand out: ranks that wait for a late peer wait inside a communication phase (dispatch, combine, grad_sync, p2p),
so their compute phases stay normal while the late rank's compute phase is long. Collectives outside these phases
(tensor-parallel all-gathers, the balancing losses' all-reduces) count in the phase around them.

Cost: two `time.perf_counter()` calls and a list update per `push`/`pop` (about a microsecond; `events` counts
them, so a run can state what the timer cost). Nothing is timed when no timer is attached (the MoE layers and the
pipeline runner take `None`).

The timer is one object per rank, handed explicitly to what it times: `Trainer` builds it and gives it to the MoE
layers (`MoELayer.set_phase_timer`, which gives it to the dispatcher for the backward) and the pipeline runner.
"""

from __future__ import annotations

import threading
import time

import torch

PHASES = ("forward", "backward", "dispatch", "combine", "grad_sync", "optimizer", "p2p")
COMPUTE_PHASES = ("forward", "backward", "optimizer")


class PhaseTimer:
    """Exclusive wall seconds per phase of this rank, accumulated until `take()`.

    `push(phase)` enters a phase (pausing the current one), `pop(phase)` leaves it (resuming the one below);
    `phase(name)` is the context manager of the pair. Time outside every phase is not counted.

    delays: test hook: `{phase: seconds}` slept at the end of every occurrence of the phase (inside it), to make
        this rank slow in that phase.
    """

    def __init__(self, delays: dict[str, float] | None = None) -> None:
        self._index = {p: i for i, p in enumerate(PHASES)}
        self.totals = [0.0] * len(PHASES)
        self.events = 0  # push and pop calls since the last take()
        self.mismatches = 0  # pops that did not match the innermost phase (a bracketing bug; counted, not raised)
        # One stack of open phases per thread: DualPipeV's overlapped chunks run two micro-batches on two threads
        # that take turns (moe/layer/interleave.py), handing over right after starting a communication (a push). The
        # time since the last push/pop therefore belongs to the calling thread's innermost phase (it has been running
        # since the other thread's last event), and the two sides' phases never unwind each other.
        self._stacks: dict[int, list[int]] = {}
        self._last = 0.0
        self.delays: dict[int, float] = {}
        self.set_delays(delays or {})

    def set_delays(self, delays: dict[str, float]) -> None:
        """Replace the test hook's delays: `{phase: seconds}` (empty: none)."""
        out = {}
        for phase, seconds in delays.items():
            self._check(phase)
            if not seconds >= 0:
                raise ValueError(f"delay of phase {phase!r} must be >= 0 seconds, got {seconds!r}")
            out[self._index[phase]] = float(seconds)
        self.delays = out

    def _check(self, phase: str) -> None:
        if phase not in self._index:
            raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")

    def push(self, phase: str) -> None:
        """Enter `phase` (nested inside the current one, whose clock stops)."""
        stack = self._stacks.setdefault(threading.get_ident(), [])
        self._credit(time.perf_counter(), stack)
        stack.append(self._index[phase])
        self.events += 1

    def pop(self, phase: str) -> None:
        """Leave `phase` (the innermost one); the enclosing phase's clock runs again."""
        index = self._index[phase]
        delay = self.delays.get(index) if self.delays else None
        if delay:
            time.sleep(delay)
        self.events += 1
        stack = self._stacks.setdefault(threading.get_ident(), [])
        self._credit(time.perf_counter(), stack)
        if stack and stack[-1] == index:
            stack.pop()
        else:
            # Not the innermost phase: a bracketing bug somewhere. Unwind to it if it is open, else ignore the pop.
            self.mismatches += 1
            if index in stack:
                del stack[len(stack) - 1 - stack[::-1].index(index) :]
        if not stack:  # a finished thread leaves nothing behind
            self._stacks.pop(threading.get_ident(), None)

    def _credit(self, now: float, stack: list[int]) -> None:
        """Add the time since the last push/pop to the innermost phase of `stack` (the calling thread's)."""
        if stack:
            self.totals[stack[-1]] += now - self._last
        self._last = now

    def phase(self, name: str) -> _Phase:
        """`with timer.phase("forward"): ...`"""
        self._check(name)
        return _Phase(self, name)

    @property
    def depth(self) -> int:
        """Open phases of the calling thread."""
        return len(self._stacks.get(threading.get_ident(), ()))

    def take(self) -> tuple[list[float], int, int]:
        """`(seconds per phase in PHASES order, events, mismatches)` since the last take; resets them (the phases
        open now keep running: only their time so far is in this take)."""
        self._credit(time.perf_counter(), self._stacks.get(threading.get_ident(), []))
        out = (list(self.totals), self.events, self.mismatches)
        self.totals = [0.0] * len(PHASES)
        self.events = self.mismatches = 0
        return out


class _Phase:
    __slots__ = ("timer", "name")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.timer.push(self.name)

    def __exit__(self, *exc) -> bool:
        self.timer.pop(self.name)
        return False


class _NullPhase:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


NULL_PHASE = _NullPhase()


def phase(timer: PhaseTimer | None, name: str):
    """`timer.phase(name)`, or a no-op context when there is no timer."""
    return NULL_PHASE if timer is None else _Phase(timer, name)


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward enters (`enter=True`) or leaves a phase: placed on the output and on the input of a
    differentiable operation, the pair brackets that operation's backward (the engine runs a CPU graph in one thread,
    highest sequence number first, so nothing created outside the operation runs between the two marks but work
    recorded after it in the forward, which is never a phase)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, timer: PhaseTimer, name: str, enter: bool) -> torch.Tensor:
        ctx.timer, ctx.name, ctx.enter = timer, name, enter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.enter:
            ctx.timer.push(ctx.name)
        else:
            ctx.timer.pop(ctx.name)
        return grad, None, None, None


def mark_backward(x: torch.Tensor, timer: PhaseTimer | None, name: str, *, enter: bool) -> torch.Tensor:
    """`x` unchanged; when `timer` is set and autograd records `x`, its backward enters (or leaves) phase `name`.
    Use `enter=False` on an operation's input and `enter=True` on its output."""
    if timer is None or not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _BackwardMark.apply(x, timer, name, enter)
