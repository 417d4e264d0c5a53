"""Delayed expert weight gradients, run while the dispatch's backward communication is in flight.

Megatron's `overlap_dispatch_backward_with_experts_wgrad`: the backward of an MoE layer is combine-backward (a
dispatch of the output gradients) -> experts -> dispatch-backward (a combine of the experts' input gradients). The
experts' input gradients are all that dispatch-backward needs, so the expert GEMMs compute them first and queue their
weight-gradient GEMMs; the dispatcher's backward starts its gradient all-to-all, runs the queue while the rows
travel, then waits. With SwiGLU experts two of the four backward GEMMs (FC2 and FC1 weight gradients) move into the
communication window.

Pieces:

- `WeightGradStore`: one per MoE-layer call under autograd (per micro-batch: calls in flight at once never share
  one), holding slots for the expert weights and the queued closures of their weight-gradient GEMMs.
- `deferring(store)`: in this context the expert GEMMs (`moe.experts`, `moe.fp8`, `moe.fp8_training.experts`)
  take their weight's slot at forward time (`slot_for(weight)`); their backward then hands the weight-gradient
  closure to `wgrad_or_defer`, which queues it and returns None as that weight's gradient.
- `run_deferred()`: runs every queued closure of this thread. A dispatcher's backward calls it between starting and
  waiting for its gradient communication ('flex' and 'alltoall' do).
- `WeightGradStore.anchor(x)`: an identity on the dispatcher's input (Megatron places its wgrad hook there too).
  The dispatch's backward consumes the anchored tensor's gradient, so the anchor's backward always runs after it:
  it runs whatever is still queued (a dispatcher that does not call `run_deferred`, one process) and returns the
  summed weight gradients as the gradients of the weights. They reach `.grad` through autograd as without the store
  (AccumulateGrad, accumulation over micro-batches, post-accumulate hooks such as ZeRO's, `torch.autograd.grad`).

Numerics: the queued closures run the GEMMs autograd would run, on the same operands, so gradients are bitwise
those of the undelayed backward. Cost: each queued closure keeps its two operands (the GEMM's input and output
gradient) until it runs, a little after the experts' backward.

Everything is thread-local: the autograd engine runs a CPU backward on the thread that called it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

_local = threading.local()


def _pending() -> list[WeightGradStore]:
    """This thread's stores with queued closures."""
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = []
    return pending


class WeightGradStore:
    """Queued weight-gradient GEMMs of one MoE-layer call, and the gradients they produced.

    Args:
        params: the weights whose gradients may be delayed (the experts' `w13`, `w2`); each is one slot.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = tuple(params)
        self._queue: list[tuple[int, Callable[[], torch.Tensor]]] = []
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)
        self._listed = False

    def index(self, weight: torch.Tensor) -> int | None:
        """The slot of `weight` (by identity), or None if the store does not hold it."""
        return next((i for i, p in enumerate(self.params) if p is weight), None)

    def put(self, index: int, wgrad: Callable[[], torch.Tensor]) -> None:
        """Queue `wgrad()`, whose result is added to slot `index`'s gradient when it runs."""
        self._queue.append((index, wgrad))
        if not self._listed:
            _pending().append(self)
            self._listed = True

    def run(self) -> int:
        """Runs the queued closures in order (gradients of a slot summed in that order); returns how many ran."""
        count = 0
        while self._queue:
            index, wgrad = self._queue.pop(0)
            grad = wgrad()
            previous = self._grads[index]
            self._grads[index] = grad if previous is None else previous + grad
            count += 1
        if self._listed:
            _pending().remove(self)
            self._listed = False
        return count

    def take(self) -> list[torch.Tensor | None]:
        """The slots' gradients (None where nothing ran), emptied."""
        grads, self._grads = self._grads, [None] * len(self.params)
        return grads

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def anchor(self, x: torch.Tensor) -> torch.Tensor:
        """`x` unchanged, through a node whose backward (after every consumer of the result: place it on the
        dispatcher's input) runs what is still queued and returns the slots' gradients to the weights."""
        return _WgradAnchor.apply(self, x, *self.params)


class _WgradAnchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, store: WeightGradStore, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.store = store
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        store, ctx.store = ctx.store, None
        if store is None:
            raise RuntimeError(
                "an MoE layer's delayed weight gradients were already delivered: a second backward through the same "
                "graph (e.g. a split input/weight backward) needs overlap_dispatch_backward_with_experts_wgrad=False"
            )
        store.run()  # what no dispatcher backward ran (none that overlaps, one process, ...)
        grads = store.take()
        for i, (param, grad) in enumerate(zip(store.params, grads)):
            if grad is not None and grad.dtype != param.dtype:
                raise RuntimeError(f"a delayed weight gradient of slot {i} has dtype {grad.dtype}, not {param.dtype}")
        return None, grad_x, *grads


def run_deferred() -> int:
    """Runs every queued weight-gradient closure of this thread (oldest store first); returns how many ran. Called by
    a dispatcher's backward while its gradient communication is in flight."""
    count = 0
    pending = _pending()
    while pending:
        count += pending[0].run()
    return count


@contextlib.contextmanager
def deferring(store: WeightGradStore | None) -> Iterator[None]:
    """Expert GEMMs built in this context delay the weight gradients of `store`'s weights (None: none)."""
    previous = getattr(_local, "current", None)
    _local.current = store
    try:
        yield
    finally:
        _local.current = previous


WgradSlot = tuple[WeightGradStore, int]


def slot_for(weight: torch.Tensor) -> WgradSlot | None:
    """Where a GEMM built now (before its autograd Function's `apply`) queues `weight`'s gradient: the current
    store's slot of `weight`, or None (no store, no autograd recording, or a weight the store does not hold, e.g. a
    copy of some experts' weights)."""
    store = getattr(_local, "current", None)
    if store is None or not (torch.is_grad_enabled() and weight.requires_grad):
        return None
    index = store.index(weight)
    return None if index is None else (store, index)


def wgrad_or_defer(slot: WgradSlot | None, wgrad: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """In a GEMM's backward: `wgrad()` now without a slot; with one, queue it and return None (the weight's gradient
    then comes from the store's anchor)."""
    if slot is None:
        return wgrad()
    store, index = slot
    store.put(index, wgrad)
    return None
