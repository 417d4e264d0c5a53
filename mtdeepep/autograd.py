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

FP8 wire (`fp8=True`, DeepSeek-V3's dispatch): the op casts `x` to E4M3 with one float32 scale per token per 128
channels (`mtdeepep.utils.fp8.per_token_cast_to_fp8`), sends the (tensor, scales) pair and returns the received rows
dequantised to `x`'s dtype (after the wait when asynchronous: a hook of the returned event fills them). Autograd
treats the cast as the identity (straight-through): the backward is the same combine of the gradients, in their own
dtype. So FP8 on the way out, full precision on the way back, with one backward rule.

The backward's communication is synchronous, unless the calling thread has work to run while it is in flight
(`mtdeepep.in_flight`: the MoE layer's deferred expert weight gradients, a pipeline's overlapped forward-backward of
two micro-batches): then the backward starts its combine / cached dispatch with `async_finish=True` and waits for it
inside `with in_flight(name):` ('dispatch_backward', 'combine_backward'), where that work runs while the data moves.
The same kernels run either way (same results).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable

import torch

from .buffer import Buffer
from .config import Config
from .engines.handles import flatten_handle, unflatten_handle
from .event import EventOverlap
from .in_flight import has_work, in_flight
from .utils.fp8 import FP8_BLOCK, per_token_cast_back, per_token_cast_to_fp8

_EVENT = "_mtdeepep_event"
_NO_TENSOR = torch.empty(0, dtype=torch.float32)  # stands for an absent optional output (ops return tensors only)
_BUFFERS: weakref.WeakValueDictionary[int, Buffer] = weakref.WeakValueDictionary()
_NEXT_BUFFER_ID = itertools.count(1)


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


def _backward_comm(name: str, starts: list[Callable[[bool], tuple]]) -> list[tuple]:
    """Runs the communication calls `starts` of one backward (each `start(async_finish)` returns the buffer call's
    tuple, its event last when async): synchronously, or, when this thread has in-flight work
    (`mtdeepep.in_flight.has_work`), all started asynchronously, then waited inside `with in_flight(name):`.
    Returns each call's tuple without the event. Never returns or raises with a communication still in flight."""
    if not has_work():
        return [start(False)[:-1] for start in starts]
    started: list[tuple] = []
    done: list[tuple] = []
    try:
        for start in starts:
            started.append(start(True))
        with in_flight(name):
            while started:
                result = started.pop(0)
                result[-1].current_stream_wait()
                done.append(result[:-1])
    finally:
        for result in started:  # the in-flight work or a wait raised: never leave a communication in flight
            result[-1].current_stream_wait()
    return done


# ---------------------------------------------------------------------------------------------------------------
# dispatch


@torch.library.custom_op("mtdeepep::dispatch", mutates_args=())
def _dispatch_op(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, buffer_id: int, num_experts: int,
    expert_alignment: int, config: list[int], async_finish: bool, fp8: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """Layout + dispatch: `(recv_x, recv_topk_idx, recv_topk_weights or [0], counts [L] int64, handle tensors)`;
    with `fp8` the rows travel as E4M3 + scales and `recv_x` is their dequantisation to `x.dtype`."""
    buffer = _buffer(buffer_id)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    sent = per_token_cast_to_fp8(x) if fp8 else x  # FP8: the (E4M3 rows, scales) pair
    recv_x, recv_idx, recv_weights, counts, handle, event = buffer.dispatch(
        sent, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        expert_alignment=expert_alignment, config=_config(config), async_finish=async_finish,
    )  # fmt: skip
    if fp8:
        recv_x = _dequantised_when_received(recv_x, x.dtype, event if async_finish else None)
    if async_finish:
        setattr(recv_x, _EVENT, event)
    return recv_x, recv_idx, _optional(recv_weights), torch.tensor(counts, dtype=torch.int64), flatten_handle(handle)


def _dequantised_when_received(
    recv_pair: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, event: EventOverlap | None
) -> torch.Tensor:
    """`[U, H]` of `dtype`: the received E4M3 rows times their scales, now (`event` None: they are in) or by a hook of
    `event` once its wait returned. Written through `.data`, as the transfer itself writes the rows: autograd sees no
    in-place change of the op's output (views of it made before the wait stay valid)."""
    recv_x8, recv_scales = recv_pair
    recv_x = torch.empty(recv_x8.shape, dtype=dtype, device=recv_x8.device)

    def dequantise() -> None:
        recv_x.data.copy_(per_token_cast_back(recv_x8, recv_scales).to(dtype))

    if event is None:
        dequantise()
    else:
        event.register_hook_after_wait(dequantise)
    return recv_x


def _dispatch_setup(ctx, inputs, output) -> None:
    _, _, topk_weights, ident, _, _, ctx.config, _, _ = inputs
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
    return grad_x, None, grad_weights if ctx.has_weights else None, None, None, None, no_config, None, None


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
    fp8: bool = False,
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

    With `fp8=True` the rows travel as E4M3 with float32 scales per token per 128 channels (`H % 128 == 0`); `recv_x`
    is their dequantisation to `x.dtype` (complete after the wait when async); the gradient treats the cast as the
    identity (see the module docstring).
    """
    if fp8 and x.size(-1) % FP8_BLOCK:
        raise ValueError(f"mtdeepep: an FP8 dispatch needs hidden % {FP8_BLOCK} == 0, got hidden={x.size(-1)}")
    recv_x, recv_idx, recv_weights, counts, handle = torch.ops.mtdeepep.dispatch(
        x, topk_idx, topk_weights, buffer_id(buffer), num_experts, expert_alignment, _config_values(config),
        async_finish, fp8,
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
