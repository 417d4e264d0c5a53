"""Tensor-parallel layers built from their one-process modules by slicing (so a TP model holds exactly the slices
of the one-process weights): column / row parallel linears, the vocab-parallel embedding, the dense SwiGLU MLP.

Legend: B sequences, S positions, S_r this rank's positions (sequence parallel), H hidden, F FFN, V vocabulary,
tp the TP size. Every linear keeps nn.Linear's parameter names (`weight` is the local shard) and computes its local
GEMM with `getattr(self, "linear_fn", moe.layer.wgrad.linear)` (F.linear, whose weight gradient a zero-bubble pipeline
stage can defer), so an FP8 recipe that installs `linear_fn` composes with TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.layer import wgrad
from moe.layer.experts import SwiGLUMLP
from moe.layer.parallel.mappings import (
    SequenceShards,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
)
from moe.layer.parallel.sharding import TPShard, tag_sequence_parallel_grad, tag_sharded


def _sliced(param: torch.Tensor, shard: TPShard) -> nn.Parameter:
    return tag_sharded(nn.Parameter(shard.shard(param.detach()), requires_grad=param.requires_grad), shard)


def _empty_linear(cls, in_features: int, out_features: int, bias: bool, like: nn.Linear):
    # Built on the meta device: the parameters are replaced by the slices right after (no throwaway allocation).
    return cls(in_features, out_features, bias=bias, device="meta", dtype=like.weight.dtype)


class ColumnParallelLinear(nn.Linear):
    """`y = x W^T (+ b)` with W's output rows (and b) split over TP: `weight [out/tp, in]`, output `[.., out/tp]`.

    `forward(x, shards)`: with `shards`, `x` is this rank's sequence part `[B, S_r, in]`, all-gathered first (its
    backward reduce-scatters the input gradient); without, `x` is the whole sequence already gathered by
    `gather_from_sequence_parallel` (whose backward sums the ranks' partial input gradients).
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, size: int, chunks: int = 1) -> ColumnParallelLinear:
        shard = TPShard(0, chunks, rank, size)
        out = _empty_linear(cls, linear.in_features, linear.out_features // size, linear.bias is not None, linear)
        out.weight = _sliced(linear.weight, shard)
        if linear.bias is not None:
            out.bias = _sliced(linear.bias, shard)
        return out

    def forward(self, x: torch.Tensor, shards: SequenceShards | None = None) -> torch.Tensor:
        if shards is not None:
            x = gather_from_sequence_parallel(x, shards)
        return getattr(self, "linear_fn", wgrad.linear)(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """`y = x W^T + b` with W's input columns split over TP: `weight [out, in/tp]`, input `[B, S, in/tp]` (this
    rank's heads / FFN columns); the ranks' partial products are reduce-scattered along the sequence (`shards`) or
    all-reduced (`shards=None`), then the replicated bias is added once (its gradient is a sequence-parallel partial
    sum)."""

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, size: int, group: dist.ProcessGroup | None = None
    ) -> RowParallelLinear:
        out = _empty_linear(cls, linear.in_features // size, linear.out_features, linear.bias is not None, linear)
        out.weight = _sliced(linear.weight, TPShard(1, 1, rank, size))
        out.tp_group = group  # for the all-reduce when called without sequence shards
        if linear.bias is not None:
            out.bias = tag_sequence_parallel_grad(nn.Parameter(linear.bias.detach().clone()))
        return out

    def forward(self, x: torch.Tensor, shards: SequenceShards | None = None) -> torch.Tensor:
        partial = getattr(self, "linear_fn", wgrad.linear)(x, self.weight, None)
        if shards is not None:
            y = reduce_scatter_to_sequence_parallel(partial, shards)
        else:
            y = reduce_from_tensor_parallel(partial, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows `[vocab_start, vocab_start + V/tp)` of the embedding table: `weight [V/tp, H]`.

    `forward(ids)` returns this rank's *partial* embedding `[.., H]` (zero for ids outside its rows): the sum over
    the TP group is the embedding. The caller reduces it (the model reduce-scatters it into the sequence parallel
    region, and again for each MTP depth's shifted tokens).
    """

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, rank: int, size: int) -> VocabParallelEmbedding:
        V, H = emb.weight.shape
        out = cls(V // size, H, device="meta", dtype=emb.weight.dtype)
        out.weight = _sliced(emb.weight, TPShard(0, 1, rank, size))
        out.vocab_start = rank * (V // size)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        return emb.masked_fill(outside.unsqueeze(-1), 0.0)


class ParallelSwiGLUMLP(SwiGLUMLP):
    """The dense SwiGLU MLP with its FFN dimension split over TP: `w13 [H, 2F/tp]` (this rank's gate columns, then
    its up columns), `w2 [F/tp, H]`. `forward(x [B, S_r, H], shards)`: all-gather the sequence, the local SwiGLU,
    reduce-scatter the partial output back to `[B, S_r, H]`."""

    @classmethod
    def from_mlp(cls, mlp: SwiGLUMLP, rank: int, size: int) -> ParallelSwiGLUMLP:
        H, F2 = mlp.w13.shape
        out = cls(H, F2 // 2 // size, dtype=mlp.w13.dtype, device="meta")
        out.w13 = _sliced(mlp.w13, TPShard(1, 2, rank, size))
        out.w2 = _sliced(mlp.w2, TPShard(0, 1, rank, size))
        out.recompute = mlp.recompute  # the model's recompute setting survives parallelize
        return out

    def forward(self, x_BSH: torch.Tensor, shards: SequenceShards | None = None) -> torch.Tensor:
        if shards is None:
            raise ValueError("ParallelSwiGLUMLP needs the sequence shards of its input")
        partial = super().forward(gather_from_sequence_parallel(x_BSH, shards))
        return reduce_scatter_to_sequence_parallel(partial, shards)


def check_divisible(what: str, value: int, size: int) -> None:
    if value % size:
        raise ValueError(f"{what}={value} is not divisible by the tensor-parallel size {size}")
