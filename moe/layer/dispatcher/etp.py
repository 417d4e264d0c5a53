"""Expert tensor parallelism (ETP) on top of any token dispatcher: every routed expert's FFN split over `etp` ranks.

Megatron-core's MoE parallel folding with `expert_tensor_parallel_size > 1` (its flex dispatcher over the
`tp_ep_group`): the expert layers see the ep x etp ranks of the folded group (ETP fastest) as `ep * etp` holders of
*virtual experts*. Rank `i * etp + j` of the folded group holds shard j of the experts `[i*L, (i+1)*L)` of EP rank
i (L = E / ep): columns j of the gate and up projections, rows j of the down projection (`moe/layer/experts.py`'s SwiGLU
with F / etp). Expert e, shard j is virtual expert `(e // L * etp + j) * L + e % L`, so each rank still holds L
consecutive (virtual) experts and the inner dispatcher needs to know nothing of ETP.

A token routed to expert e is sent to the etp ranks holding e's shards, with the same routing weight: each shard
computes `silu(x W1_j) * (x W3_j) @ W2_j`, a partial sum of the expert's output over its FFN columns, and the
combine's weighted FP32 sum over the token's slots adds the partials of one expert exactly as it adds the experts
(the row-parallel down projection's reduce is the combine). The backward follows through autograd: the combine's
backward hands every shard the output gradient times the weight, the dispatch's backward sums the shards' input
gradients, and the weight's gradient is the sum over the shards' slots (`expand`'s backward).

Legend: T tokens, K top-k slots, E experts, L local experts per EP rank, etp shards per expert.
"""

from __future__ import annotations

from typing import Any

import torch

from moe.layer.dispatcher.base import DispatchResult, TokenDispatcher
from moe.layer.dispatcher.comm import group_rank, group_size


def expand_to_shards(
    probs_TK: torch.Tensor, topk_idx_TK: torch.Tensor, num_local_experts: int, etp: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing over experts as routing over expert shards (see the module docstring).

    Args:
        probs_TK: `[T, K] float32` routing weights.
        topk_idx_TK: `[T, K] int64` expert ids in `[0, E)`, -1 for dropped slots.
        num_local_experts: L, the experts of one EP rank.
        etp: shards per expert.
    Returns `(probs [T, K*etp], virtual ids [T, K*etp])`: slot `k*etp + j` is shard j of slot k (the weight
    repeated, -1 kept).
    """
    T, K = topk_idx_TK.shape
    shard = torch.arange(etp, device=topk_idx_TK.device)
    owner, local = topk_idx_TK // num_local_experts, topk_idx_TK % num_local_experts
    virtual = ((owner * etp).unsqueeze(-1) + shard) * num_local_experts + local.unsqueeze(-1)
    virtual = torch.where(topk_idx_TK.unsqueeze(-1) >= 0, virtual, -1)
    return probs_TK.unsqueeze(-1).expand(T, K, etp).reshape(T, K * etp), virtual.reshape(T, K * etp)


class ExpertTensorParallelDispatcher(TokenDispatcher):
    """Routes over `num_experts` experts, each split over `etp` ranks, through `inner`: a dispatcher over the
    folded ep x etp group serving `num_experts * etp` virtual experts (see the module docstring).

    `ep_size`, `ep_rank`, `num_local_experts` and `local_expert_start` describe the experts (EP), as for a plain
    dispatcher; `etp_size` / `etp_rank` the shard; `ep_group` is the folded group the tokens travel over.
    """

    def __init__(self, inner: TokenDispatcher, *, num_experts: int, etp: int) -> None:
        if not isinstance(etp, int) or etp < 1:
            raise ValueError(f"etp must be a positive int, got {etp!r}")
        folded = group_size(inner.ep_group)
        if folded % etp:
            raise ValueError(f"the dispatch group of {folded} ranks does not fold into ep x etp with etp {etp}")
        if inner.num_experts != num_experts * etp:
            raise ValueError(f"the inner dispatcher serves {inner.num_experts} experts, not {num_experts} x etp {etp}")
        self.inner = inner
        self.ep_group = inner.ep_group
        self.etp_size = etp
        self.etp_rank = group_rank(inner.ep_group) % etp
        self.ep_size = folded // etp
        self.ep_rank = group_rank(inner.ep_group) // etp
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.local_expert_start = self.ep_rank * self.num_local_experts
        self.supports_async = inner.supports_async
        self.supports_async_combine = inner.supports_async_combine

    @property
    def phase_timer(self):
        return self.inner.phase_timer

    @phase_timer.setter
    def phase_timer(self, timer) -> None:
        self.inner.phase_timer = timer

    def dispatch_begin(self, hidden_TH: torch.Tensor, probs_TK: torch.Tensor, topk_idx_TK: torch.Tensor) -> Any:
        probs, virtual = expand_to_shards(probs_TK, topk_idx_TK, self.num_local_experts, self.etp_size)
        return self.inner.dispatch_begin(hidden_TH, probs, virtual)

    def dispatch_end(self, pending: Any) -> DispatchResult:
        return self.inner.dispatch_end(pending)

    def combine_begin(self, expert_output_NH: torch.Tensor, handle: Any) -> Any:
        return self.inner.combine_begin(expert_output_NH, handle)

    def combine_end(self, pending: Any) -> torch.Tensor:
        return self.inner.combine_end(pending)
