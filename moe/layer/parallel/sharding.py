"""Tensor-parallel shards of parameters: the tags of the issue-11 contract and the full <-> shard maps.

A sharded parameter carries
- `tensor_parallel_dim = d` (the contract's tag): a shard of the full tensor along dim d over the TP group;
- `tensor_parallel_shard = TPShard(dim, chunks, rank, size)`: enough to go between the full tensor and the shard.
  `chunks` > 1 when the full tensor's dim d is made of equal blocks each split over TP (Megatron's partition
  stride): the dense SwiGLU `w13 [H, 2F]` holds the gate columns then the up columns, and rank r keeps the r-th
  part of each, `[gate_r | up_r]`.
A TP-replicated parameter of the sequence-parallel model carries `sequence_parallel_grad = True`: every TP rank's
gradient is a partial sum (it saw its positions only), the full gradient is their sum over the TP group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size` holds, of each of the `chunks` equal blocks along `dim`, the rank-th of `size` parts."""

    dim: int
    chunks: int
    rank: int
    size: int

    def full_shape(self, local_shape: torch.Size) -> torch.Size:
        shape = list(local_shape)
        shape[self.dim] *= self.size
        return torch.Size(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `full` (a new contiguous tensor)."""
        if full.size(self.dim) % (self.chunks * self.size):
            raise ValueError(
                f"dim {self.dim} of {tuple(full.shape)} does not split into {self.chunks} x {self.size} equal parts"
            )
        blocks = full.chunk(self.chunks, dim=self.dim)
        return torch.cat([b.chunk(self.size, dim=self.dim)[self.rank] for b in blocks], dim=self.dim).contiguous()

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (`parts[r]` from rank r)."""
        split = [p.chunk(self.chunks, dim=self.dim) for p in parts]
        return torch.cat([split[r][c] for c in range(self.chunks) for r in range(self.size)], dim=self.dim)


def tag_sharded(param: nn.Parameter, shard: TPShard) -> nn.Parameter:
    param.tensor_parallel_dim = shard.dim
    param.tensor_parallel_shard = shard
    return param


def tag_sequence_parallel_grad(param: nn.Parameter) -> nn.Parameter:
    param.sequence_parallel_grad = True
    return param


def tp_shard_of(tensor: torch.Tensor) -> TPShard | None:
    return getattr(tensor, "tensor_parallel_shard", None)


def gather_shards(local: torch.Tensor, shard: TPShard, group: dist.ProcessGroup) -> torch.Tensor:
    """The full tensor from every TP rank's `local` shard (collective over `group`). Gathered as bytes, so any
    dtype crosses any backend (gloo has no float8)."""
    raw = local.detach().contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(shard.size)]
    dist.all_gather(parts, raw, group=group)
    return shard.unshard([p.view(local.dtype).view(local.shape) for p in parts])
