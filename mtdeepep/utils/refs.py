"""Plain-PyTorch references for layout, dispatch and combine.

These functions define what every executor (CPU shared memory, CUDA, MUSA) must compute. They take the
*global* view (every rank's inputs, e.g. gathered in a test) and return what one rank must see. They favour
clarity over speed: loops over ranks, float64 accumulation.

Legend: R ranks, T tokens on a rank, K top-k slots, E experts, H hidden, N received rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ref_dispatch_layout(
    topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts a rank needs before it can dispatch.

    Returns `num_tokens_per_rank [R] int32` (a token counts once per rank owning any of its experts),
    `num_tokens_per_expert [E] int32` and `is_token_in_rank [T, R] bool`.
    """
    experts_per_rank = num_experts // num_ranks
    valid_TK = topk_idx_TK >= 0
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)
    num_tokens_per_expert.scatter_add_(0, topk_idx_TK[valid_TK], torch.ones_like(topk_idx_TK[valid_TK]))
    is_token_in_rank_TR = torch.zeros(topk_idx_TK.size(0), num_ranks, dtype=torch.bool)
    for r in range(num_ranks):
        owned_TK = valid_TK & (topk_idx_TK // experts_per_rank == r)
        is_token_in_rank_TR[:, r] = owned_TK.any(dim=1)
    num_tokens_per_rank = is_token_in_rank_TR.sum(dim=0)
    return num_tokens_per_rank.int(), num_tokens_per_expert.int(), is_token_in_rank_TR


@dataclass
class RefDispatchResult:
    """What rank `rank` receives. Rows are grouped by source rank, ascending, in each source's token order."""

    recv_x: torch.Tensor  # [N, H]
    recv_topk_idx: torch.Tensor  # [N, K] int64, local expert ids or -1
    recv_topk_weights: torch.Tensor  # [N, K] float32, 0 where the id is -1
    recv_src_rank: torch.Tensor  # [N] int64
    recv_src_idx: torch.Tensor  # [N] int64, token index on the source rank
    num_recv_tokens_per_expert: list[int]  # [E_local], aligned up to expert_alignment
    rank_prefix_matrix: torch.Tensor  # [R, R] int32, prefix over sources of tokens sent to each rank


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def ref_dispatch(
    x_per_rank: list[torch.Tensor],
    topk_idx_per_rank: list[torch.Tensor],
    topk_weights_per_rank: list[torch.Tensor] | None,
    num_experts: int,
    rank: int,
    expert_alignment: int = 1,
) -> RefDispatchResult:
    """Dispatch seen from `rank`, given every rank's `x [T_r, H]` and `topk_idx [T_r, K]`."""
    num_ranks = len(x_per_rank)
    experts_per_rank = num_experts // num_ranks
    first_expert = rank * experts_per_rank
    rows, idx_rows, weight_rows, src_ranks, src_idxs = [], [], [], [], []
    sent_to = torch.zeros(num_ranks, num_ranks, dtype=torch.int64)
    for src in range(num_ranks):
        topk_idx = topk_idx_per_rank[src]
        _, _, in_rank = ref_dispatch_layout(topk_idx, num_experts, num_ranks)
        sent_to[src] = in_rank.sum(dim=0)
        chosen = in_rank[:, rank].nonzero().flatten()
        rows.append(x_per_rank[src][chosen])
        local = topk_idx[chosen] - first_expert
        is_local = (topk_idx[chosen] >= 0) & (local >= 0) & (local < experts_per_rank)
        idx_rows.append(torch.where(is_local, local, torch.full_like(local, -1)))
        if topk_weights_per_rank is not None:
            weights = topk_weights_per_rank[src][chosen].float()
            weight_rows.append(torch.where(is_local, weights, torch.zeros_like(weights)))
        src_ranks.append(torch.full((chosen.numel(),), src, dtype=torch.int64))
        src_idxs.append(chosen)
    recv_topk_idx = torch.cat(idx_rows)
    counts = [align_up(int((recv_topk_idx == e).any(dim=1).sum()), expert_alignment) for e in range(experts_per_rank)]
    return RefDispatchResult(
        recv_x=torch.cat(rows),
        recv_topk_idx=recv_topk_idx,
        recv_topk_weights=torch.cat(weight_rows) if weight_rows else None,
        recv_src_rank=torch.cat(src_ranks),
        recv_src_idx=torch.cat(src_idxs),
        num_recv_tokens_per_expert=counts,
        rank_prefix_matrix=sent_to.cumsum(dim=0).int(),
    )


def ref_combine(
    expert_out_per_rank: list[torch.Tensor],
    src_rank_per_rank: list[torch.Tensor],
    src_idx_per_rank: list[torch.Tensor],
    rank: int,
    num_tokens: int,
    topk_weights_per_rank: list[torch.Tensor] | None = None,
    bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine seen from `rank`: for each of its `num_tokens` tokens, the unweighted sum of every row that
    some rank `j` received from it (`expert_out_per_rank[j] [N_j, H]`, identified by the receiver's
    `src_rank`/`src_idx`), plus `bias`. Accumulates in float64; returns the sum in the rows' dtype and the
    slot-wise sum of `topk_weights` (float32)."""
    hidden = expert_out_per_rank[0].size(1)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    weights = None
    if topk_weights_per_rank is not None:
        weights = torch.zeros(num_tokens, topk_weights_per_rank[0].size(1), dtype=torch.float64)
    for j, expert_out in enumerate(expert_out_per_rank):
        mine = src_rank_per_rank[j] == rank
        out.index_add_(0, src_idx_per_rank[j][mine], expert_out[mine].double())
        if weights is not None:
            weights.index_add_(0, src_idx_per_rank[j][mine], topk_weights_per_rank[j][mine].double())
    biases = () if bias is None else (bias if isinstance(bias, tuple) else (bias,))
    for b in biases:
        if b is not None:
            out += b.double()
    dtype = expert_out_per_rank[0].dtype
    return out.to(dtype), None if weights is None else weights.float()
