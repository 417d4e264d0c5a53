"""All-gather token dispatcher (Megatron's 'allgather' scheme).

dispatch: all-gather every rank's tokens, routing weights and expert ids over the EP group; keep the slots of this
rank's experts, sorted by local expert. combine: weighted (float32) sum into a `[sum of T over ranks, H]` buffer
of partial results, then reduce-scatter it so each rank gets its own tokens summed over all ranks.

Legend: T tokens here, G tokens gathered from all ranks, K top-k slots, H hidden, L local experts, N rows kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.layer.dispatcher.base import DispatchResult, TokenDispatcher, sort_slots_by_expert, weighted_scatter_sum
from moe.layer.dispatcher.comm import all_gather_sizes, all_gather_v, all_gather_v_raw, reduce_scatter_v


@dataclass
class AllGatherHandle:
    dtype: torch.dtype
    sizes: list[int]  # tokens per rank
    token_N: torch.Tensor  # gathered token of every kept row, int64
    weights_N: torch.Tensor  # float32 routing weight of every kept row (differentiable)


class AllGatherDispatcher(TokenDispatcher):
    """Simple and synchronous (`combine_begin` does the whole combine); every rank sees every token (traffic R times
    the all-to-all's at worst)."""

    supports_async = False
    supports_async_combine = False

    def dispatch_begin(self, hidden_TH, probs_TK, topk_idx_TK) -> DispatchResult:
        K = topk_idx_TK.size(1)
        sizes = all_gather_sizes(hidden_TH.size(0), self.ep_group, hidden_TH.device)
        hidden_GH = all_gather_v(hidden_TH, sizes, self.ep_group)
        probs_GK = all_gather_v(probs_TK.float(), sizes, self.ep_group)
        topk_idx_GK = all_gather_v_raw(topk_idx_TK, sizes, self.ep_group)
        local_GK = topk_idx_GK - self.local_expert_start
        is_local_GK = (topk_idx_GK >= 0) & (local_GK >= 0) & (local_GK < self.num_local_experts)
        slots_N, local_experts_N = sort_slots_by_expert(torch.where(is_local_GK, local_GK, -1))
        token_N = slots_N // K
        handle = AllGatherHandle(
            dtype=hidden_TH.dtype,
            sizes=sizes,
            token_N=token_N,
            weights_N=probs_GK.reshape(-1).index_select(0, slots_N),
        )
        counts = torch.bincount(local_experts_N, minlength=self.num_local_experts)
        return DispatchResult(hidden_GH.index_select(0, token_N), [int(c) for c in counts.tolist()], handle)

    def dispatch_end(self, pending: DispatchResult) -> DispatchResult:
        return pending

    def combine_begin(self, expert_output_NH: torch.Tensor, handle: AllGatherHandle) -> torch.Tensor:
        partial_GH = weighted_scatter_sum(expert_output_NH, handle.weights_N, handle.token_N, sum(handle.sizes))
        return reduce_scatter_v(partial_GH, handle.sizes, self.ep_group).to(handle.dtype)

    def combine_end(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


def build_allgather(config, ep_group: dist.ProcessGroup | None, ep_buffers=None) -> AllGatherDispatcher:
    """Registry factory for 'allgather' (no buffer: `ep_buffers` is not used)."""
    return AllGatherDispatcher(num_experts=config.num_moe_experts, ep_group=ep_group)
