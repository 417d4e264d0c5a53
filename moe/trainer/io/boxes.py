"""Where a rank's tensor sits in a layout-independent ("global") tensor, as boxes: the geometry of the sharded
checkpoints (moe/trainer/io/shard_files.py, moe/trainer/train/checkpoint/).

A rank holds, of a global tensor (a whole parameter of the model, or its optimizer state), a *local* tensor:
- expert tensors: the local experts, rows `[e0, e0 + L)` of dim 0 (`dim0_offset = e0`);
- tensor-parallel shards (`moe.layer.parallel.sharding.TPShard`): along `tp.dim`, of each of the `tp.chunks` equal
  blocks, the `tp.rank`-th of `tp.size` parts;
- under ZeRO-1, only the elements `[lo, hi)` of the local tensor in row-major order (`flat`): a bucket shard may
  start and end anywhere inside a parameter.
`pieces(placement)` cuts the rank's part into boxes (hyper-rectangles) that are each a box of the global tensor as
well, together with where each lies in the rank's flat data. A checkpoint stores every box with its global offsets;
a rank of another layout finds the boxes it needs by intersecting its own pieces with the stored ones.

A flat range `[lo, hi)` of a row-major tensor of n dimensions is a union of at most `2n - 1` boxes, each contiguous
in memory (a partial first row, whole rows, a partial last row, recursively), so a ZeRO-1 segment is stored
without gathering anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe.layer.parallel.sharding import TPShard


@dataclass(frozen=True)
class Box:
    """`shape` elements starting at `offsets` (one entry per dimension; both empty for a 0-d tensor)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} must be >= 0")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    def intersect(self, other: Box) -> Box | None:
        """The common box, None when it is empty."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """The slices that select this box from a tensor holding `outer` (which must contain it)."""
        rel = tuple(a - b for a, b in zip(self.offsets, outer.offsets))
        if any(r < 0 for r in rel) or any(r + s > o for r, s, o in zip(rel, self.shape, outer.shape)):
            raise ValueError(f"{self} is not inside {outer}")
        return tuple(slice(r, r + s) for r, s in zip(rel, self.shape))

    def inside(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(e <= s for e, s in zip(self.end, shape))

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> Box:
        return cls(tuple(int(v) for v in d["offsets"]), tuple(int(v) for v in d["shape"]))


@dataclass(frozen=True)
class Placement:
    """How one rank's tensor maps into the global tensor (see the module docstring).

    global_shape: the whole tensor (every expert, every TP shard).
    local_shape: the rank's local tensor (its experts, its TP shard), before any flat range.
    dim0_offset: the global index of the local tensor's first row along dim 0 (expert tensors).
    tp: the tensor-parallel shard, None when the tensor is not TP sharded (or TP is 1).
    flat: ZeRO-1: the rank holds elements `[lo, hi)` of the local tensor (row-major) only; None: all of it.
    """

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dim0_offset: int = 0
    tp: TPShard | None = None
    flat: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        n = math.prod(self.local_shape)
        if self.flat is not None and not 0 <= self.flat[0] <= self.flat[1] <= n:
            raise ValueError(f"flat range {self.flat} is not inside a local tensor of {n} elements")
        if len(self.global_shape) != len(self.local_shape):
            raise ValueError(f"global shape {self.global_shape} and local shape {self.local_shape} differ in rank")
        if self.tp is not None and self.tp.size > 1:
            g, local = self.global_shape[self.tp.dim], self.local_shape[self.tp.dim]
            if g % (self.tp.chunks * self.tp.size) or local * self.tp.size != g:
                raise ValueError(f"TP shard {self.tp} of dim {self.tp.dim}: {local} local of {g} global rows")

    @property
    def flat_range(self) -> tuple[int, int]:
        return self.flat if self.flat is not None else (0, math.prod(self.local_shape))

    @property
    def numel(self) -> int:
        lo, hi = self.flat_range
        return hi - lo


@dataclass(frozen=True)
class Piece:
    """A box of the global tensor and where its data is in the rank's flat data: the elements `[a, b)` of the
    local tensor (row-major) form the contiguous box `segment` of the local tensor, of which this piece selects
    `part` (slices relative to `segment`)."""

    global_box: Box
    a: int
    b: int
    segment: Box
    part: tuple[slice, ...]

    def view(self, flat: torch.Tensor, lo: int) -> torch.Tensor:
        """This piece's elements, a view of `flat` (1-D: the local elements `[lo, lo + flat.numel())`)."""
        return flat[self.a - lo : self.b - lo].view(self.segment.shape)[self.part]


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[int, int, Box]]:
    """The elements `[lo, hi)` of a row-major tensor of `shape` as boxes, each contiguous in memory:
    `[(a, b, box)]` in order, the box holding the elements `[a, b)`."""
    if lo >= hi:
        return []
    if not shape:
        return [(0, 1, Box((), ()))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = lo // inner, (hi - 1) // inner
    if first == last:  # inside one row (of the first dimension): recurse into it
        return [
            (first * inner + a, first * inner + b, Box((first, *box.offsets), (1, *box.shape)))
            for a, b, box in flat_boxes(shape[1:], lo - first * inner, hi - first * inner)
        ]
    out = []
    start, stop = first, last + 1  # whole rows [start, stop) in the middle
    if lo % inner:
        out += flat_boxes(shape, lo, (first + 1) * inner)
        start = first + 1
    tail = []
    if hi % inner:
        tail = flat_boxes(shape, last * inner, hi)
        stop = last
    if stop > start:
        out.append((start * inner, stop * inner, Box((start, *[0] * (len(shape) - 1)), (stop - start, *shape[1:]))))
    return out + tail


def _affine_blocks(p: Placement) -> list[tuple[Box, tuple[int, ...]]]:
    """The local tensor as boxes that each map to the global tensor by a translation: `[(local box, global offset of
    its first element)]`. One box, unless a TP shard with chunks cuts its dimension into `chunks` blocks."""
    nd = len(p.local_shape)
    base = [0] * nd
    if nd:
        base[0] = p.dim0_offset
    if p.tp is None or p.tp.size == 1:
        return [(Box((0,) * nd, p.local_shape), tuple(base))]
    d, c = p.tp.dim, p.tp.chunks
    local_block = p.local_shape[d] // c
    global_block = p.global_shape[d] // c
    blocks = []
    for k in range(c):
        offsets = [0] * nd
        offsets[d] = k * local_block
        shape = list(p.local_shape)
        shape[d] = local_block
        origin = list(base)
        origin[d] += k * global_block + p.tp.rank * local_block
        blocks.append((Box(tuple(offsets), tuple(shape)), tuple(origin)))
    return blocks


def pieces(p: Placement) -> list[Piece]:
    """The rank's part of the global tensor as boxes of it (see the module docstring), in the order of the rank's
    flat data. Their global boxes do not overlap and lie inside `global_shape` (ValueError otherwise)."""
    lo, hi = p.flat_range
    out = []
    for a, b, segment in flat_boxes(p.local_shape, lo, hi):
        for local, origin in _affine_blocks(p):
            common = segment.intersect(local)
            if common is None or common.numel == 0:
                continue
            offsets = tuple(o + c - lb for o, c, lb in zip(origin, common.offsets, local.offsets))
            box = Box(offsets, common.shape)
            if not box.inside(p.global_shape):
                raise ValueError(f"{box} of {p} lies outside the global shape {p.global_shape}")
            out.append(Piece(box, a, b, segment, common.within(segment)))
    return out


def check_tiling(global_shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """None when `boxes` cover `global_shape` exactly once (inside it, no overlap, nothing missing); otherwise what
    is wrong."""
    total = math.prod(global_shape)
    for box in boxes:
        if not box.inside(global_shape):
            return f"{box} lies outside {global_shape}"
    for i, x in enumerate(boxes):
        for y in boxes[i + 1 :]:
            common = x.intersect(y)
            if common is not None and common.numel:
                return f"{x} and {y} overlap"
    covered = sum(b.numel for b in boxes)
    if covered != total:
        return f"{covered} of {total} elements stored"
    return None
