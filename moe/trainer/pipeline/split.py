"""Which decoder layers each pipeline stage runs (`StageSplit`), and which stages each pipeline rank holds.

Stages are numbered in model order `0 .. S-1`. 1F1B and ZB-H1 run one stage per rank (`S = P`, rank r holds stage
r); DualPipeV runs two (`S = 2P`) in a V: rank r holds stages r and 2P-1-r, so rank 0 holds both the first stage
(the embedding) and the last (norm, output head, MTP and the losses).

Virtual pipeline stages (Megatron's `--num-virtual-stages-per-pipeline-rank V`, interleaved 1F1B and interleaved
zero bubble): `S = V * P` stages placed round-robin, rank r holds stages r, r + P, ..., r + (V-1)P. The embedding is
on stage 0 (rank 0), the head, MTP and losses on stage S-1 (rank P-1).

A split is either even, or given Megatron-core's way: `decoder_first_pipeline_num_layers` and / or
`decoder_last_pipeline_num_layers` for the outer stages and the rest shared evenly by the others. With V virtual
stages these count the layers of the first / last pipeline RANK, shared evenly by its V stages (Megatron-core's
`num_layers_in_first/last_pipeline_stage` under a virtual pipeline): each must divide by V, and so must the layers
of every other rank. When the layers do not divide evenly and no outer sizes are given, empty placeholder slots pad
them to the next multiple of S (as DeepSeek-V3 pads 61 layers to 64 for its 16 DualPipe stages); the placeholders
go to the last stages, which also run the head and the MTP modules. A placeholder runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULE_STAGES_PER_RANK = {"1f1b": 1, "zbh1": 1, "dualpipev": 2}


@dataclass(frozen=True)
class StageSplit:
    """`slots[s]`: the decoder layer indices of stage s in order, None for a placeholder slot."""

    slots: tuple[tuple[int | None, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.slots)

    def layers(self, stage: int) -> list[int]:
        """The real decoder layers of `stage`, ascending."""
        return [i for i in self.slots[stage] if i is not None]

    def num_placeholders(self, stage: int) -> int:
        return sum(i is None for i in self.slots[stage])

    def describe(self) -> str:
        """E.g. `'stage 0: layers 0-1 | stage 1: layers 2-3 + 1 placeholder'`."""
        parts = []
        for s in range(self.num_stages):
            real = self.layers(s)
            text = f"layers {real[0]}-{real[-1]}" if len(real) > 1 else (f"layer {real[0]}" if real else "no layer")
            pad = self.num_placeholders(s)
            parts.append(f"stage {s}: {text}" + (f" + {pad} placeholder{'s' * (pad > 1)}" if pad else ""))
        return " | ".join(parts)


def split_layers(
    num_layers: int,
    num_stages: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    virtual_stages: int = 1,
) -> StageSplit:
    """The split of `num_layers` decoder layers over `num_stages` stages (see the module docstring).

    virtual_stages: V, the stages each pipeline rank holds round-robin (`num_stages = V * pp`); with V > 1 the
    outer sizes count a rank's layers (Megatron-core's rule), spread evenly over its V stages.

    ValueError naming the rule when the outer sizes do not fit (negative remainder, or a remainder the middle
    stages cannot share evenly, or with V > 1 a rank's layers that its V stages cannot share evenly).
    """
    if num_stages < 1 or num_layers < 1:
        raise ValueError(f"need at least one layer and one stage, got {num_layers} layers, {num_stages} stages")
    _check_virtual_stages(virtual_stages)
    if num_stages % virtual_stages:
        raise ValueError(f"{num_stages} stages do not place round-robin over ranks of {virtual_stages} stages each")
    given = {
        "decoder_first_pipeline_num_layers": first_stage_layers,
        "decoder_last_pipeline_num_layers": last_stage_layers,
    }
    for name, value in given.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if first_stage_layers is None and last_stage_layers is None:
        per_stage = -(-num_layers // num_stages)
        padded = per_stage * num_stages
        slots = list(range(num_layers)) + [None] * (padded - num_layers)
        return StageSplit(tuple(tuple(slots[s * per_stage : (s + 1) * per_stage]) for s in range(num_stages)))
    if num_stages == 1:
        raise ValueError("decoder_first/last_pipeline_num_layers need more than one pipeline stage")
    if virtual_stages > 1:
        return _split_virtual(num_layers, num_stages // virtual_stages, virtual_stages, given)
    return _consecutive(_outer_sizes(num_layers, num_stages, given, "stage(s)"))


def _outer_sizes(num_layers: int, parts: int, given: dict[str, int | None], unit: str) -> list[int]:
    """Layers per part (stage, or rank under a virtual pipeline): the first / last part's as `given` (their
    counts, in that order, None for not given), the rest shared evenly by the other parts; ValueError otherwise."""
    first, last = given.values()
    outer = [n for n in (first, last) if n is not None]
    middle = parts - len(outer)
    rest = num_layers - sum(outer)
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
        raise ValueError(
            f"pipeline split: {_sizes_text(given)} leave {rest} of the {num_layers} decoder layers for {middle} other "
            f"{unit} of {parts}; the rest must divide evenly over them"
        )
    sizes = [rest // middle if middle else 0] * parts
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def _sizes_text(given: dict[str, int | None]) -> str:
    return ", ".join(f"{k}={n}" for k, n in given.items() if n is not None)


def _consecutive(sizes: list[int]) -> StageSplit:
    """Stages holding consecutive decoder layers, `sizes[s]` of them in stage s."""
    slots, start = [], 0
    for size in sizes:
        slots.append(tuple(range(start, start + size)))
        start += size
    return StageSplit(tuple(slots))


def _split_virtual(num_layers: int, pp: int, v: int, given: dict[str, int | None]) -> StageSplit:
    """Megatron-core's uneven split under a virtual pipeline: the first / last RANK's layers as given, the rest
    shared evenly by the other ranks, and each rank's layers shared evenly by its v stages (r, r + pp, ...)."""
    per_rank = _outer_sizes(num_layers, pp, given, "pipeline rank(s)")
    uneven = {r: n for r, n in enumerate(per_rank) if n % v}
    if uneven:
        raise ValueError(
            f"pipeline split with {v} virtual stages per pipeline rank ({_sizes_text(given)}): the decoder layers of "
            f"each rank are shared evenly by its {v} stages, but "
            + ", ".join(f"rank {r} holds {n}" for r, n in uneven.items())
            + f" (Megatron-core: the first / last rank's count and every other rank's must divide by {v})"
        )
    return _consecutive([per_rank[stage % pp] // v for stage in range(pp * v)])


def _check_virtual_stages(virtual_stages: int) -> None:
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"num_virtual_stages_per_pipeline_rank must be an int >= 1, got {virtual_stages!r}")


def stages_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """Stages (model chunks) each pipeline rank holds: 2 for DualPipeV's V, `virtual_stages` for 1F1B / ZB-H1.

    ValueError for an unknown schedule, and for DualPipeV with virtual stages (its V already places two stages on
    each rank; the interleaved placement and the V cannot both hold)."""
    if schedule not in SCHEDULE_STAGES_PER_RANK:
        raise ValueError(f"pipeline schedule must be one of {tuple(SCHEDULE_STAGES_PER_RANK)}, got {schedule!r}")
    _check_virtual_stages(virtual_stages)
    if schedule == "dualpipev":
        if virtual_stages > 1:
            raise ValueError(
                f"num_virtual_stages_per_pipeline_rank={virtual_stages} with dualpipev: DualPipeV already holds 2 "
                "stages per rank in a V (rank r: stages r and 2pp-1-r); virtual stages are for 1f1b (interleaved "
                "1F1B) and zbh1 (interleaved zero bubble)"
            )
        return 2
    return virtual_stages


def stages_of_rank(schedule: str, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds under `schedule`, in the order its schedule lists them:
    `[r]`; DualPipeV `[r, 2pp-1-r]`; with V virtual stages `[r, r + pp, ..., r + (V-1)pp]` (round-robin)."""
    count = stages_per_rank(schedule, virtual_stages)
    if schedule == "dualpipev":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(count)]


def check_schedule(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """The micro-batch counts each schedule can run (ValueError naming the rule), checked before any communication.

    - 1F1B: at least `pp` micro-batches (torch's `Schedule1F1B`: the warm-up fills every stage).
    - ZB-H1 (torch's `ScheduleInterleavedZeroBubble` with one stage per rank) runs the micro-batches in rounds of
      `pp`: a multiple of `pp`, or fewer than `pp` (one round).
    - DualPipeV: at least `2 * pp` micro-batches (one per stage of the V; DeepSeek's DualPipeV needs as many).
    - Virtual stages (V > 1, 1F1B or ZB-H1 interleaved): a multiple of `pp`. Megatron-core's rule with its default
      `microbatch_group_size_per_vp_stage = pp`: the group must fit in the micro-batches (pp <= m) and the last
      group must not be shorter than pp (m % pp == 0, else dependency bubbles). torch's interleaved schedules
      accept more (m a multiple of max(1, m // pp) rounds); Megatron's rule implies theirs.
    """
    stages_per_rank(schedule, virtual_stages)  # the schedule's name, and V with it
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if virtual_stages > 1:
        if pp < 2:
            raise ValueError(f"{virtual_stages} virtual stages per pipeline rank need pp > 1, got pp={pp}")
        if micro_batches % pp:
            raise ValueError(
                f"{virtual_stages} virtual stages per pipeline rank (interleaved {schedule}) run micro-batches in "
                f"groups of pp={pp}: micro_batches={micro_batches} must be a multiple of {pp} (Megatron-core's rule)"
            )
        return
    if schedule == "1f1b" and micro_batches < pp:
        raise ValueError(f"1F1B needs at least pp = {pp} micro-batches (one per stage in flight), got {micro_batches}")
    if schedule == "zbh1" and micro_batches >= pp and micro_batches % pp:
        raise ValueError(
            f"ZB-H1 runs micro-batches in rounds of pp={pp}: micro_batches={micro_batches} must be a multiple of {pp} "
            f"(or fewer than {pp})"
        )
    if schedule == "dualpipev" and micro_batches < 2 * pp:
        raise ValueError(
            f"DualPipeV needs at least 2 * pp = {2 * pp} micro-batches (one per stage of the V), got {micro_batches}"
        )
