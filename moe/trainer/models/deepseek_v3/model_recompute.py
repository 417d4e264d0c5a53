"""Activation recompute for `DeepseekV3ForCausalLM`, with Megatron-core's option names and meanings.

`RecomputeConfig` (Megatron's `recompute_granularity`, `recompute_method`, `recompute_num_layers`,
`recompute_modules`) is given to the model (`DeepseekV3ForCausalLM(..., recompute=...)` or
`model.set_recompute(...)`, also after `tensor_parallel.parallelize`).

Granularity 'full': whole decoder layers run under non-reentrant `torch.utils.checkpoint` (only a chunk's input is
kept; the backward runs the chunk's forward again, collectives included: the TP all-gathers / reduce-scatters and
the MoE layer's mtdeepep dispatch and combine). Early stopping of the recomputation is off, so the recomputed
forward always runs to its end and every rank issues the same collectives in the same order.
- method 'uniform': the layers in chunks of `num_layers`, each chunk one checkpoint; every MTP depth is one more
  checkpoint (Megatron allows only chunks of 1 with MTP; here a depth is a chunk of its own whatever `num_layers`).
- method 'block': the first `num_layers` decoder layers each one checkpoint, the others keep their activations;
  the MTP depths are not recomputed (as Megatron, whose 'block' method skips MTP).
The MoE layer inside a recomputed layer runs at recompute level None (the layer's checkpoint already covers it; two
checkpoints of the same MoE layer would run its dispatch three times); the other layers keep their level.

Granularity 'selective': in every layer (MTP depths included), each named module; the MoE layer's levels
(moe/layer/moe_recompute.py) serve where they exist:

    Megatron module   here                                                           MoE layer level
    "core_attn"       softmax(q k^T) v: only q, k, v kept (`recompute_region`)       -
    "mla_up_proj"     q_b_proj / kv_b_proj, the RoPE and the q / k / v assembly      -
                      rebuilt from the normed (and under TP gathered) latents;
                      q, k, v are not kept (output-discarding)
    "layernorm"       input_layernorm and post_attention_layernorm: only their       -
                      input kept, outputs rebuilt (output-discarding)
    "moe_act"         routed experts' SwiGLU (and the router: level 'light'),        'light'
                      the dense SwiGLU MLP's activation
    "shared_experts"  the shared expert checkpointed                                 (part of 'medium')
    "moe"             the whole MoE layer checkpointed                               'full'
    "mlp"             the whole dense MLP checkpointed (TP collectives included)     -
A MoE layer's level is the stronger (None < light < medium < full) of the one its `MoEConfig` asks for and the one
these modules imply. Without a `RecomputeConfig` (or granularity None) the MoE layers keep their configured level.

Output-discarding (Megatron's `CheckpointWithoutOutput`, done here with the MoE layer's saved-tensor hooks,
`moe.layer.moe_recompute.DropSaved`): the region's outputs are registered with the layer's `RecomputeScope`, so the
operations that consume them save a recipe instead of the tensor, rebuilt in backward by running the region again
without autograd (`discard_outputs`). The autograd graph stays the one of no recompute. The norms also run under a
non-reentrant checkpoint (their normalised input is not kept either; a norm then runs three times, which is cheap);
the up projections save only their inputs, so they run twice. "core_attn", "mlp" use `recompute_region`, a
reentrant checkpoint whose inputs go through the same hooks: the core-attention region keeps recipes of the q / k /
v that "mla_up_proj" discards, and the dense MLP region recipes of the norm output "layernorm" discards. Without q
LoRA the rebuild keeps the plain q_proj output (Megatron runs q_proj inside the region and keeps its input).

Recompute runs the same operations on the same inputs, so the results and gradients are bit-identical to no
recompute for deterministic operations (the model has no dropout; the checkpoints restore the RNG state anyway).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moe.layer.moe_recompute import DropSaved

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
MOE_LEVEL_ORDER = (None, "light", "medium", "full")


@dataclass(frozen=True)
class RecomputeConfig:
    """Which activations the model recomputes in backward (Megatron-core's `recompute_*` options).

    granularity: None (keep every activation), 'full' (whole layers) or 'selective' (`modules` in every layer).
    method: for 'full': 'uniform' (chunks of `num_layers` layers) or 'block' (the first `num_layers` layers).
    num_layers: for 'full': the chunk size ('uniform') or the number of recomputed layers ('block'), >= 1 (and at
        most the number of decoder layers, checked by the model); must be None for 'selective'.
    modules: for 'selective': a non-empty subset of `MODULES` (Megatron's default: ("core_attn",)).
    """

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] = field(default=("core_attn",))

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        g = self.granularity
        if g is not None and g not in GRANULARITIES:
            raise ValueError(f"recompute_granularity must be None or one of {GRANULARITIES}, got {g!r}")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"recompute_method must be None or one of {METHODS}, got {self.method!r}")
        bad = sorted(set(self.modules) - set(MODULES))
        if bad:
            raise ValueError(f"recompute_modules: unknown {bad}; choose from {list(MODULES)}")
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"recompute_modules has duplicates: {list(self.modules)}")
        if g == "full":
            if self.method is None:
                raise ValueError("recompute_granularity='full' needs recompute_method 'uniform' or 'block'")
            n = self.num_layers
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"recompute_granularity='full' needs recompute_num_layers >= 1, got {n!r}")
        elif g == "selective":
            if self.num_layers is not None:
                raise ValueError(
                    f"recompute_num_layers must be None with recompute_granularity='selective', got {self.num_layers}"
                )
            if not self.modules:
                raise ValueError("recompute_granularity='selective' needs at least one of recompute_modules")
        elif self.method is not None or self.num_layers is not None:
            raise ValueError("recompute_method / recompute_num_layers need recompute_granularity='full'")

    @property
    def selective(self) -> frozenset[str]:
        """The modules recomputed in every layer (empty unless granularity is 'selective')."""
        return frozenset(self.modules) if self.granularity == "selective" else frozenset()

    def full_chunks(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """The decoder layers as `(start, end, checkpointed)` runs, in order (one run of all, not checkpointed,
        unless granularity is 'full'). ValueError if `num_layers` exceeds the model's layers."""
        if self.granularity != "full":
            return [(0, num_layers, False)] if num_layers else []
        if self.num_layers > num_layers:
            raise ValueError(f"recompute_num_layers={self.num_layers} exceeds the model's {num_layers} decoder layers")
        if self.method == "uniform":
            step = self.num_layers
            return [(s, min(s + step, num_layers), True) for s in range(0, num_layers, step)]
        runs = [(i, i + 1, True) for i in range(self.num_layers)]
        if self.num_layers < num_layers:
            runs.append((self.num_layers, num_layers, False))
        return runs

    @property
    def mtp_checkpointed(self) -> bool:
        """Whether every MTP depth runs under a checkpoint of its own."""
        return self.granularity == "full" and self.method == "uniform"


def stronger_level(a: str | None, b: str | None) -> str | None:
    """The MoE recompute level that recomputes more of the two (None < 'light' < 'medium' < 'full')."""
    return max(a, b, key=MOE_LEVEL_ORDER.index)


def moe_level_for(modules: frozenset[str], configured: str | None) -> str | None:
    """The MoE layer's level under selective `modules` (see the module docstring's table)."""
    implied = "full" if "moe" in modules else "light" if "moe_act" in modules else None
    return stronger_level(configured, implied)


def checkpoint(fn: Callable, *args):
    """`fn(*args)` under non-reentrant `torch.utils.checkpoint` (without early stop: the recomputation runs to the
    end, collectives included) when autograd records; plainly otherwise."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, early_stop=False)


class RecomputeScope(DropSaved):
    """A `DropSaved` scope for one layer's forward: output-discarding regions register their outputs with it.

    The registered outputs are also held until the scope exits: `DropSaved` recognises a saved tensor by its
    storage address, and an output freed inside the scope could hand its address to a new tensor, which would then
    be mistaken for it. After the exit the hooks are off, so the addresses no longer matter.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held: list[torch.Tensor] = []

    def hold(self, tensor: torch.Tensor) -> None:
        self._held.append(tensor)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._held.clear()


class _Region:
    """One region of `recompute_region`: its function, non-tensor arguments, and its recomputation."""

    def __init__(self, fn: Callable, args: Sequence) -> None:
        self.fn = fn
        self.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.args = [None if isinstance(a, torch.Tensor) else a for a in args]


class _RegionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: _Region, *args):
        ctx.save_for_backward(*(args[i] for i in region.tensor_at))  # through the active saved-tensor hooks
        ctx.region = region
        out = region.fn(*args)  # autograd does not record inside a Function's forward
        outs = out if isinstance(out, tuple) else (out,)
        inputs = {args[i].untyped_storage().data_ptr() for i in region.tensor_at if args[i].numel()}
        # An output that aliases an input would be an autograd view of it; regions compute new tensors.
        outs = tuple(o.clone() if o.numel() and o.untyped_storage().data_ptr() in inputs else o for o in outs)
        return outs if isinstance(out, tuple) else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        region: _Region = ctx.region
        needs = ctx.needs_input_grad[1:]
        args = list(region.args)
        inputs = []
        for i, t in zip(region.tensor_at, ctx.saved_tensors):  # unpacking rebuilds inputs discarded elsewhere
            args[i] = t.detach().requires_grad_(needs[i])
            inputs.append((i, args[i]))
        # The inputs' gradients as the inner backward hands them over (a leaf's `.grad` could be a copy in another
        # layout, and a reduction over it, as a norm weight's gradient, could then round differently).
        input_grads: list[torch.Tensor | None] = [None] * len(region.args)
        for i, t in inputs:
            if t.requires_grad:
                t.register_hook(functools.partial(input_grads.__setitem__, i))
        with torch.enable_grad():
            out = region.fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *input_grads)


def recompute_region(fn: Callable, *args):
    """`fn(*args)` keeping only its tensor arguments for backward (saved through the active saved-tensor hooks, so
    an argument another region discards stays a recipe), where `fn` runs again with autograd recording and
    back-propagates (Megatron's `checkpoint`, reentrant). The parameters `fn` uses get their gradients from that
    inner backward. Use it where each tensor argument has a single use inside `fn`: the inner backward sums an
    argument's gradient contributions before autograd adds the outside ones, which with several inside uses would
    change the float summation order. Runs plainly when autograd does not record or no tensor argument requires
    grad (no autograd node would be made, and the parameters inside would get no gradient)."""
    if not torch.is_grad_enabled() or not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn(*args)
    return _RegionFunction.apply(_Region(fn, args), *args)


def discard_outputs(fn: Callable, *args, scope: RecomputeScope, checkpoint_inside: bool = False):
    """`fn(*args)` whose outputs are not kept for backward (Megatron's `CheckpointWithoutOutput`): the operations
    after it inside `scope` save recipes of them, rebuilt in backward by running `fn(*args)` again without autograd.
    `fn` must return new tensors with separate storages and be deterministic, without collectives.

    `checkpoint_inside`: `fn` also runs under non-reentrant `torch.utils.checkpoint`, so the tensors it saves for
    its own backward (other than its arguments) are recomputed too (a norm's normalised input); otherwise it records
    as usual (the MLA up projections save only their arguments). Either way the autograd graph is the one of no
    recompute, so the gradients are bit-identical.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    if checkpoint_inside:
        out = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    else:
        out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    keys = [o.untyped_storage().data_ptr() for o in outs if o.numel()]
    if len(set(keys)) != len(keys):
        raise RuntimeError("discard_outputs: fn must return tensors with separate storages")
    rebuilt: list[tuple[torch.Tensor, ...]] = []

    def rebuild(index: int) -> torch.Tensor:
        if not rebuilt:  # one recomputation serves every output
            again = fn(*args)
            rebuilt.append(again if isinstance(again, tuple) else (again,))
        return rebuilt[0][index]

    for index, o in enumerate(outs):
        scope.hold(o)
        scope.drop(o, functools.partial(rebuild, index))
    return out
