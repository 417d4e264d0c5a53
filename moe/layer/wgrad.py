"""Delayed expert weight gradients, run while the dispatch's backward communication is in flight.

Megatron's `overlap_dispatch_backward_with_experts_wgrad`: the backward of an MoE layer is combine-backward (a
dispatch of the output gradients) -> experts -> dispatch-backward (a combine of the experts' input gradients). The
experts' input gradients are all that dispatch-backward needs, so the expert GEMMs compute them first and queue their
weight-gradient GEMMs; the dispatcher's backward starts its gradient all-to-all, runs the queue while the rows
travel, then waits: the queue is work for the next in-flight point of the thread (`mtdeepep.in_flight`, the one
seam for "run this while a communication is in flight"), which the dispatch's backward marks. With SwiGLU experts
two of the four backward GEMMs (FC2 and FC1 weight gradients) move into the communication window.

Pieces:

- `WeightGradStore`: one per MoE-layer call under autograd (per micro-batch: calls in flight at once never share
  one), holding slots for the expert weights and the queued closures of their weight-gradient GEMMs. Its first
  queued closure queues the store's `run` at the thread's next in-flight point (`run_at_next_in_flight`).
- `deferring(store)`: in this context the expert GEMMs (`moe.layer.experts`, `moe.layer.fp8.grouped`)
  take their weight's slot at forward time (`slot_for(weight)`); their backward then hands the weight-gradient
  closure to `wgrad_or_defer`, which queues it and returns None as that weight's gradient.
- The in-flight point: the dispatch's backward starts its gradient communication, then `with in_flight(name):` waits
  for it, and the stores queued on this thread run (oldest first) on entering. 'flex' (mtdeepep's op, whose
  backward sees the queued work and starts its combine asynchronously) and 'alltoall' mark it.
- `WeightGradStore.anchor(x)`: an identity on the dispatcher's input (Megatron places its wgrad hook there too).
  The dispatch's backward consumes the anchored tensor's gradient, so the anchor's backward always runs after it:
  it runs whatever is still queued (a dispatcher that marks no in-flight point, one process) and returns the
  summed weight gradients as the gradients of the weights. They reach `.grad` through autograd as without the store
  (AccumulateGrad, accumulation over micro-batches, post-accumulate hooks such as ZeRO's, `torch.autograd.grad`).

Numerics: the queued closures run the GEMMs autograd would run, on the same operands, so gradients are bitwise
those of the undelayed backward. Cost: each queued closure keeps its two operands (the GEMM's input and output
gradient) until it runs, a little after the experts' backward.

Everything is thread-local: the autograd engine runs a CPU backward on the thread that called it. `timer` (the MoE
layer's `PhaseTimer`) times the closures run at an in-flight point as 'backward' compute inside the dispatch's
backward communication phase.

The second use: the pipeline's split backward (zero-bubble schedules' I and W actions; see the section "Pipeline
I / W split" below). There a GEMM's weight gradient leaves autograd altogether: it is queued during the I action's
ordinary backward and added to `weight.grad` by the W action.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from moe.layer.modules import ModuleReplacements
from moe.layer.phase_timer import PhaseTimer, phase
from mtdeepep.in_flight import run_at_next_in_flight, withdraw
from mtdeepep.utils.thread_local import thread_local_setting

_local = threading.local()


class WeightGradStore:
    """Queued weight-gradient GEMMs of one MoE-layer call, and the gradients they produced.

    Args:
        params: the weights whose gradients may be delayed (the experts' `w13`, `w2`); each is one slot.
        timer: times the closures run at an in-flight point as 'backward' (None: untimed).
    """

    def __init__(self, params: Sequence[torch.Tensor], timer: PhaseTimer | None = None) -> None:
        self.params = tuple(params)
        self.timer = timer
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
            run_at_next_in_flight(self._run_in_flight)
            self._listed = True

    def _run_in_flight(self) -> int:
        """`run`, timed as 'backward' compute: what the in-flight point of the dispatch's backward calls."""
        with phase(self.timer, "backward"):
            return self.run()

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
            withdraw(self._run_in_flight)
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


@contextlib.contextmanager
def deferring(store: WeightGradStore | None) -> Iterator[None]:
    """Expert GEMMs built in this context delay the weight gradients of `store`'s weights (None: none)."""
    with thread_local_setting(_local, "current", store):
        yield


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


def wgrad_or_defer(
    slot: WgradSlot | None, wgrad: Callable[[], torch.Tensor], split_weight: torch.Tensor | None = None
) -> torch.Tensor | None:
    """In a GEMM's backward: with a slot, queue `wgrad` there and return None (the weight's gradient then comes from
    the store's anchor); else with `split_weight` (`split_weight_of`, taken at forward time) `defer_or_run`; else
    `wgrad()` now."""
    if slot is not None:
        store, index = slot
        store.put(index, wgrad)
        return None
    if split_weight is not None:
        return defer_or_run(split_weight, wgrad)
    return wgrad()


# -- Pipeline I / W split ---------------------------------------------------------------------------------------------
#
# Zero-bubble schedules (ZB-H1, DualPipeV) split a stage's backward into I (the input gradient, sent upstream at
# once) and W (the weight gradients, run later in a bubble). torch's own split (`stage_backward_input` then
# `stage_backward_weight`) walks the autograd graph twice, once per parameter group for W: measured on CPU at
# 1.13-1.41x one fused backward (bench/pipeline.py; the issue 12 notes), which eats the bubble it saves. As in the
# zero-bubble paper's and DualPipe's `WeightGradStore`, here the I action is one ordinary backward in which each
# GEMM of a weight computes its input gradient and queues its weight-gradient GEMM; the W action runs the queue. I +
# W do exactly the work of one backward, and the queued GEMMs are the ones autograd would run on the same operands,
# so the gradients are those of the fused backward up to the order of the per-micro-batch sums.
#
#   forward (F) and I: inside `split_gemms()`, GEMMs of leaf weights are built as `_SplitLinear` / the experts'
#                      `_DelayedWgradGemm` (`split_weight_of` remembers the weight); outside it nothing changes.
#   I:                 inside `collecting_weight_grads()`, their backward queues `weight.grad += dW` closures
#                      (`defer_or_run`); `take_weight_grads()` hands the queue over as the W action's callable.
#   W:                 `run_weight_grads(queue)`.
#
# What stays in I: the small gradients autograd computes elsewhere (norm weights, biases, the router, embeddings).
# A deferred gradient reaches `.grad` without autograd's AccumulateGrad, so without post-accumulate hooks: ZeRO-1
# absorbs such gradients at `finish_grad_sync` (as it does torch's own W results).


def split_gemms_enabled() -> bool:
    return getattr(_local, "split_gemms", False)


@contextlib.contextmanager
def split_gemms(enabled: bool = True) -> Iterator[None]:
    """GEMMs built in this context (forward, or a recompute in the backward) can queue their weight gradients for a
    pipeline W action."""
    with thread_local_setting(_local, "split_gemms", enabled, default=False):
        yield


def split_weight_of(weight: torch.Tensor) -> torch.Tensor | None:
    """At forward time: `weight` if its gradient may be queued for a W action (inside `split_gemms`, autograd
    recording, a leaf weight that requires a gradient), else None."""
    if split_gemms_enabled() and torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf:
        return weight
    return None


@contextlib.contextmanager
def collecting_weight_grads() -> Iterator[None]:
    """A pipeline I action: backwards run in this context queue the weight gradients of split GEMMs (see
    `take_weight_grads`). Closures not taken when it exits run then (nothing is lost)."""
    previous = getattr(_local, "collect", None)
    _local.collect = []
    try:
        yield
        leftover = _local.collect
    finally:
        _local.collect = previous
    run_weight_grads(leftover)


def take_weight_grads() -> Callable[[], int]:
    """The queue collected so far in this `collecting_weight_grads` context, emptied, as the W action: a callable
    that runs it (torch's `PipelineStage` `dw_builder`)."""
    queue = getattr(_local, "collect", None)
    if queue is None:
        raise RuntimeError("take_weight_grads() outside collecting_weight_grads(): no I action is running")
    _local.collect = []
    return functools.partial(run_weight_grads, queue)


def defer_or_run(weight: torch.Tensor, wgrad: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """In a GEMM's backward: inside `collecting_weight_grads`, queue `weight.grad += wgrad()` and return None (the
    weight then gets no gradient from autograd); otherwise `wgrad()`."""
    queue = getattr(_local, "collect", None)
    if queue is None:
        return wgrad()
    queue.append((weight, wgrad))
    return None


@torch.no_grad()
def run_weight_grads(queue: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]) -> int:
    """Runs queued weight-gradient closures in order, accumulating into `.grad` (as AccumulateGrad: the first one
    is kept, the next added in place); returns how many ran."""
    count = 0
    while queue:
        weight, wgrad = queue.pop(0)
        grad = wgrad()
        if grad.shape != weight.shape or grad.dtype != weight.dtype:
            raise RuntimeError(
                f"a queued weight gradient is {tuple(grad.shape)} {grad.dtype}, its weight {tuple(weight.shape)} "
                f"{weight.dtype}"
            )
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad += grad
        count += 1
    return count


class _SplitLinear(torch.autograd.Function):
    """`F.linear(x, w, b)` (or `x @ w` for an `[in, out]` weight, `w_in_out`) whose weight-gradient GEMM goes
    through `defer_or_run`. The GEMMs are autograd's for `linear` / `mm` on the rows flattened to 2-D."""

    @staticmethod
    def forward(ctx, x, w, b, w_in_out: bool):
        ctx.save_for_backward(x, w)
        ctx.weight, ctx.w_in_out, ctx.has_bias = w, w_in_out, b is not None
        return x @ w if w_in_out else torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        weight, ctx.weight = ctx.weight, None
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ w.t() if ctx.w_in_out else g @ w
        if ctx.needs_input_grad[1]:
            x_MK, g_MN = x.reshape(-1, x.size(-1)), g.reshape(-1, g.size(-1))
            if ctx.w_in_out:
                grad_w = defer_or_run(weight, lambda: x_MK.t().mm(g_MN))
            else:
                grad_w = defer_or_run(weight, lambda: g_MN.t().mm(x_MK))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.size(-1)).sum(0)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x [..., K], weight [N, K], bias [N])` -> `[..., N]`; inside `split_gemms` its weight gradient can
    be queued for a pipeline W action."""
    if split_weight_of(weight) is None:
        return torch.nn.functional.linear(x, weight, bias)
    return _SplitLinear.apply(x, weight, bias, False)


def matmul(x: torch.Tensor, weight_KN: torch.Tensor) -> torch.Tensor:
    """`x [..., K] @ weight [K, N]` (a weight stored `[in, out]`); as `linear`."""
    if split_weight_of(weight_KN) is None:
        return x @ weight_KN
    return _SplitLinear.apply(x, weight_KN, None, True)


class SplitWgradLinear(torch.nn.Linear):
    """`nn.Linear` whose GEMM is `self.linear_fn` if set (an FP8 recipe's), else `linear` above; same parameters and
    state-dict keys. The pipeline replaces plain `nn.Linear` modules of zero-bubble stages by it
    (`split_wgrad_linears`)."""

    @classmethod
    def from_linear(cls, linear_module: torch.nn.Linear) -> SplitWgradLinear:
        """A module of this class holding `linear_module`'s Parameter objects (built on the meta device, so no
        memory and no random numbers are spent on weights it drops) in the same training mode."""
        new = cls(linear_module.in_features, linear_module.out_features, bias=linear_module.bias is not None,
                  device="meta", dtype=linear_module.weight.dtype)  # fmt: skip
        new.weight, new.bias = linear_module.weight, linear_module.bias
        return new.train(linear_module.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "linear_fn", linear)(x, self.weight, self.bias)


def split_wgrad_linears(model: torch.nn.Module) -> list[str]:
    """Replace every plain `nn.Linear` submodule of `model` by a `SplitWgradLinear` holding the same Parameter
    objects (names, state-dict keys and an optimizer's hold on them unchanged), so that its GEMM's weight gradient
    can be deferred to a pipeline W action. Subclasses (FP8's and the tensor-parallel linears) already compute
    with `linear` or a `linear_fn` of their own and are kept. Returns the replaced modules' names."""
    replacements = ModuleReplacements("split_wgrad_linears")
    names = []
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            replacements.add(name, module, SplitWgradLinear.from_linear(module))
            names.append(name)
    replacements.install(model)
    return names
