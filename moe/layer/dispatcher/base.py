"""The token-dispatcher interface: move routed tokens to the ranks owning their experts, and back.

Legend: T tokens on this rank, K top-k slots, H hidden, E experts, L local experts, N rows received here.

Expert parallelism: the `ep_group` has R ranks; rank r owns the contiguous experts `[r*L, (r+1)*L)`, L = E / R.
`ep_group=None` is a single process owning every expert.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe.layer.dispatcher.comm import group_rank, group_size


@dataclass
class DispatchResult:
    """What the experts of this rank receive.

    expert_input_NH: `[N, H]` rows sorted by local expert (expert 0's rows first), in the hidden dtype.
    tokens_per_expert: `[L]` Python ints, rows per local expert (summing to N).
    handle: backend-specific state `combine` needs to send the rows back; treat it as opaque.
    """

    expert_input_NH: torch.Tensor
    tokens_per_expert: list[int]
    handle: Any


class TokenDispatcher(ABC):
    """Dispatch routed tokens to the local experts of every rank and combine the expert outputs back.

    Subclasses implement `dispatch_begin` / `dispatch_end` and `combine_begin` / `combine_end`. A `*_begin` may
    launch communication and return before it completes (then `supports_async`, for the dispatch, or
    `supports_async_combine` is True), so the caller (the layer, or a schedule overlapping micro-batches) can
    compute something independent, e.g. the shared expert, before calling the matching `*_end`. Results must not
    depend on whether anything runs in between. `dispatch` and `combine` are `end(begin(...))`.

    The routing weights are applied in the combine, in float32, on the rank that owns the token:
    `out[t] = sum_k probs[t, k] * expert_output(t, k)`. Slots with `topk_idx == -1` (dropped) are skipped.
    """

    supports_async: bool = False
    supports_async_combine: bool = False
    # A `moe.layer.phase_timer.PhaseTimer` for the communication inside the backward (set by `MoELayer.set_phase_timer`;
    # the layer times the forward calls itself). Dispatchers that do not use it leave that time to 'backward'.
    phase_timer = None

    def __init__(self, *, num_experts: int, ep_group: dist.ProcessGroup | None = None) -> None:
        self.ep_group = ep_group
        self.ep_size = group_size(ep_group)
        self.ep_rank = group_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.local_expert_start = self.ep_rank * self.num_local_experts

    @abstractmethod
    def dispatch_begin(self, hidden_TH: torch.Tensor, probs_TK: torch.Tensor, topk_idx_TK: torch.Tensor) -> Any:
        """Start dispatching.

        Args:
            hidden_TH: `[T, H]` tokens of this rank.
            probs_TK: `[T, K] float32` routing weights (kept for the combine; differentiable).
            topk_idx_TK: `[T, K] int64` global expert ids, -1 for dropped slots.
        Returns an opaque pending object for `dispatch_end`.
        """

    @abstractmethod
    def dispatch_end(self, pending: Any) -> DispatchResult:
        """Wait for the dispatch started by `dispatch_begin` and return the local experts' input."""

    @abstractmethod
    def combine_begin(self, expert_output_NH: torch.Tensor, handle: Any) -> Any:
        """Start sending the experts' outputs `[N, H]` (same row order as the dispatch result) back.

        `handle` is `DispatchResult.handle`. Returns an opaque pending object for `combine_end`; leave
        `expert_output_NH` unchanged until then.
        """

    @abstractmethod
    def combine_end(self, pending: Any) -> torch.Tensor:
        """Wait for the combine started by `combine_begin` and reduce: returns `[T, H]` in the dtype of the
        dispatched hidden states."""

    def dispatch(self, hidden_TH: torch.Tensor, probs_TK: torch.Tensor, topk_idx_TK: torch.Tensor) -> DispatchResult:
        """`dispatch_end(dispatch_begin(...))`."""
        return self.dispatch_end(self.dispatch_begin(hidden_TH, probs_TK, topk_idx_TK))

    def combine(self, expert_output_NH: torch.Tensor, handle: Any) -> torch.Tensor:
        """`combine_end(combine_begin(...))`: `[N, H]` expert outputs -> `[T, H]` weighted sums per token."""
        return self.combine_end(self.combine_begin(expert_output_NH, handle))


def sort_slots_by_expert(topk_idx_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid slots (id >= 0) of `[T, K]`, stably sorted by expert id.

    Returns `(slots [M] int64, experts [M] int64)`: flat slot ids `t*K + k` and their expert ids, so rows are
    grouped by expert and, within one expert, in token order.
    """
    flat = topk_idx_TK.reshape(-1)
    slots = torch.nonzero(flat >= 0).flatten()
    experts = flat[slots]
    order = torch.argsort(experts, stable=True)
    return slots[order], experts[order]


class _WeightedScatterSum(torch.autograd.Function):
    """The combine's weighted sum with a lean backward: it keeps the rows in their own dtype, the float32 weights
    and the token ids, where autograd on the plain formula would keep the float32 copy of the rows (twice the bytes
    of BF16 rows, one per MoE layer until its backward). Values and gradients are the plain formula's, bit for bit
    (`test_weighted_scatter_sum_matches_autograd_and_keeps_only_the_rows`)."""

    @staticmethod
    def forward(ctx, rows_MH, weights_M, token_M, num_tokens):
        ctx.save_for_backward(rows_MH, weights_M, token_M)
        out = torch.zeros(num_tokens, rows_MH.size(1), dtype=torch.float32, device=rows_MH.device)
        return out.index_add(0, token_M, rows_MH.float() * weights_M.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad_TH):
        rows_MH, weights_M, token_M = ctx.saved_tensors
        grad_rows = grad_weights = None
        grad_MH = grad_TH.index_select(0, token_M)
        if ctx.needs_input_grad[0]:
            grad_rows = (grad_MH * weights_M.unsqueeze(1)).to(rows_MH.dtype)
        if ctx.needs_input_grad[1]:
            grad_weights = (grad_MH * rows_MH.float()).sum(1)
        return grad_rows, grad_weights, None, None


def weighted_scatter_sum(
    rows_MH: torch.Tensor, weights_M: torch.Tensor, token_M: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """`out[t] = sum over rows m of token t: weights[m] * rows[m]`, in float32: `[num_tokens, H]`.

    rows `[M, H]` any float dtype, weights `[M]` (used in float32), token `[M]` int64 ids in `[0, num_tokens)`.
    """
    return _WeightedScatterSum.apply(rows_MH, weights_M.float(), token_M, num_tokens)
