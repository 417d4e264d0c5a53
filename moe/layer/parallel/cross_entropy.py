"""Cross entropy over logits whose vocabulary is split over the tensor-parallel group (Megatron's vocab-parallel
cross entropy): no rank ever holds the whole `[N, V]` logits.

Legend: N rows (tokens), V vocabulary, V_r = V / tp the columns `[vocab_start, vocab_start + V_r)` of this rank.

Per row, in float32 whatever the logits' dtype: `m = max over V` (all-reduce MAX of the local maxima), then one
all-reduce (SUM) of `[sum exp(z - m), z_target - m]` (only the rank holding the target contributes the latter);
`loss = log(sum exp) - (z_target - m)`. The loss rows are identical on every rank. Backward (no communication):
`d z = (softmax(z) - onehot(target)) * d loss` on the local columns; ignored rows get zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, targets_N, vocab_start, group, ignore_index):
        z = logits_NV.float()
        row_max = z.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z = z - row_max.unsqueeze(-1)
        local_t = targets_N - vocab_start
        mine = (local_t >= 0) & (local_t < z.size(-1))
        target_logit = torch.where(mine, z.gather(-1, local_t.clamp(0, z.size(-1) - 1).unsqueeze(-1)).squeeze(-1), 0.0)
        exp = z.exp_()
        sums = torch.stack((exp.sum(dim=-1), target_logit))
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums
        valid = targets_N != ignore_index
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, mine & valid, valid)
        ctx.logits_dtype = logits_NV.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_N):
        softmax, local_t, target_here, valid = ctx.saved_tensors
        grad = softmax.mul_((grad_N * valid).unsqueeze(-1))
        rows = target_here.nonzero().squeeze(-1)
        grad[rows, local_t[rows]] -= grad_N[rows]
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-row cross entropy `[N] float32` (0 for rows whose target is `ignore_index`), the same on every rank.

    Args:
        logits_NV: `[N, V_r]` this rank's vocabulary columns (any float dtype; computed in float32).
        targets_N: `[N] int64` global token ids, or `ignore_index`.
        vocab_start: the global id of this rank's first column.
        group: the tensor-parallel group holding the other columns.
    """
    if logits_NV.dim() != 2 or targets_N.shape != logits_NV.shape[:1]:
        raise ValueError(
            f"logits must be [N, V_r] and targets [N], got {tuple(logits_NV.shape)} and {tuple(targets_N.shape)}"
        )
    return _VocabParallelCrossEntropy.apply(logits_NV, targets_N.long(), vocab_start, group, ignore_index)
