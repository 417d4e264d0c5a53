"""Injected faults, the test hook of rewind, slow-rank detection and crash recovery: one plan, read from the
environment, injected at named hook points of the trainer's components.

The plan comes from the environment variable `MTDEEPEP_TRAIN_FAULTS`, a JSON list of objects (unset: no faults):

    [{"kind": "nan_loss",      "step": 3, "rank": 1},
     {"kind": "nan_grad",      "step": 4, "rank": 0},
     {"kind": "loss_spike",    "step": 6, "rank": 0, "factor": 50.0},
     {"kind": "sleep",         "steps": [1, 4], "rank": 2, "phase": "backward", "seconds": 0.05},
     {"kind": "kill_at_step",  "step": 6, "rank": 1},
     {"kind": "kill_in_write", "step": 8, "rank": 0},
     {"kind": "pause_in_write", "step": 4, "rank": 2, "seconds": 20}]

- nan_loss: the rank's first micro-batch loss (its LM loss sum) is multiplied by NaN: the step's loss and
  gradients are NaN.
- nan_grad: the loss stays finite; its gradient is NaN (only the gradient norm shows it).
- loss_spike: the first micro-batch's LM loss sum is multiplied by `factor` (the reported loss and the gradients
  grow with it).
- sleep: `seconds` slept at the end of every occurrence of `phase` (moe/layer/phase_timer.py) on `rank` during steps
  `steps[0]..steps[1]`; needs `log_straggler` (the phases are the timer's).
- kill_at_step: the rank SIGKILLs itself when optimizer step `step` is about to start, once its pending checkpoint
  write has finished (so the checkpoint before the step is on disk and the run dies in training).
- kill_in_write: the rank SIGKILLs itself in the middle of writing its shard of the checkpoint of step `step`
  (half of its sharded bytes written).
- pause_in_write: the rank's checkpoint writer stops for `seconds` halfway through its shard of step `step`, once,
  after printing "fault injection: pause ..." (a test cuts the host off the network meanwhile).
SIGKILL runs no handler, no `finally` and no atexit: what is on disk is what a real crash leaves.

`MTDEEPEP_CRASH_FAULT=KIND:RANK:STEP` (e.g. `kill_at_step:1:6`) is the older spelling of one kill fault; it is
added to the same plan.

`rank` is the global rank; `step` the optimizer step (a step that is skipped after a rewind is never run again, so
its fault fires once). Loss faults act in the trainer's micro-batch loop (not under pipeline parallelism, whose
loss is computed inside the schedule).

Hook points (`FaultPlan.at(point, step=, rank=, ...)`, each kind acts at one of them):
- "step_start" (sleep): `timer=` the rank's `PhaseTimer`, given the step's delays.
- "before_step" (kill_at_step): `drain=` called before the kill (waits for the pending checkpoint write).
- "loss" (nan_loss, nan_grad, loss_spike): `value=` the first micro-batch's LM loss sum; returns it, corrupted.
- "checkpoint_write" (kill_in_write, pause_in_write): `written=`, `total=` bytes of the rank's shard, `what=` for
  the message.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from moe.layer.phase_timer import PHASES

ENV = "MTDEEPEP_TRAIN_FAULTS"
CRASH_ENV = "MTDEEPEP_CRASH_FAULT"
LOSS_KINDS = ("nan_loss", "nan_grad", "loss_spike")
KILL_KINDS = ("kill_at_step", "kill_in_write")
KINDS = (*LOSS_KINDS, "sleep", *KILL_KINDS, "pause_in_write")
POINT = {"nan_loss": "loss", "nan_grad": "loss", "loss_spike": "loss", "sleep": "step_start",
         "kill_at_step": "before_step", "kill_in_write": "checkpoint_write",
         "pause_in_write": "checkpoint_write"}  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring)."""

    kind: str
    rank: int
    step: int = 0  # loss and kill faults
    factor: float = 1.0  # loss_spike
    phase: str = ""  # sleep
    seconds: float = 0.0  # sleep, pause_in_write
    first: int = 0  # sleep: steps first..last
    last: int = 0

    @property
    def point(self) -> str:
        """The hook point where it acts."""
        return POINT[self.kind]

    def fires(self, step: int, rank: int) -> bool:
        """Whether it acts on `rank` during `step`."""
        if rank != self.rank:
            return False
        return self.first <= step <= self.last if self.kind == "sleep" else step == self.step

    def apply(self, lm_loss_sum: torch.Tensor) -> torch.Tensor:
        """The corrupted LM loss sum of a loss fault (0-d)."""
        if self.kind == "nan_loss":
            return lm_loss_sum * math.nan
        if self.kind == "loss_spike":
            return lm_loss_sum * self.factor
        return _NanGrad.apply(lm_loss_sum)


class _NanGrad(torch.autograd.Function):
    """Identity whose backward returns NaN."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, math.nan)


def kill_self(what: str) -> None:
    """SIGKILL this process (a crash: nothing runs after it)."""
    print(f"fault injection: SIGKILL {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class FaultPlan:
    """The faults of a run (see the module docstring); an empty plan injects nothing."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = ()) -> None:
        self.faults = list(faults)
        self._paused: set[Fault] = set()  # pause_in_write faults that have fired (each pauses once)

    @classmethod
    def from_env(cls, environ=None) -> FaultPlan | None:
        """The plan of `MTDEEPEP_TRAIN_FAULTS` and `MTDEEPEP_CRASH_FAULT`, or None when both are unset or empty."""
        environ = os.environ if environ is None else environ
        text, crash = environ.get(ENV, "").strip(), environ.get(CRASH_ENV, "").strip()
        if not text and not crash:
            return None
        plan = cls.from_json(text) if text else cls()
        if crash:
            plan.faults.append(parse_crash(crash))
        return plan

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV}: not JSON ({exc})") from None
        if not isinstance(items, list):
            raise ValueError(f"{ENV}: expected a JSON list of faults, got {type(items).__name__}")
        return cls([_parse(item) for item in items])

    def at(self, point: str, *, step: int, rank: int, **context: Any) -> Any:
        """Inject the faults of hook point `point` that fire on `rank` during `step` (see the module docstring for
        each point's `context`); returns the "loss" point's `value` (corrupted or not), else None."""
        if point not in POINT.values():
            raise ValueError(f"unknown fault hook point {point!r}")
        fired = [f for f in self.faults if f.point == point and f.fires(step, rank)]
        if point == "loss":
            return fired[0].apply(context["value"]) if fired else context["value"]
        if point == "step_start" and context["timer"] is not None:
            delays: dict[str, float] = {}
            for f in fired:
                delays[f.phase] = delays.get(f.phase, 0.0) + f.seconds
            context["timer"].set_delays(delays)
        if point == "before_step" and fired:
            context["drain"]()
            kill_self(f"rank {rank} before step {step}")
        halfway = point == "checkpoint_write" and context["written"] >= context["total"] // 2
        for fault in [f for f in fired if f.kind == "pause_in_write" and halfway and f not in self._paused]:
            self._paused.add(fault)
            print(f"fault injection: pause rank {rank} writing {context['what']} of step {step} for "
                  f"{fault.seconds:g} s", file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(fault.seconds)
        if halfway and any(f.kind == "kill_in_write" for f in fired):
            kill_self(f"rank {rank} writing {context['what']} of step {step} ({context['written']} of about "
                      f"{context['total']} bytes of its shard written)")  # fmt: skip
        return None

    @property
    def has_delays(self) -> bool:
        return any(f.kind == "sleep" for f in self.faults)

    @property
    def has_loss_faults(self) -> bool:
        return any(f.kind in LOSS_KINDS for f in self.faults)


def parse_crash(text: str) -> Fault:
    """A kill fault in the `MTDEEPEP_CRASH_FAULT` spelling `KIND:RANK:STEP`."""
    parts = text.strip().split(":")
    if len(parts) != 3 or parts[0] not in KILL_KINDS or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{CRASH_ENV}={text!r}: expected one of {KILL_KINDS} as KIND:RANK:STEP, e.g. "
                         "kill_at_step:1:6")  # fmt: skip
    return Fault(parts[0], int(parts[1]), step=int(parts[2]))


def _parse(item: object) -> Fault:
    if not isinstance(item, dict):
        raise ValueError(f"{ENV}: every fault is a JSON object, got {item!r}")
    kind = item.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{ENV}: kind must be one of {KINDS}, got {kind!r}")
    allowed = {"kind", "rank"} | {"loss_spike": {"step", "factor"}, "sleep": {"steps", "phase", "seconds"}}.get(
        kind,
        {"step"} if kind in KILL_KINDS else {"step", "seconds"} if kind == "pause_in_write" else {"step", "factor"},
    )
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ValueError(f"{ENV}: {kind} fault has unknown keys {unknown} (known: {sorted(allowed)})")
    rank = item.get("rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{ENV}: rank must be an int >= 0, got {rank!r}")
    if kind != "sleep":
        step = item.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{ENV}: {kind} needs a step >= 1, got {step!r}")
        if kind == "pause_in_write":
            seconds = item.get("seconds")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 600:
                raise ValueError(f"{ENV}: pause_in_write seconds must be in [0, 600], got {seconds!r}")
            return Fault(kind, rank, step=step, seconds=float(seconds))
        factor = item.get("factor", 1.0 if kind != "loss_spike" else None)
        if kind == "loss_spike" and (not isinstance(factor, (int, float)) or not math.isfinite(factor)):
            raise ValueError(f"{ENV}: loss_spike needs a finite factor, got {factor!r}")
        return Fault(kind, rank, step=step, factor=float(factor))
    steps, phase, seconds = item.get("steps"), item.get("phase"), item.get("seconds")
    ints = isinstance(steps, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
    if not ints or len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
        raise ValueError(f"{ENV}: sleep needs steps [first, last] with 1 <= first <= last, got {steps!r}")
    if phase not in PHASES:
        raise ValueError(f"{ENV}: sleep phase must be one of {PHASES}, got {phase!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 60:
        raise ValueError(f"{ENV}: sleep seconds must be in [0, 60], got {seconds!r}")
    return Fault(kind, rank, phase=phase, seconds=float(seconds), first=steps[0], last=steps[1])
