"""Which decoder layers, MTP depths, embedding and head each pipeline rank holds, as the trainer places them.

Stages come from `moe.trainer.pipeline.split.split_layers` (even split, placeholder slots padding the last stages) over
`pp * vpp` stages; rank r holds stage r (1F1B, ZB-H1, no pipeline), stages r and 2pp-1-r (DualPipeV's V, from
`moe.trainer.pipeline.split.stages_of_rank`), or stages r, r + pp, ... (interleaved 1F1B, Megatron's placement). The
embedding sits on stage 0; the final norm, output head and MTP depths on the last stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from moe.trainer.pipeline.split import split_layers, stages_of_rank
from moe.trainer.plan.space import Candidate


@dataclass(frozen=True)
class Chunk:
    """One model chunk (pipeline stage) a rank holds: its decoder layers, and whether it is the first stage
    (embedding) and / or the last (final norm, head, MTP depths)."""

    stage: int
    layers: tuple[int, ...]
    first: bool
    last: bool

    def signature(self, first_dense: int) -> tuple[int, int, bool, bool]:
        """What the estimates depend on: `(dense layers, MoE layers, first, last)`."""
        dense = sum(i < first_dense for i in self.layers)
        return dense, len(self.layers) - dense, self.first, self.last


@functools.cache
def _split(num_layers: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    split = split_layers(num_layers, num_stages)
    return tuple(tuple(split.layers(s)) for s in range(num_stages))


def rank_chunks(cand: Candidate, num_layers: int) -> list[list[Chunk]]:
    """`[pp rank] -> the chunks it holds`, in the order its schedule lists them."""
    return _rank_chunks(cand.schedule, cand.pp, cand.vpp, num_layers)


def distinct_ranks(cand: Candidate, num_layers: int, first_dense: int) -> list[tuple[int, list[Chunk]]]:
    """`(pp rank, its chunks)` for the first rank of every distinct chunk signature: later ranks with the same
    chunks hold no more micro-batches (`inflight` does not grow with the rank), so they cannot be worse."""
    seen, out = set(), []
    for r, chunks in enumerate(rank_chunks(cand, num_layers)):
        key = tuple(c.signature(first_dense) for c in chunks)
        if key not in seen:
            seen.add(key)
            out.append((r, chunks))
    return out


@functools.cache
def _rank_chunks(schedule: str, pp: int, vpp: int, num_layers: int) -> list[list[Chunk]]:
    stages = pp * vpp
    layers = _split(num_layers, stages)
    out = []
    for r in range(pp):
        if schedule == "dualpipev":
            ids = stages_of_rank("dualpipev", pp, r)
        elif schedule == "interleaved":
            ids = [r + k * pp for k in range(vpp)]
        else:
            ids = [r]
        out.append([Chunk(s, layers[s], s == 0, s == stages - 1) for s in ids])
    return out


def inflight(cand: Candidate, pp_rank: int, micro_batches: int) -> list[float]:
    """Micro-batches whose activations each chunk of `pp_rank` holds at its peak (aligned with `rank_chunks`).

    No pipeline: 1. 1F1B and ZB-H1: `min(pp - r, m)` (the warm-up depth; ZB-H1 keeps 1F1B's activation memory).
    DualPipeV: the DualPipe table's PP + 1 chunk-micro-batches per device (PP = 2 pp stages), at most 2m: pp + 1 on
    the rank's first chunk, pp on its second. Interleaved: Megatron's warm-up `2 (pp - r - 1) + (v - 1) pp + 1`
    chunk-micro-batches, at most m v, spread evenly over the rank's v chunks.
    """
    m, pp = micro_batches, cand.pp
    if cand.schedule == "none":
        return [1.0]
    if cand.schedule in ("1f1b", "zbh1"):
        return [float(min(pp - pp_rank, m))]
    if cand.schedule == "dualpipev":
        total = min(2 * pp + 1, 2 * m)
        first = min(pp + 1, m, total)
        return [float(first), float(min(total - first, m))]
    total = min(2 * (pp - pp_rank - 1) + (cand.vpp - 1) * pp + 1, m * cand.vpp)
    return [total / cand.vpp] * cand.vpp
