"""`get_dispatch_layout` in Triton: from `topk_idx` the tokens each rank receives, the tokens each expert receives,
and which ranks each token reaches. No communication: a local kernel (no wait, no flag)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sync import block_size

# Tokens per program: the interpreter costs ~2.6 ms per program instance, a GPU wants a few hundred tokens per CTA.
BLOCK_TOKENS = 256


@triton.jit
def layout_kernel(topk_idx, num_tokens, experts_per_rank, num_ranks, per_rank, per_expert, in_rank,
                  NUM_TOPK: tl.constexpr, RANKS: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """One program per `BLOCK_T` tokens: `topk_idx [T, NUM_TOPK]` int64 (-1: none) -> `in_rank [T, R]` uint8,
    counts added into `per_rank [R]` and `per_expert [E]` int32 (zeroed by the host)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    ranks = tl.arange(0, RANKS)
    hits = tl.zeros([BLOCK_T, RANKS], dtype=tl.int32)
    for k in tl.static_range(NUM_TOPK):
        expert = tl.load(topk_idx + tokens.to(tl.int64) * NUM_TOPK + k, mask=token_mask, other=-1)
        valid = expert >= 0
        tl.atomic_add(per_expert + expert, tl.full([BLOCK_T], 1, tl.int32), mask=valid)
        owner = tl.where(valid, expert // experts_per_rank, -1)
        hits += (owner[:, None] == ranks[None, :]).to(tl.int32)
    reached = (hits > 0).to(tl.int32)
    rank_mask = ranks < num_ranks
    store_mask = (tokens[:, None] < num_tokens) & (ranks[None, :] < num_ranks)
    tl.store(in_rank + tokens.to(tl.int64)[:, None] * num_ranks + ranks[None, :], reached.to(tl.uint8), mask=store_mask)
    tl.atomic_add(per_rank + ranks, tl.sum(reached, axis=0), mask=rank_mask)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """`(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)` of
    `topk_idx [T, K]` int64 on its device."""
    topk_idx = topk_idx.contiguous()
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    per_rank = torch.zeros(num_ranks, dtype=torch.int32, device=device)
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device=device)
    in_rank = torch.zeros((num_tokens, num_ranks), dtype=torch.bool, device=device)
    if num_tokens > 0:
        block = min(BLOCK_TOKENS, block_size(num_tokens))
        layout_kernel[(triton.cdiv(num_tokens, block),)](
            topk_idx, num_tokens, num_experts // num_ranks, num_ranks, per_rank, per_expert, in_rank.view(torch.uint8),
            NUM_TOPK=num_topk, RANKS=block_size(num_ranks), BLOCK_T=block,
        )  # fmt: skip
    return per_rank, per_expert, in_rank


# Ahead-of-time compile spec (mtdeepep.kernels.aot): top-8 of 256 experts on 8 ranks, the GPU block.
AOT_SPECS = [
    {
        "name": "layout.dispatch_layout",
        "fn": layout_kernel,
        "signature": {
            "topk_idx": "*i64",
            "num_tokens": "i32",
            "experts_per_rank": "i32",
            "num_ranks": "i32",
            "per_rank": "*i32",
            "per_expert": "*i32",
            "in_rank": "*u8",
            "NUM_TOPK": "constexpr",
            "RANKS": "constexpr",
            "BLOCK_T": "constexpr",
        },  # fmt: skip
        "constexprs": {"NUM_TOPK": 8, "RANKS": 8, "BLOCK_T": BLOCK_TOKENS},
        "flags": False,
    }
]
