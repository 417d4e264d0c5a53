"""Injected faults, the test hook of rewind and slow-rank detection: a corrupted loss on one rank at one step, or a
delay in one phase of one rank.

The plan comes from the environment variable `MTDEEPEP_TRAIN_FAULTS`, a JSON list of objects (unset: no faults):

    [{"kind": "nan_loss",   "step": 3, "rank": 1},
     {"kind": "nan_grad",   "step": 4, "rank": 0},
     {"kind": "loss_spike", "step": 6, "rank": 0, "factor": 50.0},
     {"kind": "sleep",      "steps": [1, 4], "rank": 2, "phase": "backward", "seconds": 0.05}]

- nan_loss: the rank's first micro-batch loss (its LM loss sum) is multiplied by NaN: the step's loss and
  gradients are NaN.
- nan_grad: the loss stays finite; its gradient is NaN (only the gradient norm shows it).
- loss_spike: the first micro-batch's LM loss sum is multiplied by `factor` (the reported loss and the gradients
  grow with it).
- sleep: `seconds` slept at the end of every occurrence of `phase` (moe/phase_timer.py) on `rank` during steps
  `steps[0]..steps[1]`; needs `log_straggler` (the phases are the timer's).

`rank` is the global rank; `step` the optimizer step (a step that is skipped after a rewind is never run again, so
its fault fires once). Loss faults act in the trainer's micro-batch loop (not under pipeline parallelism, whose
loss is computed inside the schedule).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from moe.phase_timer import PHASES

ENV = "MTDEEPEP_TRAIN_FAULTS"
LOSS_KINDS = ("nan_loss", "nan_grad", "loss_spike")
KINDS = (*LOSS_KINDS, "sleep")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0  # loss faults
    factor: float = 1.0  # loss_spike
    phase: str = ""  # sleep
    seconds: float = 0.0  # sleep
    first: int = 0  # sleep: steps first..last
    last: int = 0

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


class FaultPlan:
    """The faults of a run (see the module docstring)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)

    @classmethod
    def from_env(cls, environ=None) -> FaultPlan | None:
        """The plan in `MTDEEPEP_TRAIN_FAULTS`, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(ENV, "").strip()
        return cls.from_json(text) if text else None

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV}: not JSON ({exc})") from None
        if not isinstance(items, list):
            raise ValueError(f"{ENV}: expected a JSON list of faults, got {type(items).__name__}")
        return cls([_parse(item) for item in items])

    def loss_fault(self, step: int, rank: int) -> Fault | None:
        for f in self.faults:
            if f.kind in LOSS_KINDS and f.step == step and f.rank == rank:
                return f
        return None

    def delays(self, step: int, rank: int) -> dict[str, float]:
        """`{phase: seconds}` this rank sleeps at the end of each occurrence of the phase during `step`."""
        out: dict[str, float] = {}
        for f in self.faults:
            if f.kind == "sleep" and f.rank == rank and f.first <= step <= f.last:
                out[f.phase] = out.get(f.phase, 0.0) + f.seconds
        return out

    @property
    def has_delays(self) -> bool:
        return any(f.kind == "sleep" for f in self.faults)

    @property
    def has_loss_faults(self) -> bool:
        return any(f.kind in LOSS_KINDS for f in self.faults)


def _parse(item: object) -> Fault:
    if not isinstance(item, dict):
        raise ValueError(f"{ENV}: every fault is a JSON object, got {item!r}")
    kind = item.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{ENV}: kind must be one of {KINDS}, got {kind!r}")
    allowed = {"kind", "rank"} | ({"step", "factor"} if kind in LOSS_KINDS else {"steps", "phase", "seconds"})
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ValueError(f"{ENV}: {kind} fault has unknown keys {unknown} (known: {sorted(allowed)})")
    rank = item.get("rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{ENV}: rank must be an int >= 0, got {rank!r}")
    if kind in LOSS_KINDS:
        step = item.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{ENV}: {kind} needs a step >= 1, got {step!r}")
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
