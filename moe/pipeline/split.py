"""Which decoder layers each pipeline stage runs (`StageSplit`), and which stages each pipeline rank holds.

Stages are numbered in model order `0 .. S-1`. 1F1B and ZB-H1 run one stage per rank (`S = P`, rank r holds stage
r); DualPipeV runs two (`S = 2P`) in a V: rank r holds stages r and 2P-1-r, so rank 0 holds both the first stage
(the embedding) and the last (norm, output head, MTP and the losses).

A split is either even, or given Megatron-core's way: `decoder_first_pipeline_num_layers` and / or
`decoder_last_pipeline_num_layers` for the outer stages and the rest shared evenly by the others. When the layers do
not divide evenly and no outer sizes are given, empty placeholder slots pad them to the next multiple of S (as
DeepSeek-V3 pads 61 layers to 64 for its 16 DualPipe stages); the placeholders go to the last stages, which also
run the head and the MTP modules. A placeholder runs nothing.
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
) -> StageSplit:
    """The split of `num_layers` decoder layers over `num_stages` stages (see the module docstring).

    ValueError naming the rule when the outer sizes do not fit (negative remainder, or a remainder the middle
    stages cannot share evenly).
    """
    if num_stages < 1 or num_layers < 1:
        raise ValueError(f"need at least one layer and one stage, got {num_layers} layers, {num_stages} stages")
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
    outer = [n for n in (first_stage_layers, last_stage_layers) if n is not None]
    middle_stages = num_stages - len(outer)
    rest = num_layers - sum(outer)
    sizes_text = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest % middle_stages):
        raise ValueError(
            f"pipeline split: {sizes_text} leave {rest} of the {num_layers} decoder layers for {middle_stages} other "
            f"stage(s) of {num_stages}; the rest must divide evenly over them"
        )
    sizes = [rest // middle_stages if middle_stages else 0] * num_stages
    if first_stage_layers is not None:
        sizes[0] = first_stage_layers
    if last_stage_layers is not None:
        sizes[-1] = last_stage_layers
    slots, start = [], 0
    for size in sizes:
        slots.append(tuple(range(start, start + size)))
        start += size
    return StageSplit(tuple(slots))


def stages_of_rank(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds under `schedule`, in the order its schedule lists them."""
    if schedule not in SCHEDULE_STAGES_PER_RANK:
        raise ValueError(f"pipeline schedule must be one of {tuple(SCHEDULE_STAGES_PER_RANK)}, got {schedule!r}")
    if SCHEDULE_STAGES_PER_RANK[schedule] == 1:
        return [pp_rank]
    return [pp_rank, 2 * pp - 1 - pp_rank]


def check_schedule(schedule: str, pp: int, micro_batches: int) -> None:
    """The micro-batch counts each schedule can run (ValueError naming the rule), checked before any communication.

    - 1F1B: at least `pp` micro-batches (torch's `Schedule1F1B`: the warm-up fills every stage).
    - ZB-H1 (torch's `ScheduleInterleavedZeroBubble` with one stage per rank) runs the micro-batches in rounds of
      `pp`: a multiple of `pp`, or fewer than `pp` (one round).
    - DualPipeV: at least `2 * pp` micro-batches (one per stage of the V; DeepSeek's DualPipeV needs as many).
    """
    if schedule not in SCHEDULE_STAGES_PER_RANK:
        raise ValueError(f"pipeline schedule must be one of {tuple(SCHEDULE_STAGES_PER_RANK)}, got {schedule!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
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
