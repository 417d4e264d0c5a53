"""Recompute for the MoE layer: multi-level (light, medium, full) and token-count-triggered (adaptive).

Levels (`MoEConfig.moe_recompute_level`):
- 'light': the router (its logits and scores are recomputed from the input) and the SwiGLU activation (its
  outputs are rebuilt from the FC1 output instead of being kept for FC2's backward). The permuted expert input is
  not recomputed: for the all-to-all dispatchers it is the received buffer itself (nothing to gain), and rebuilding
  it for 'flex' would keep its received rows instead.
- 'medium': light, plus the expert FC1 output (recomputed with one extra FC1 GEMM) and the shared expert.
- 'full': the whole MoE block (`torch.utils.checkpoint`): only its input is kept; the backward runs the block's
  forward again, communication included, so every expert-parallel rank must use it (it is a config setting).

Adaptive (`moe_adaptive_recompute_tokens`): after the dispatch each rank knows how many rows its experts received;
a rank above the threshold recomputes its expert activations (FC1 and activation, as 'medium') in backward, the
others keep them. The decision is local: expert recompute involves no communication, so ranks may differ.

Activation recompute does not re-run the GEMM that consumes a tensor (as `torch.utils.checkpoint` would): saved-
tensor hooks store chosen tensors as a recipe and rebuild them when the backward unpacks them (`DropSaved`).

Selective checkpointing without communicating again: mtdeepep's dispatch and combine are custom ops
(`torch.ops.mtdeepep.dispatch` / `combine`), so `torch.utils.checkpoint` with `context_fn=save_communication_context`
keeps their outputs and recomputes everything else: the recomputation of a 'flex' layer does not communicate, and
the gradients are those of no checkpointing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


class _Recipe:
    """Stands in for a dropped saved tensor: where it sits in the tensor that `DropSaved.rebuild(key)` returns."""

    __slots__ = ("key", "offset", "size", "stride", "dtype")

    def __init__(self, key: int, tensor: torch.Tensor, base_offset: int) -> None:
        self.key = key
        self.offset = tensor.storage_offset() - base_offset
        self.size, self.stride, self.dtype = tensor.shape, tensor.stride(), tensor.dtype


class DropSaved:
    """Saved-tensor hooks that keep chosen tensors (and views of them) as recipes instead of values.

    `drop(tensor, rebuild)` registers a tensor before the operations that save it run; inside `with hooks:` every
    tensor autograd saves whose storage is a registered tensor's is replaced by a `_Recipe`. In backward the first
    unpack calls `rebuild()` (under `no_grad`; it must return the same values, dtype and layout) and later unpacks
    reuse the result. Only the storage address and the rebuild function are kept, never the tensor, so the memory
    is freed as soon as nothing else holds it.
    """

    def __init__(self) -> None:
        self._rebuild: dict[int, Callable[[], torch.Tensor]] = {}
        self._base_offset: dict[int, int] = {}
        self._rebuilt: dict[int, torch.Tensor] = {}
        # Made on entry and dropped on exit: held for longer, the hooks' bound methods would make a reference cycle,
        # and the rebuilt tensors would outlive the backward until the garbage collector ran.
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def drop(self, tensor: torch.Tensor, rebuild: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Registers `tensor`; returns a getter of its rebuilt value (for the rebuild functions of other tensors
        computed from it)."""
        if tensor.numel() == 0:
            return lambda: tensor  # nothing to save, and an empty storage has no meaningful address
        key = tensor.untyped_storage().data_ptr()
        self._rebuild[key] = rebuild
        self._base_offset[key] = tensor.storage_offset()
        return lambda: self._get(key)

    def _get(self, key: int) -> torch.Tensor:
        base = self._rebuilt.get(key)
        if base is None:
            with torch.no_grad():
                base = self._rebuild[key]()
            self._rebuilt[key] = base
        return base

    def _pack(self, tensor: torch.Tensor):
        if tensor.numel() and not isinstance(tensor, torch.nn.Parameter):
            key = tensor.untyped_storage().data_ptr()
            if key in self._rebuild:
                return _Recipe(key, tensor, self._base_offset[key])
        return tensor

    def _unpack(self, packed):
        if not isinstance(packed, _Recipe):
            return packed
        base = self._get(packed.key)
        if base.dtype != packed.dtype:
            raise RuntimeError(f"recompute rebuilt a {base.dtype} tensor for a saved {packed.dtype} one")
        return base.as_strided(packed.size, packed.stride, base.storage_offset() + packed.offset)

    def __enter__(self) -> DropSaved:
        if self._hooks is not None:
            raise RuntimeError("DropSaved is not re-entrant")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)


def checkpointed(enabled: bool, fn: Callable, *args):
    """`fn(*args)`, under non-reentrant `torch.utils.checkpoint` when `enabled` and autograd records."""
    if enabled and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def save_communication_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: save the outputs of mtdeepep's ops (`torch.ops.mtdeepep.dispatch` and
    `combine`, the communication), recompute every other op."""
    if getattr(op, "namespace", None) == "mtdeepep":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


save_communication_context = functools.partial(create_selective_checkpoint_contexts, save_communication_policy)
"""`context_fn` for non-reentrant `torch.utils.checkpoint.checkpoint`: recompute all but the communication."""
