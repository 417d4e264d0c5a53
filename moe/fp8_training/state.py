"""Per-module FP8 state of the delayed recipe: one amax history per operand role (input, weight, grad-output).

`AmaxHistory.scale_for(x)` is what one cast of a role does: it takes `x`'s amax (max-reduced over `tp_group`, so all
tensor-parallel ranks agree on one scale, as Transformer Engine reduces amaxes over its amax-reduction group),
returns the scale computed from the history *before* this step, and then records the amax. The history is a
buffer of the module's Python object, not a parameter or a state-dict entry: checkpoints stay identical with and
without FP8 (a resumed run starts a fresh history, i.e. its first step scales from the current amax again).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.fp8_training.cast import amax_to_scale
from moe.fp8_training.recipe import DelayedScaling

ROLES = ("input", "weight", "grad_output")


class AmaxHistory:
    """The last `recipe.amax_history_len` amaxes of one operand role, newest first (`history[0]`).

    Args:
        recipe: the delayed-scaling settings (history length, margin, 'max' or 'most_recent').
        tp_group: the tensor-parallel group whose ranks must share the scale (None: this rank only).
    """

    def __init__(self, recipe: DelayedScaling, tp_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(recipe, DelayedScaling):
            raise ValueError(f"AmaxHistory needs a DelayedScaling recipe, got {type(recipe).__name__}")
        self.recipe = recipe
        self.tp_group = tp_group
        self.history = torch.zeros(recipe.amax_history_len, dtype=torch.float32)
        self.num_recorded = 0

    def current_amax(self, x: torch.Tensor) -> torch.Tensor:
        """`max|x|` in float32 (0-d), max-reduced over `tp_group`."""
        amax = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.tp_group)
        return amax

    def history_amax(self) -> torch.Tensor | None:
        """The amax the next scale comes from ('max' over the recorded steps or the newest one); None before the
        first record."""
        if self.num_recorded == 0:
            return None
        if self.recipe.amax_compute_algo == "most_recent":
            return self.history[0].clone()
        return self.history[: min(self.num_recorded, self.history.numel())].max()

    def record(self, amax: torch.Tensor) -> None:
        """Push `amax` as the newest entry (the oldest falls off)."""
        self.history = torch.roll(self.history.to(amax.device), 1)
        self.history[0] = amax
        self.num_recorded += 1

    @torch.no_grad()
    def scale_for(self, x: torch.Tensor) -> torch.Tensor:
        """The FP32 scale to cast `x` with this step (from the history; from `x`'s own amax on the first step),
        then records `x`'s amax."""
        amax = self.current_amax(x)
        used = self.history_amax()
        scale = amax_to_scale(amax if used is None else used.to(amax.device), self.recipe.margin)
        self.record(amax)
        return scale


class DelayedState:
    """The three amax histories of one FP8 GEMM site (a Linear, or one grouped expert GEMM)."""

    def __init__(self, recipe: DelayedScaling, tp_group: dist.ProcessGroup | None = None) -> None:
        self.input = AmaxHistory(recipe, tp_group)
        self.weight = AmaxHistory(recipe, tp_group)
        self.grad_output = AmaxHistory(recipe, tp_group)
