"""Per-module FP8 state of the delayed recipe: one amax history per operand role (input, weight, grad-output).

`AmaxHistory.scale_for(x)` is what one cast of a role does: it takes `x`'s amax (max-reduced over `tp_group`, so all
tensor-parallel ranks agree on one scale, as Transformer Engine reduces amaxes over its amax-reduction group),
returns the scale computed from the history *before* this step, and then records the amax. The history is a
buffer of the module's Python object, not a parameter or a state-dict entry: model state dicts stay identical with
and without FP8. The training checkpoints save it per rank (`delayed_states` names every site; `AmaxHistory.state`
/ `load_state`), so a resumed FP8-delayed run scales exactly as the uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe.layer.fp8.cast import amax_to_scale
from moe.layer.fp8.recipe import DelayedScaling

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

    def state(self) -> tuple[torch.Tensor, int]:
        """`(history [amax_history_len] float32 (a copy), number of amaxes recorded so far)`."""
        return self.history.detach().clone(), self.num_recorded

    def load_state(self, history: torch.Tensor, num_recorded: int) -> None:
        """Restore what `state` returned (ValueError for a history of another length or a negative count)."""
        if tuple(history.shape) != (self.recipe.amax_history_len,):
            raise ValueError(
                f"amax history of shape {tuple(history.shape)}, the recipe keeps {self.recipe.amax_history_len}"
            )
        if int(num_recorded) < 0:
            raise ValueError(f"num_recorded must be >= 0, got {num_recorded}")
        self.history = history.detach().to(device=self.history.device, dtype=torch.float32).clone()
        self.num_recorded = int(num_recorded)


class DelayedState:
    """The three amax histories of one FP8 GEMM site (a Linear, or one grouped expert GEMM)."""

    def __init__(self, recipe: DelayedScaling, tp_group: dist.ProcessGroup | None = None) -> None:
        self.input = AmaxHistory(recipe, tp_group)
        self.weight = AmaxHistory(recipe, tp_group)
        self.grad_output = AmaxHistory(recipe, tp_group)


def delayed_states(model: nn.Module) -> dict[str, DelayedState]:
    """Every delayed-scaling GEMM site of `model` by a name stable across runs of the same model:
    `<module>.linear_fn` (a Linear's `Fp8LinearFn`), `<module>.linear_fns.<w13|w2>` (a SwiGLU MLP's),
    `<module>.fp8_casters.<fc1|fc2>` (grouped experts'). Empty without FP8 or under the block-wise recipe."""
    out: dict[str, DelayedState] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        sites = []
        if getattr(module, "linear_fn", None) is not None:
            sites.append(("linear_fn", module.linear_fn))
        for attr in ("linear_fns", "fp8_casters"):
            table = getattr(module, attr, None)
            if isinstance(table, dict):
                sites += [(f"{attr}.{key}", obj) for key, obj in table.items()]
        for site, obj in sites:
            delayed = getattr(getattr(obj, "caster", obj), "delayed", None)
            if isinstance(delayed, DelayedState):
                out[prefix + site] = delayed
    return out
