"""All-to-all token dispatcher (Megatron's 'alltoall' scheme).

dispatch: sort slots by global expert (= by destination rank, then local expert) -> exchange per-expert counts
-> all-to-all the rows -> regroup the received chunks from `[source rank][local expert]` to
`[local expert][source rank]`. combine: undo the regrouping -> reverse all-to-all -> weighted sum per token in
float32.

Legend: T tokens, K top-k slots, H hidden, E experts, R ranks, L local experts, M rows sent, N rows received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.layer.dispatcher.base import DispatchResult, TokenDispatcher, sort_slots_by_expert, weighted_scatter_sum
from moe.layer.dispatcher.comm import PendingAllToAll, all_to_all_counts, finish_all_to_all, start_all_to_all


@dataclass
class AllToAllHandle:
    """State kept between dispatch and combine (all index tensors int64)."""

    num_tokens: int
    dtype: torch.dtype
    token_M: torch.Tensor  # source token of every sent row
    weights_M: torch.Tensor  # float32 routing weight of every sent row (differentiable)
    input_splits: list[int]  # rows sent to each rank
    output_splits: list[int]  # rows received from each rank
    sort_N: torch.Tensor  # expert-sorted row n is received row sort_N[n]


@dataclass
class _PendingDispatch:
    a2a: PendingAllToAll
    counts_RL: torch.Tensor  # rows received from source r for local expert l
    handle: AllToAllHandle


@dataclass
class _PendingCombine:
    a2a: PendingAllToAll  # the rows going back, `[M, H]` once finished
    handle: AllToAllHandle


def regroup_index(counts_RL: torch.Tensor) -> torch.Tensor:
    """Index that reorders rows laid out as chunks `[r][l]` (sizes `counts_RL`) into chunks `[l][r]`.

    Returns `[N] int64` such that `rows_by_expert = rows_by_source[index]`.
    """
    R, L = counts_RL.shape
    sizes = counts_RL.reshape(-1)
    src_starts = sizes.cumsum(0) - sizes
    order = torch.arange(R * L, device=sizes.device).view(R, L).t().reshape(-1)
    sizes_new = sizes[order]
    dst_starts = sizes_new.cumsum(0) - sizes_new
    shift = torch.repeat_interleave(src_starts[order] - dst_starts, sizes_new)
    return torch.arange(int(sizes.sum()), device=sizes.device) + shift


class AllToAllDispatcher(TokenDispatcher):
    """Rows travel once per (token, expert) slot; the count exchange is synchronous, the rows asynchronous (both
    ways: `combine_begin` starts the reverse all-to-all, `combine_end` waits and reduces)."""

    supports_async = True
    supports_async_combine = True

    def dispatch_begin(self, hidden_TH, probs_TK, topk_idx_TK) -> _PendingDispatch:
        T, K = topk_idx_TK.shape
        slots_M, experts_M = sort_slots_by_expert(topk_idx_TK)
        token_M = slots_M // K
        weights_M = probs_TK.float().reshape(-1).index_select(0, slots_M)
        counts_E = torch.bincount(experts_M, minlength=self.num_experts)
        counts_RL = all_to_all_counts(counts_E.view(self.ep_size, self.num_local_experts), self.ep_group)
        input_splits = counts_E.view(self.ep_size, -1).sum(1).tolist()
        output_splits = counts_RL.sum(1).tolist()
        send_MH = hidden_TH.index_select(0, token_M)
        pending = start_all_to_all(send_MH, output_splits, input_splits, self.ep_group)
        handle = AllToAllHandle(
            num_tokens=T,
            dtype=hidden_TH.dtype,
            token_M=token_M,
            weights_M=weights_M,
            input_splits=input_splits,
            output_splits=output_splits,
            sort_N=regroup_index(counts_RL.cpu()).to(hidden_TH.device),
        )
        return _PendingDispatch(pending, counts_RL, handle)

    def dispatch_end(self, pending: _PendingDispatch) -> DispatchResult:
        recv_NH = finish_all_to_all(pending.a2a)
        expert_input_NH = recv_NH.index_select(0, pending.handle.sort_N)
        tokens_per_expert = [int(c) for c in pending.counts_RL.sum(0).tolist()]
        return DispatchResult(expert_input_NH, tokens_per_expert, pending.handle)

    def combine_begin(self, expert_output_NH: torch.Tensor, handle: AllToAllHandle) -> _PendingCombine:
        inverse_N = torch.empty_like(handle.sort_N)
        inverse_N[handle.sort_N] = torch.arange(handle.sort_N.numel(), device=handle.sort_N.device)
        by_source_NH = expert_output_NH.index_select(0, inverse_N)
        a2a = start_all_to_all(by_source_NH, handle.input_splits, handle.output_splits, self.ep_group)
        return _PendingCombine(a2a, handle)

    def combine_end(self, pending: _PendingCombine) -> torch.Tensor:
        handle = pending.handle
        back_MH = finish_all_to_all(pending.a2a)
        out_TH = weighted_scatter_sum(back_MH, handle.weights_M, handle.token_M, handle.num_tokens)
        return out_TH.to(handle.dtype)


def build_alltoall(config, ep_group: dist.ProcessGroup | None, ep_buffers=None) -> AllToAllDispatcher:
    """Registry factory for 'alltoall' (no buffer: `ep_buffers` is not used)."""
    return AllToAllDispatcher(num_experts=config.num_moe_experts, ep_group=ep_group)
