"""Communication at the borders of tensor-parallel (TP) and sequence-parallel (SP) regions, as autograd functions.

Legend: B sequences, S positions of the whole sequence, S_r the positions this TP rank holds, H hidden.

With sequence parallelism every TP rank holds a contiguous part of the sequence outside the TP regions (norms,
residuals, the MoE layer): `SequenceShards` says which (`torch.tensor_split` sizes along dim 1 of `[B, S, ...]`, so
any length splits, the first `S % tp` ranks holding one position more). Inside a TP region every rank holds the
whole sequence and a part of the heads / FFN columns / vocabulary.

    function                          forward                               backward
    copy_to_tensor_parallel           identity                              all-reduce (sum)
    reduce_from_tensor_parallel       all-reduce (sum)                      identity
    gather_from_sequence_parallel     all-gather along the sequence         reduce-scatter (sum) along the sequence
    reduce_scatter_to_sequence_par.   reduce-scatter (sum) along the seq.   all-gather along the sequence
    scatter_to_sequence_parallel      keep this rank's part                 zeros outside this rank's part

Gradient convention: the gradient of a tensor replicated over the TP ranks (a TP region's input, the whole sequence)
is a *partial sum* on each rank (each saw its heads / columns / positions); the reduce-scatter in the gather's
backward sums it. So `scatter(gather(x)[:, a:b])` reshards a sequence exactly, gradients included. Unequal parts are
padded to the largest for the collective (gloo and NCCL want equal sizes) and the padding is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe.layer.adjoint import adjoint_pair

# torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class SequenceShards:
    """How a sequence of `sum(sizes)` positions is split over the TP `group`: rank r holds positions
    `[offset(r), offset(r) + sizes[r])` (dim 1 of `[B, S, ...]` activations)."""

    group: dist.ProcessGroup
    rank: int
    sizes: tuple[int, ...]

    @classmethod
    def split(cls, length: int, group: dist.ProcessGroup) -> SequenceShards:
        """`length` positions over `group` as `torch.tensor_split` splits them (no communication)."""
        size = dist.get_world_size(group)
        base, extra = divmod(length, size)
        return cls(group, dist.get_rank(group), tuple(base + (r < extra) for r in range(size)))

    @property
    def length(self) -> int:
        return sum(self.sizes)

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def local_size(self) -> int:
        return self.sizes[self.rank]

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor (a view)."""
        return x.narrow(dim, self.offset, self.local_size)


def _all_gather_seq(x: torch.Tensor, shards: SequenceShards, dim: int) -> torch.Tensor:
    """`[.., S_r, ..] -> [.., S, ..]` along `dim` (padded to the largest part for the collective)."""
    width = max(shards.sizes)
    x0 = x.movedim(dim, 0)
    if x0.size(0) < width:
        x0 = F.pad(x0, (0, 0) * (x0.dim() - 1) + (0, width - x0.size(0)))
    x0 = x0.contiguous()
    out = x0.new_empty((len(shards.sizes) * width, *x0.shape[1:]))
    dist.all_gather_into_tensor(out, x0, group=shards.group)
    if any(s != width for s in shards.sizes):
        out = torch.cat([part[:s] for part, s in zip(out.split(width), shards.sizes)])
    return out.movedim(0, dim)


def _reduce_scatter_seq(x: torch.Tensor, shards: SequenceShards, dim: int) -> torch.Tensor:
    """`[.., S, ..]` partial sums -> `[.., S_r, ..]` this rank's part of the sum over the group."""
    width = max(shards.sizes)
    x0 = x.movedim(dim, 0)
    if any(s != width for s in shards.sizes):
        parts = x0.split(list(shards.sizes))
        x0 = torch.cat([F.pad(p, (0, 0) * (p.dim() - 1) + (0, width - p.size(0))) for p in parts])
    x0 = x0.contiguous()
    out = x0.new_empty((width, *x0.shape[1:]))
    _reduce_scatter_single(out, x0, group=shards.group)
    return out[: shards.local_size].movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# The gather's gradient is the reduce-scatter and the other way round (see the module docstring's table).
_GatherFromSP, _ReduceScatterToSP = adjoint_pair(
    _all_gather_seq, _reduce_scatter_seq, ("_GatherFromSP", "_ReduceScatterToSP")
)


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shards, dim):
        ctx.shards, ctx.dim = shards, dim
        return shards.local(x, dim).clone()

    @staticmethod
    def backward(ctx, grad):
        shards, dim = ctx.shards, ctx.dim
        after = shards.length - shards.offset - shards.local_size
        pad = [0, 0] * (grad.dim() - 1 - dim % grad.dim()) + [shards.offset, after]
        return F.pad(grad, pad), None, None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity; backward sums the ranks' partial gradients."""
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a TP region with a replicated output: sum the ranks' partial outputs; backward is the identity."""
    return _ReduceFromTP.apply(x, group)


def gather_from_sequence_parallel(x: torch.Tensor, shards: SequenceShards, dim: int = 1) -> torch.Tensor:
    """Enter a TP region from the SP region: `[B, S_r, ...] -> [B, S, ...]`; backward reduce-scatters (sums the
    ranks' partial input gradients and keeps this rank's positions)."""
    return _GatherFromSP.apply(x, shards, dim)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, shards: SequenceShards, dim: int = 1) -> torch.Tensor:
    """Leave a TP region into the SP region: partial sums `[B, S, ...]` -> this rank's positions of their sum
    `[B, S_r, ...]`; backward all-gathers."""
    return _ReduceScatterToSP.apply(x, shards, dim)


def scatter_to_sequence_parallel(x: torch.Tensor, shards: SequenceShards, dim: int = 1) -> torch.Tensor:
    """A whole-sequence tensor replicated on the TP ranks -> this rank's positions; backward puts the gradient at
    this rank's positions and zeros elsewhere (a partial sum, see the module docstring): no communication."""
    return _ScatterToSP.apply(x, shards, dim)
