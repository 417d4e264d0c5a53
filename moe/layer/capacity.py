"""Expert capacity: drop the slots an expert cannot take, and pad or truncate per-expert rows to one length.

Legend: T tokens, K top-k slots, E experts, N rows sorted by expert, L experts in a sorted buffer, P padded length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """`ceil(num_tokens * topk / num_experts * capacity_factor)`: slots one expert accepts from `num_tokens`."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


@dataclass
class CapacityResult:
    """Routing after the capacity limit.

    probs_TK: `[T, K] float32`, 0 where the slot was dropped (gradient still flows to the kept ones).
    topk_idx_TK: `[T, K] int64`, -1 where the slot was dropped.
    keep_TK: `[T, K] bool`.
    num_dropped: number of dropped slots.
    capacity: the per-expert capacity used.
    """

    probs_TK: torch.Tensor
    topk_idx_TK: torch.Tensor
    keep_TK: torch.Tensor
    num_dropped: int
    capacity: int


def apply_capacity(
    probs_TK: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, capacity: int, policy: str = "probs"
) -> CapacityResult:
    """Keep at most `capacity` slots per expert.

    Args:
        probs_TK: `[T, K]` routing weights.
        topk_idx_TK: `[T, K] int64` expert ids (-1 = already dropped, ignored).
        policy: 'probs' keeps each expert's highest-weight slots; 'position' keeps its earliest tokens.
    """
    if policy not in ("probs", "position"):
        raise ValueError(f"unknown token drop policy {policy!r}; expected 'probs' or 'position'")
    T, K = topk_idx_TK.shape
    valid_TK = topk_idx_TK >= 0
    idx_TK = topk_idx_TK.clamp(min=0)
    token_V = torch.arange(T, device=idx_TK.device).unsqueeze(1).expand(T, K)[valid_TK]
    expert_V = topk_idx_TK[valid_TK]
    routed_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=idx_TK.device)
    routed_TE[token_V, expert_V] = True
    if policy == "probs":
        # Routed slots have weight >= 0; unrouted entries get -1 so they never outrank a routed one.
        weight_TE = torch.full((T, num_experts), -1.0, dtype=torch.float32, device=idx_TK.device)
        weight_TE[token_V, expert_V] = probs_TK.detach().float()[valid_TK]
        top_CE = weight_TE.topk(min(capacity, T), dim=0).indices
        keep_TE = torch.zeros_like(routed_TE).scatter_(0, top_CE, True) & routed_TE
    else:
        keep_TE = routed_TE & (routed_TE.long().cumsum(dim=0) <= capacity)
    keep_TK = keep_TE.gather(1, idx_TK) & valid_TK
    num_dropped = int(valid_TK.sum() - keep_TK.sum())
    return CapacityResult(
        probs_TK=probs_TK * keep_TK,
        topk_idx_TK=torch.where(keep_TK, topk_idx_TK, torch.full_like(topk_idx_TK, -1)),
        keep_TK=keep_TK,
        num_dropped=num_dropped,
        capacity=capacity,
    )


@dataclass
class PadPlan:
    """How rows sorted by expert map into a `[L, P]` buffer (each expert's rows padded or truncated to `P`).

    src_rows: `[M] int64` rows of the sorted input that are kept. dst_rows: `[M] int64` their rows in the flattened
    `[L * P]` buffer. num_dropped: rows beyond `P` of some expert.
    """

    num_experts: int
    length: int
    num_rows: int
    src_rows: torch.Tensor
    dst_rows: torch.Tensor
    num_dropped: int


def plan_padding(tokens_per_expert: list[int], length: int, device: torch.device | str = "cpu") -> PadPlan:
    """Plan to pad (zeros) or truncate (keep the first `length` rows) every expert's rows to `length`."""
    src, dst, dropped = [], [], 0
    start = 0
    for e, count in enumerate(tokens_per_expert):
        kept = min(count, length)
        src.append(torch.arange(start, start + kept))
        dst.append(torch.arange(e * length, e * length + kept))
        dropped += count - kept
        start += count
    empty = torch.zeros(0, dtype=torch.int64)
    return PadPlan(
        num_experts=len(tokens_per_expert),
        length=length,
        num_rows=start,
        src_rows=torch.cat(src).to(device) if src else empty.to(device),
        dst_rows=torch.cat(dst).to(device) if dst else empty.to(device),
        num_dropped=dropped,
    )


def pad_rows(x_NH: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """`[N, H]` rows sorted by expert -> `[L * P, H]` padded buffer (differentiable)."""
    out = x_NH.new_zeros(plan.num_experts * plan.length, x_NH.size(1))
    return out.index_copy(0, plan.dst_rows, x_NH.index_select(0, plan.src_rows))


def unpad_rows(y_MH: torch.Tensor, plan: PadPlan) -> torch.Tensor:
    """Inverse of `pad_rows`: `[L * P, H]` -> `[N, H]`; truncated rows come back as zeros (differentiable)."""
    out = y_MH.new_zeros(plan.num_rows, y_MH.size(1))
    return out.index_copy(0, plan.src_rows, y_MH.index_select(0, plan.dst_rows))


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment
