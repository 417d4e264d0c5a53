"""Differentiable dispatch and combine (DeepEP's backward rules, shipped once here).

dispatch's backward is a combine of the gradients through the same handle; combine's backward is a cached
dispatch of the gradient. Both are usable inside an `nn.Module`.

`dispatch(..., async_finish=True)` returns as soon as the receive counts are known (the CPU sync upstream has
too) and moves the rows on the buffer's comm thread; it also returns the `EventOverlap` to wait on, so independent
work (e.g. a shared expert) can run while the rows are in flight, with autograd recording the dispatch.
"""

from __future__ import annotations

import torch

from .buffer import Buffer
from .config import Config
from .event import EventOverlap


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer: Buffer, x, topk_idx, topk_weights, num_experts, expert_alignment, config, async_finish):
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            expert_alignment=expert_alignment,
            config=config,
            async_finish=async_finish,
        )
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        # Saving and returning the outputs reads none of their data, so this is safe while the rows are in flight;
        # the backward runs after the caller waited on `event` (it used the outputs to build the loss).
        ctx.save_for_backward(recv_topk_idx)
        ctx.mark_non_differentiable(recv_topk_idx)
        if async_finish:
            return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_idx, grad_recv_weights, *_grad_non_tensors):
        (recv_topk_idx,) = ctx.saved_tensors
        if grad_recv_weights is not None:
            # Slots whose expert lives elsewhere were constant zeros: no gradient flows through them.
            grad_recv_weights = grad_recv_weights.masked_fill(recv_topk_idx < 0, 0.0).float()
        grad_x, grad_weights, _ = ctx.buffer.combine(
            grad_recv_x.contiguous(), ctx.handle, topk_weights=grad_recv_weights, config=ctx.config
        )
        return None, grad_x, None, grad_weights, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer: Buffer, x, handle, topk_weights, bias0, bias1, config):
        combined_x, combined_weights, _ = buffer.combine(
            x, handle, topk_weights=topk_weights, bias=(bias0, bias1), config=config
        )
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        ctx.has_bias = (bias0 is not None, bias1 is not None)
        ctx.has_weights = topk_weights is not None
        return combined_x, combined_weights

    @staticmethod
    def backward(ctx, grad_combined, grad_combined_weights):
        grad_x = grad_weights = None
        if grad_combined is not None:
            grad_x, _, _, _, _, _ = ctx.buffer.dispatch(
                grad_combined.contiguous(), handle=ctx.handle, config=ctx.config
            )
        if ctx.has_weights and grad_combined_weights is not None:
            grad_weights, _, _, _, _, _ = ctx.buffer.dispatch(
                grad_combined_weights.float().contiguous(), handle=ctx.handle, config=ctx.config
            )
        grad_bias0 = grad_combined if ctx.has_bias[0] else None
        grad_bias1 = grad_combined if ctx.has_bias[1] else None
        return None, grad_x, None, grad_weights, grad_bias0, grad_bias1, None


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
    """Differentiable layout + dispatch.

    Arguments: `x [T, H]` float, `topk_idx [T, K]` int64, `topk_weights [T, K]` float32 or None.
    Returns `(recv_x [N, H], recv_topk_idx [N, K] int64, recv_topk_weights [N, K] float32 or None, counts per local
    expert (list of int), handle)`; gradients flow to `x` and `topk_weights`.

    With `async_finish=True` the rows move on the buffer's comm thread and the tuple ends with the `EventOverlap`
    as well: `(recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event)`. Shapes, `counts` and `handle`
    are final at once; the *contents* of the three tensors are not: call `event.current_stream_wait()` before
    reading them (or anything computed from them), and leave `x`, `topk_idx` and `topk_weights` unchanged until
    then. The backward is the same combine of the gradients.
    """
    return _Dispatch.apply(buffer, x, topk_idx, topk_weights, num_experts, expert_alignment, config, async_finish)


def combine(
    buffer: Buffer,
    x: torch.Tensor,
    handle: tuple,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    *,
    config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable combine: `x [N, H]` -> `[T, H]` (unweighted FP32 sum + bias); gradients flow to `x`,
    `topk_weights` and the biases."""
    bias0, bias1 = bias if isinstance(bias, tuple) else (bias, None)
    return _Combine.apply(buffer, x, handle, topk_weights, bias0, bias1, config)
