"""Differentiable dispatch and combine as `torch.library` custom ops (DeepEP's backward rules, shipped once here).

`torch.ops.mtdeepep.dispatch` (layout + dispatch) and `torch.ops.mtdeepep.combine` are custom ops with registered
backward: dispatch's backward is a combine of the gradients through the same handle, combine's backward is a cached
dispatch of the gradient. Being ops, they are visible to selective activation checkpointing, which can save their
outputs instead of communicating again in the recomputation. `mtdeepep.dispatch` / `mtdeepep.combine` are the
Python entry points with DeepEP's tuples.

What cannot cross an op boundary travels beside it: the buffer by a process-local id (`buffer_id`, a live buffer
of this process), the handle as its flat list of tensors (its identity is attached to one of them, see
`mtdeepep.engines.handles`), the event of an `async_finish` call as an attribute of the op's output, taken by the entry
point. The autograd graph keeps the buffer of its forward alive until the backward ran.

`dispatch(..., async_finish=True)` returns as soon as the receive counts are known (the CPU sync upstream has too)
and moves the rows on the buffer's comm thread; it also returns the `EventOverlap` to wait on, so independent work
(e.g. a shared expert) can run while the rows are in flight, with autograd recording the dispatch.
`combine(..., async_finish=True)` likewise returns the event: wait on it before reading the result.

The backward's communication is synchronous, unless a schedule that runs other work at the same time (a pipeline's
overlapped forward-backward of two micro-batches) set `backward_comm_hook(hook)` on the calling thread: then the
backward starts its combine / cached dispatch with `async_finish=True` and waits for it inside `with hook(name):`,
so the hook can run independent work while the data moves. The same kernels run either way (same results).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch

from .buffer import Buffer
from .config import Config
from .engines.handles import flatten_handle, unflatten_handle
from .event import EventOverlap
from .utils.thread_local import thread_local_setting

_EVENT = "_mtdeepep_event"
_NO_TENSOR = torch.empty(0, dtype=torch.float32)  # stands for an absent optional output (ops return tensors only)
_BUFFERS: weakref.WeakValueDictionary[int, Buffer] = weakref.WeakValueDictionary()
_NEXT_BUFFER_ID = itertools.count(1)
_THREAD = threading.local()  # `backward_comm_hook`: the hook of the calling thread


def buffer_id(buffer: Buffer) -> int:
    """The process-local id custom ops name `buffer` by (registered on first use; the buffer is not kept alive)."""
    if not isinstance(buffer, Buffer):
        raise ValueError(f"mtdeepep: expected an mtdeepep.Buffer, got {type(buffer).__name__}")
    ident = getattr(buffer, "_op_id", None)
    if ident is None:
        ident = buffer._op_id = next(_NEXT_BUFFER_ID)
        _BUFFERS[ident] = buffer
    return ident


def _buffer(ident: int) -> Buffer:
    buffer = _BUFFERS.get(ident)
    if buffer is None:
        raise RuntimeError(f"mtdeepep: buffer #{ident} of this process no longer exists (destroyed or collected)")
    return buffer


def _config(values: list[int]) -> Config | None:
    return Config(*values) if values else None


def _config_values(config: Config | None) -> list[int]:
    if config is None:
        return []
    if not isinstance(config, Config):
        raise ValueError(f"mtdeepep: config must be an mtdeepep.Config, got {type(config).__name__}")
    return [config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens]  # fmt: skip


def _optional(tensor: torch.Tensor | None) -> torch.Tensor:
    return _NO_TENSOR.new_empty(0) if tensor is None else tensor


def _present(tensor: torch.Tensor) -> torch.Tensor | None:
    return None if tensor.numel() == 0 and tensor.dim() == 1 else tensor


@contextlib.contextmanager
def backward_comm_hook(hook: Callable[[str], AbstractContextManager] | None) -> Iterator[None]:
    """On this thread, while active: the backward of `dispatch` (a combine of the gradients, `name`
    'dispatch_backward') and of `combine` (a cached dispatch of the gradient, 'combine_backward') start their
    communication asynchronously and wait for it inside `with hook(name):`. The hook's `__enter__` runs while the
    data moves (it must not touch the gradients being sent or received); its `__exit__` follows the wait.

    Thread-local, because a CPU backward runs on the thread that called it: only that thread's backward changes.
    `hook=None` turns it off inside the block. Nesting restores the outer hook on exit.
    """
    with thread_local_setting(_THREAD, "hook", hook):
        yield


def _backward_comm(name: str, starts: list[Callable[[bool], tuple]]) -> list[tuple]:
    """Runs the communication calls `starts` of one backward (each `start(async_finish)` returns the buffer call's
    tuple, its event last when async): synchronously, or, under a `backward_comm_hook`, all started asynchronously,
    then waited inside `with hook(name):`. Returns each call's tuple without the event."""
    hook = getattr(_THREAD, "hook", None)
    if hook is None:
        return [start(False)[:-1] for start in starts]
    results = [start(True) for start in starts]
    with hook(name):
        for result in results:
            result[-1].current_stream_wait()
    return [result[:-1] for result in results]


# ---------------------------------------------------------------------------------------------------------------
# dispatch


@torch.library.custom_op("mtdeepep::dispatch", mutates_args=())
def _dispatch_op(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, buffer_id: int, num_experts: int,
    expert_alignment: int, config: list[int], async_finish: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """Layout + dispatch: `(recv_x, recv_topk_idx, recv_topk_weights or [0], counts [L] int64, handle tensors)`."""
    buffer = _buffer(buffer_id)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_weights, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        expert_alignment=expert_alignment, config=_config(config), async_finish=async_finish,
    )  # fmt: skip
    if async_finish:
        setattr(recv_x, _EVENT, event)
    return recv_x, recv_idx, _optional(recv_weights), torch.tensor(counts, dtype=torch.int64), flatten_handle(handle)


def _dispatch_setup(ctx, inputs, output) -> None:
    _, _, topk_weights, ident, _, _, ctx.config, _ = inputs
    ctx.buffer = _buffer(ident)  # the graph keeps the buffer alive until its backward ran
    _, recv_idx, _, _, ctx.handle = output
    ctx.has_weights = topk_weights is not None
    ctx.save_for_backward(recv_idx)


def _dispatch_backward(ctx, grad_recv_x, _grad_idx, grad_recv_weights, _grad_counts, _grad_handle):
    (recv_idx,) = ctx.saved_tensors
    weights = None
    if ctx.has_weights and grad_recv_weights is not None:
        # Slots whose expert lives elsewhere were constant zeros: no gradient flows through them.
        weights = grad_recv_weights.masked_fill(recv_idx < 0, 0.0).float().contiguous()
    grad_x = grad_weights = None
    if grad_recv_x is not None:
        handle, config = unflatten_handle(ctx.handle), _config(ctx.config)
        [(grad_x, grad_weights)] = _backward_comm("dispatch_backward", [
            lambda async_finish: ctx.buffer.combine(grad_recv_x.contiguous(), handle, topk_weights=weights,
                                                    config=config, async_finish=async_finish),
        ])  # fmt: skip
    no_config = [None] * len(ctx.config)  # the gradients' structure must match the inputs' (lists included)
    return grad_x, None, grad_weights if ctx.has_weights else None, None, None, None, no_config, None


torch.library.register_autograd("mtdeepep::dispatch", _dispatch_backward, setup_context=_dispatch_setup)


# ---------------------------------------------------------------------------------------------------------------
# combine


@torch.library.custom_op("mtdeepep::combine", mutates_args=())
def _combine_op(
    x: torch.Tensor, handle: list[torch.Tensor], topk_weights: torch.Tensor | None, bias0: torch.Tensor | None,
    bias1: torch.Tensor | None, buffer_id: int, config: list[int], async_finish: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Unweighted FP32 sum per source token (+ biases): `(combined_x, combined_topk_weights or [0])`."""
    combined, combined_weights, event = _buffer(buffer_id).combine(
        x, unflatten_handle(handle), topk_weights=topk_weights, bias=(bias0, bias1), config=_config(config),
        async_finish=async_finish,
    )  # fmt: skip
    if async_finish:
        setattr(combined, _EVENT, event)
    return combined, _optional(combined_weights)


def _combine_setup(ctx, inputs, output) -> None:
    _, ctx.handle, topk_weights, bias0, bias1, ident, ctx.config, _ = inputs
    ctx.buffer = _buffer(ident)
    ctx.has = (topk_weights is not None, bias0 is not None, bias1 is not None)


def _combine_backward(ctx, grad_combined, grad_combined_weights):
    has_weights, has_bias0, has_bias1 = ctx.has
    buffer, handle, config = ctx.buffer, unflatten_handle(ctx.handle), _config(ctx.config)
    grad_x = grad_weights = None
    sources = {}  # what goes back through the dispatch's handle: the gradients of x and of topk_weights
    if grad_combined is not None:
        sources["x"] = grad_combined.contiguous()
    if has_weights and grad_combined_weights is not None:
        sources["weights"] = grad_combined_weights.float().contiguous()
    if sources:
        starts = [functools.partial(_cached_dispatch, buffer, t, handle, config) for t in sources.values()]
        received = dict(zip(sources, _backward_comm("combine_backward", starts)))
        grad_x = received["x"][0] if "x" in received else None
        grad_weights = received["weights"][0] if "weights" in received else None
    grad_bias0 = grad_combined if has_bias0 else None
    grad_bias1 = grad_combined if has_bias1 else None
    no_handle, no_config = [None] * len(ctx.handle), [None] * len(ctx.config)  # the inputs' structure, lists too
    return grad_x, no_handle, grad_weights, grad_bias0, grad_bias1, None, no_config, None


def _cached_dispatch(buffer: Buffer, x: torch.Tensor, handle: tuple, config: Config | None, async_finish: bool):
    return buffer.dispatch(x, handle=handle, config=config, async_finish=async_finish)


torch.library.register_autograd("mtdeepep::combine", _combine_backward, setup_context=_combine_setup)


# ---------------------------------------------------------------------------------------------------------------
# Entry points


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_experts: int,
    *,
    expert_alignment: int = 1,
    config: Config | None = None,
    async_finish: bool = False,
) -> (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int], tuple]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[int], tuple, EventOverlap]
):
    """Differentiable layout + dispatch (`torch.ops.mtdeepep.dispatch`).

    Arguments: `x [T, H]` float, `topk_idx [T, K]` int64, `topk_weights [T, K]` float32 or None.
    Returns `(recv_x [N, H], recv_topk_idx [N, K] int64, recv_topk_weights [N, K] float32 or None, counts per local
    expert (list of int), handle)`; gradients flow to `x` and `topk_weights`.

    With `async_finish=True` the rows move on the buffer's comm thread and the tuple ends with the `EventOverlap`
    as well: `(recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event)`. Shapes, `counts` and `handle`
    are final at once; the *contents* of the three tensors are not: call `event.current_stream_wait()` before
    reading them (or anything computed from them), and leave `x`, `topk_idx` and `topk_weights` unchanged until
    then. The backward is the same combine of the gradients.
    """
    recv_x, recv_idx, recv_weights, counts, handle = torch.ops.mtdeepep.dispatch(
        x, topk_idx, topk_weights, buffer_id(buffer), num_experts, expert_alignment, _config_values(config),
        async_finish,
    )  # fmt: skip
    outputs = (recv_x, recv_idx, None if topk_weights is None else recv_weights, counts.tolist(),
               unflatten_handle(handle))  # fmt: skip
    if not async_finish:
        return outputs
    return (*outputs, _take_event(recv_x))


def combine(
    buffer: Buffer,
    x: torch.Tensor,
    handle: tuple,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    *,
    config: Config | None = None,
    async_finish: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
    """Differentiable combine (`torch.ops.mtdeepep.combine`): `x [N, H]` -> `[T, H]` (unweighted FP32 sum + bias);
    gradients flow to `x`, `topk_weights` and the biases. With `async_finish=True` the sum runs on the comm thread and
    the tuple ends with the `EventOverlap` to wait on before reading the result."""
    bias0, bias1 = bias if isinstance(bias, tuple) else (bias, None)
    combined, combined_weights = torch.ops.mtdeepep.combine(
        x, flatten_handle(handle), topk_weights, bias0, bias1, buffer_id(buffer), _config_values(config),
        async_finish,
    )  # fmt: skip
    outputs = (combined, None if topk_weights is None else combined_weights)
    if not async_finish:
        return outputs
    return (*outputs, _take_event(combined))


def _take_event(tensor: torch.Tensor) -> EventOverlap:
    event = getattr(tensor, _EVENT, None)
    if event is None:
        return EventOverlap()  # the op's outputs were replayed (e.g. saved by selective checkpointing): complete
    delattr(tensor, _EVENT)
    return event
