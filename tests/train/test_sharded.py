"""The boxes of sharded checkpoints (moe/trainer/io/boxes.py) against plain slicing: every rank's pieces of a global
tensor hold exactly the global elements their boxes name, and the ranks' boxes tile the tensor once, for expert
shards, tensor-parallel shards with chunks (the dense SwiGLU's [gate | up]) and ZeRO-1 flat ranges that start and
end anywhere."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moe.layer.parallel.sharding import TPShard
from moe.trainer.io.boxes import Box, Placement, check_tiling, flat_boxes, pieces


def _local(full: torch.Tensor, ep_rank: int, ep: int, tp: TPShard | None) -> torch.Tensor:
    """The reference local tensor: rows of dim 0 for the EP rank, then the TP shard (moe.layer.parallel.sharding)."""
    n = full.size(0) // ep
    t = full[ep_rank * n : (ep_rank + 1) * n] if ep > 1 else full
    return tp.shard(t) if tp is not None else t.contiguous()


@pytest.mark.parametrize("shape", [(7,), (4, 6), (3, 4, 5), (2, 3, 2, 4)])
def test_flat_boxes_are_contiguous_and_cover_the_range(shape):
    rng = random.Random(sum(shape))
    n = math.prod(shape)
    t = torch.arange(n).view(shape)
    for _ in range(40):
        lo = rng.randrange(0, n)
        hi = rng.randrange(lo + 1, n + 1)
        boxes = flat_boxes(shape, lo, hi)
        assert len(boxes) <= 2 * len(shape) - 1
        assert boxes[0][0] == lo and boxes[-1][1] == hi
        for (a, b, box), nxt in zip(boxes, [*boxes[1:], None]):
            assert t[box.within(Box((0,) * len(shape), shape))].reshape(-1).tolist() == list(range(a, b))
            if nxt is not None:
                assert nxt[0] == b


@pytest.mark.parametrize(
    "shape, ep, tp_dim, chunks, tp",
    [
        ((8, 6, 4), 4, None, 1, 1),  # experts [E, H, 2F] over 4 EP ranks
        ((6, 12), 1, 1, 2, 2),  # dense SwiGLU w13 [H, 2F]: [gate | up], each split over TP 2
        ((10, 12), 1, 0, 1, 2),  # a row-split weight
        ((8, 6, 4), 2, None, 1, 1),
        ((16,), 1, None, 1, 1),  # a vector (norm weight, expert bias)
        ((24, 6), 1, 0, 3, 2),  # 3 blocks along dim 0, split over 2
    ],
)
@pytest.mark.parametrize("zero", [1, 3])
def test_pieces_hold_their_global_boxes_and_tile_the_tensor(shape, ep, tp_dim, chunks, tp, zero):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=gen)
    boxes = []
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            shard = TPShard(tp_dim, chunks, tp_rank, tp) if tp_dim is not None else None
            local = _local(full, ep_rank, ep, shard)
            n = local.numel()
            cuts = sorted({0, n, *random.Random(ep_rank * 7 + tp_rank).sample(range(1, n), zero - 1)})
            for lo, hi in zip(cuts, cuts[1:]):  # ZeRO-1: the local tensor's elements split over `zero` ranks
                flat = local.reshape(-1)[lo:hi].clone()
                p = Placement(shape, tuple(local.shape), ep_rank * local.size(0) if ep > 1 else 0, shard,
                              None if zero == 1 else (lo, hi))  # fmt: skip
                for piece in pieces(p):
                    data = piece.view(flat if zero > 1 else local.reshape(-1), lo if zero > 1 else 0)
                    torch.testing.assert_close(data, full[piece.global_box.within(Box((0,) * len(shape), shape))],
                                               rtol=0, atol=0)  # fmt: skip
                    boxes.append(piece.global_box)
    assert check_tiling(shape, boxes) is None


def test_tiling_problems_are_named():
    assert "overlap" in check_tiling((4, 4), [Box((0, 0), (2, 4)), Box((1, 0), (3, 4))])
    assert "12 of 16" in check_tiling((4, 4), [Box((0, 0), (3, 4))])
    assert "outside" in check_tiling((4, 4), [Box((0, 0), (5, 4))])


def test_bad_placements_raise():
    with pytest.raises(ValueError, match="flat range"):
        Placement((4,), (4,), flat=(2, 6))
    with pytest.raises(ValueError, match="TP shard"):
        Placement((10, 4), (4, 4), tp=TPShard(0, 1, 0, 2))
