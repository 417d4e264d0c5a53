"""Per-rank pipeline timelines and the bubble report: record slots, gather them, measure, draw.

A *slot* is one piece of work of one pipeline rank between two clock readings:

    'F'    forward of one micro-batch through one stage
    'B'    full backward (input and weight gradients) of one micro-batch through one stage
    'I'    input-gradient half of a split backward (zero-bubble schedules; torch calls it BACKWARD_INPUT)
    'W'    weight-gradient half of a split backward (deferred into the bubbles by ZB-H1)
    'F&B'  forward of one micro-batch overlapped with the backward of another (DualPipe's overlapped chunk);
           its micro-batch (and optionally its stage) is a pair: (forward's, backward's)
    'comm' communication, when a schedule records it: a p2p wait (send/recv of activations or gradients), or an MoE
           dispatch / combine in flight inside an 'F&B' (moe/trainer/pipeline/overlap.py); not compute

Flow: each rank wraps its work in `recorder.slot(kind, stage, microbatch)`; after the step,
`gather_timelines(recorder, group)` brings every rank's slots to every rank on one time axis;
`bubble_fraction(timelines)` measures idle time; `analytic_bubble` gives the DualPipe table's bubbles for
comparison, `expected_bubble_fraction` Megatron's `(pp-1)/(V m)` of (interleaved) 1F1B with V virtual stages;
`write_chrome_trace` (Perfetto / chrome://tracing) and `plot_timeline` (PNG) draw it.

Times are seconds (float) of `time.perf_counter`, which on Linux reads CLOCK_MONOTONIC: one clock for every
process of a machine, so the slots of ranks on one machine line up exactly once gathered.
"""

from __future__ import annotations

import io
import json
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moe.trainer.io.atomic import write_bytes
from moe.trainer.pipeline.split import stages_per_rank

COMPUTE_KINDS = ("F", "B", "I", "W", "F&B")
KINDS = (*COMPUTE_KINDS, "comm")
SCHEDULES = ("1f1b", "zbh1", "dualpipev")

# torch.distributed.pipelining's action names (`_ComputationType` values) -> our kinds; actions that are not
# compute or p2p (UNSHARD, RESHARD, REDUCE_GRAD) map to nothing.
TORCH_ACTION_KINDS = {
    "F": "F",
    "B": "B",
    "I": "I",
    "W": "W",
    "OVERLAP_F_B": "F&B",
    "SEND_F": "comm",
    "RECV_F": "comm",
    "SEND_B": "comm",
    "RECV_B": "comm",
}

# Colours per kind: hex for matplotlib, and Chrome's reserved colour names (`cname`) for chrome://tracing
# (Perfetto colours slices by name and ignores cname; the category still lets it filter by kind).
_HEX = {"F": "#f4a259", "B": "#5b8e7d", "I": "#8cb8d8", "W": "#9bc53d", "F&B": "#bc4b51", "comm": "#b0b0b0"}
_CNAME = {
    "F": "rail_response",
    "B": "thread_state_running",
    "I": "rail_load",
    "W": "good",
    "F&B": "terrible",
    "comm": "grey",
}
_LEGEND = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad", "F&B": "F&B overlapped",
           "comm": "comm"}  # fmt: skip


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown slot kind {kind!r}; expected one of {', '.join(map(repr, KINDS))}")


def _is_pair(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value)


# ---------------------------------------------------------------------------------------------------------------
# Slots and recording


@dataclass(frozen=True)
class Slot:
    """One piece of work of one pipeline rank.

    rank: the pipeline rank that ran it. kind: one of `KINDS`. stage: the pipeline stage (model chunk) index;
    for 'F&B' an int or a pair (forward's stage, backward's stage). microbatch: the micro-batch index; for 'F&B'
    the pair (forward's micro-batch, backward's micro-batch). start, end: seconds, `end >= start`.
    """

    rank: int
    kind: str
    stage: int | tuple[int, int]
    microbatch: int | tuple[int, int]
    start: float
    end: float

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"slot rank must be a non-negative int, got {self.rank!r}")
        pair_ok = self.kind == "F&B"
        if not (isinstance(self.stage, int) or (pair_ok and _is_pair(self.stage))):
            want = "an int or a pair of ints" if pair_ok else "an int"
            raise ValueError(f"{self.kind!r} slot stage must be {want}, got {self.stage!r}")
        if pair_ok and not _is_pair(self.microbatch):
            raise ValueError(f"'F&B' slot micro-batch must be a pair (forward's, backward's), got {self.microbatch!r}")
        if not pair_ok and not isinstance(self.microbatch, int):
            raise ValueError(f"{self.kind!r} slot micro-batch must be an int, got {self.microbatch!r}")
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise ValueError(f"slot times must be finite, got start={self.start!r} end={self.end!r}")
        if self.end < self.start:
            raise ValueError(f"slot ends before it starts: start={self.start!r} end={self.end!r} ({self.label})")

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """Short name, e.g. 'F3 s1', 'W0 s2', 'F&B 4/1 s(0,3)'."""
        if self.kind == "F&B":
            stage = self.stage if isinstance(self.stage, int) else f"({self.stage[0]},{self.stage[1]})"
            return f"F&B {self.microbatch[0]}/{self.microbatch[1]} s{stage}"
        return f"{self.kind}{self.microbatch} s{self.stage}"

    @property
    def microbatch_text(self) -> str:
        """The micro-batch as written inside a box of the PNG: '3', or '4/1' for 'F&B'."""
        mb = self.microbatch
        return f"{mb[0]}/{mb[1]}" if isinstance(mb, tuple) else str(mb)

    def shifted(self, offset: float) -> Slot:
        return Slot(self.rank, self.kind, self.stage, self.microbatch, self.start + offset, self.end + offset)


class _SlotTimer:
    """The context manager behind `TimelineRecorder.slot` (a class, not a generator: cheaper to enter)."""

    __slots__ = ("_recorder", "_kind", "_stage", "_microbatch", "_start")

    def __init__(self, recorder: TimelineRecorder, kind: str, stage, microbatch) -> None:
        self._recorder = recorder
        self._kind = kind
        self._stage = stage
        self._microbatch = microbatch

    def __enter__(self) -> None:
        self._start = self._recorder.clock()

    def __exit__(self, exc_type, exc, tb) -> None:
        end = self._recorder.clock()
        if exc_type is None:  # a failed step's half-done slot is not a measurement
            rec = self._recorder
            rec.slots.append(Slot(rec.rank, self._kind, self._stage, self._microbatch, self._start, end))


class _NullTimer:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> None:
        return None


_NULL_TIMER = _NullTimer()


@dataclass
class TimelineRecorder:
    """Records the slots of one pipeline rank.

        recorder = TimelineRecorder(rank=pp_rank)
        recorder.start_step()
        with recorder.slot("F", stage=1, microbatch=3):
            y = stage_module(x)

    rank: the rank's pipeline rank (written into each slot). enabled: False makes `slot` return a shared no-op
    context manager (no clock reading, no allocation) so that the hooks can stay in the training loop. suspended:
    True makes `slot` a no-op too, for a while (`add` still records: an action timed as a whole, e.g. DualPipeV's
    F&B, suspends the slots of its parts). clock:
    seconds, monotonic; `time.perf_counter` (CLOCK_MONOTONIC, shared by the processes of one machine).
    Overhead when enabled: two clock readings and one small object per slot (about a microsecond).
    """

    rank: int
    enabled: bool = True
    suspended: bool = False
    clock: Callable[[], float] = time.perf_counter
    slots: list[Slot] = field(default_factory=list)
    step_start: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {self.rank!r}")

    def slot(self, kind: str, stage: int | tuple[int, int], microbatch: int | tuple[int, int]):
        """Context manager timing one slot; the slot is kept only if the block exits without an exception."""
        if not self.enabled or self.suspended:
            return _NULL_TIMER
        _check_kind(kind)  # fail at the call site, not at the end of a long slot
        return _SlotTimer(self, kind, stage, microbatch)

    def add(self, kind: str, stage, microbatch, start: float, end: float) -> None:
        """Records a slot timed elsewhere (same clock), e.g. by a schedule's own hooks."""
        if self.enabled:
            self.slots.append(Slot(self.rank, kind, stage, microbatch, start, end))

    def start_step(self) -> None:
        """Starts a new step: forgets the previous slots and notes the step's start (the gathered time origin)."""
        self.slots.clear()
        self.step_start = self.clock() if self.enabled else None

    def reset(self) -> None:
        """Forgets every slot and the step start."""
        self.slots.clear()
        self.step_start = None


# ---------------------------------------------------------------------------------------------------------------
# Gathering


def gather_timelines(
    recorder: TimelineRecorder, group: dist.ProcessGroup | None = None, *, host: str | None = None
) -> list[list[Slot]]:
    """Every rank's slots on one time axis, on every rank of `group` (a collective: all ranks must call it).

    Returns `timelines[r]`: the slots of the group's rank `r`, sorted by start, in seconds from the origin: the
    earliest aligned `start_step()` of any rank, or the earliest slot where no rank started a step. Uses
    `all_gather_object` (works with gloo). host: the clock domain of this rank, default the host name; ranks
    with the same host are assumed to share one monotonic clock.

    Clock alignment. All ranks leave one barrier at (nearly) the same instant and read their clock right after
    it: `ref_r`. Each rank's times are then re-based on the reference of its host, `ref_h` = the `ref_r` of the
    host's lowest rank, and a host's times are taken to be `t - ref_h` from the barrier's exit. On one machine
    every rank uses the same `ref_h` of the same clock, so the alignment is exact (the barrier's release skew
    between processes does not enter). Across machines each host's offset is off by that host's barrier release
    delay (about one network latency, tens of microseconds on a fast fabric, more over TCP); clock drift within
    a step is far smaller.
    """
    host = socket.gethostname() if host is None else host
    dist.barrier(group=group)
    ref = recorder.clock()
    mine = (host, ref, recorder.step_start, list(recorder.slots))
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)

    host_ref: dict[str, float] = {}
    for peer_host, peer_ref, _, _ in gathered:  # in rank order: the first rank seen on a host sets its reference
        host_ref.setdefault(peer_host, peer_ref)
    origins = []
    for peer_host, _, step_start, slots in gathered:
        if step_start is not None:
            origins.append(step_start - host_ref[peer_host])
        elif slots:
            origins.append(min(s.start for s in slots) - host_ref[peer_host])
    origin = min(origins) if origins else 0.0

    timelines = []
    for peer_host, _, _, slots in gathered:
        offset = -host_ref[peer_host] - origin
        timelines.append(sorted((s.shifted(offset) for s in slots), key=lambda s: (s.start, s.end)))
    return timelines


# ---------------------------------------------------------------------------------------------------------------
# Measured bubble


def _check_timelines(timelines: Sequence[Sequence[Slot]]) -> None:
    if len(timelines) == 0:
        raise ValueError("no timelines: expected one list of slots per pipeline rank")
    for r, slots in enumerate(timelines):
        for s in slots:
            if not isinstance(s, Slot):
                raise ValueError(f"timelines[{r}] holds {type(s).__name__}, expected Slot")
    if not any(timelines):
        raise ValueError("every timeline is empty: nothing was recorded")


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


@dataclass
class RankBubble:
    """One rank's share of the step: `busy + idle == span` of the report."""

    rank: int
    busy: float  # seconds covered by at least one compute slot (overlapping slots counted once)
    idle: float  # span - busy
    fraction: float  # idle / span
    busy_by_kind: dict[str, float]  # summed durations per kind ('comm' included, not part of busy)


@dataclass
class BubbleReport:
    """What `bubble_fraction` measured. Times in seconds.

    Definition: the *span* is the common window of the step, from the earliest slot start to the latest slot end
    over all ranks (a rank that starts late or ends early is idle for that time: that is the pipeline's fill and
    drain). A rank is busy while any of its compute slots (F, B, I, W, F&B) runs; 'comm' slots are waits, so they
    count as idle. `per_rank[r].fraction = idle_r / span`; `fraction` = sum of idle / (ranks x span), the share of
    the pipeline's device time lost to bubbles.
    """

    span_start: float
    span_end: float
    per_rank: list[RankBubble]
    fraction: float
    busy_by_kind: dict[str, float]  # summed over ranks
    count_by_kind: dict[str, int]
    mean_by_kind: dict[str, float]  # mean slot duration per kind: the F, B, I, W, F&B of the analytic formulas

    @property
    def span(self) -> float:
        return self.span_end - self.span_start

    @property
    def idle_per_rank(self) -> list[float]:
        return [r.idle for r in self.per_rank]

    def unit_times(self) -> dict[str, float | None]:
        """Measured mean durations as `analytic_bubble`'s keyword arguments: F, B, W and F_and_B.

        B is the full backward: the mean 'B' slot where full backwards ran, else mean 'I' + mean 'W' (a split
        backward). W is the mean 'W' slot (0 where the backward was never split). F_and_B is None without 'F&B'
        slots. A kind with no slots at all gives 0 (F) or raises (no backward of any kind).
        """
        mean = self.mean_by_kind
        if "B" in mean:
            full_b = mean["B"]
        elif "I" in mean:
            full_b = mean["I"] + mean.get("W", 0.0)
        else:
            raise ValueError("no backward slots ('B' or 'I') were recorded: cannot derive B")
        return {"F": mean.get("F", 0.0), "B": full_b, "W": mean.get("W", 0.0), "F_and_B": mean.get("F&B")}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (for a trace's metadata or a benchmark's output)."""
        return {
            "definition": "idle / span; span = earliest slot start to latest slot end over all ranks; "
            "busy = union of compute slots (F, B, I, W, F&B) of the rank",
            "span_s": self.span,
            "bubble_fraction": self.fraction,
            "per_rank_bubble_fraction": [r.fraction for r in self.per_rank],
            "per_rank_idle_s": self.idle_per_rank,
            "busy_by_kind_s": dict(self.busy_by_kind),
            "count_by_kind": dict(self.count_by_kind),
            "mean_by_kind_s": dict(self.mean_by_kind),
        }


def bubble_fraction(timelines: Sequence[Sequence[Slot]]) -> BubbleReport:
    """Measures the bubble of a gathered step: `timelines[r]` is rank r's slots (as `gather_timelines` returns).

    See `BubbleReport` for the definition. Raises ValueError for no ranks, no slots at all, non-Slot entries, or
    a zero-length span.
    """
    _check_timelines(timelines)
    every = [s for slots in timelines for s in slots]
    span_start = min(s.start for s in every)
    span_end = max(s.end for s in every)
    span = span_end - span_start
    if span <= 0:
        raise ValueError("the timelines span no time (every slot has zero length at one instant)")

    per_rank = []
    for r, slots in enumerate(timelines):
        busy = _union_length([(s.start, s.end) for s in slots if s.kind in COMPUTE_KINDS])
        by_kind: dict[str, float] = {}
        for s in slots:
            by_kind[s.kind] = by_kind.get(s.kind, 0.0) + s.duration
        idle = span - busy
        per_rank.append(RankBubble(r, busy, idle, idle / span, by_kind))

    busy_by_kind: dict[str, float] = {}
    count_by_kind: dict[str, int] = {}
    for s in every:
        busy_by_kind[s.kind] = busy_by_kind.get(s.kind, 0.0) + s.duration
        count_by_kind[s.kind] = count_by_kind.get(s.kind, 0) + 1
    mean_by_kind = {k: busy_by_kind[k] / count_by_kind[k] for k in busy_by_kind}
    fraction = sum(r.idle for r in per_rank) / (len(timelines) * span)
    return BubbleReport(span_start, span_end, per_rank, fraction, busy_by_kind, count_by_kind, mean_by_kind)


# ---------------------------------------------------------------------------------------------------------------
# Analytic bubble (DualPipe's table)


def _check_analytic(schedule: str, pp: int, F: float, B: float, W: float, F_and_B: float | None) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(map(repr, SCHEDULES))}")
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp (pipeline ranks) must be a positive int, got {pp!r}")
    for name, value in (("F", F), ("B", B), ("W", W)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite time >= 0, got {value!r}")
    if W > B:
        raise ValueError(f"W ({W}) cannot exceed B ({B}): B is the full backward, W is its weight-gradient part")
    if F_and_B is None:
        return F + B
    if not (math.isfinite(F_and_B) and F_and_B >= 0):
        raise ValueError(f"F_and_B must be a finite time >= 0, got {F_and_B!r}")
    return F_and_B


def analytic_bubble(schedule: str, pp: int, F: float, B: float, W: float = 0.0, F_and_B: float | None = None) -> float:
    """Bubble time per rank of one step from DualPipe's table (deepseek-ai/DualPipe README).

    schedule: '1f1b' -> (P-1)(F+B); 'zbh1' -> (P-1)(F+B-2W); 'dualpipev' -> (PP/2-1)(F&B+B-3W).
    pp: the number of pipeline RANKS (devices), our `--pp`. F, B, W: execution time of a forward, a full
    backward (input + weight gradients) and a weight-gradient backward of ONE stage chunk, seconds (or any unit).
    F_and_B: time of a forward and a backward chunk of two micro-batches run overlapped; default F + B (no gain).

    P in DualPipe's table: "PP denotes the number of pp stages (even)", compared "based on the same number of PP
    stages"; DualPipeV puts two stages on each device (#devices = PP/2, rank r holds stages r and 2*pp-1-r). So
    for 1F1B and ZB-H1 (one stage per rank) PP = pp, and for DualPipeV PP = 2*pp: its bubble over `pp` ranks is
    (2*pp/2 - 1)(F&B+B-3W) = (pp-1)(F&B+B-3W), where F, B, W are the times of its half-size chunks.
    """
    f_and_b = _check_analytic(schedule, pp, F, B, W, F_and_B)
    if schedule == "1f1b":
        return (pp - 1) * (F + B)
    if schedule == "zbh1":
        return (pp - 1) * (F + B - 2 * W)
    stages = 2 * pp
    return (stages // 2 - 1) * (f_and_b + B - 3 * W)


def interleaved_bubble_ratio(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Megatron's analytic bubble of (interleaved) 1F1B relative to the ideal step: `(pp - 1) / (V * m)` (Narayanan
    et al. 2021, eq. 2; V = 1 is plain 1F1B's `(pp - 1) / m`). Independent of the F / B times: the bubble is
    `(pp - 1)(F + B)` of ONE chunk, the compute `V m (F + B)`.

    As a share of the step (what `bubble_fraction` measures: idle / span) it is `r / (1 + r)`; see
    `expected_bubble_fraction`."""
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp (pipeline ranks) must be a positive int, got {pp!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    return (pp - 1) / (stages_per_rank("1f1b", virtual_stages) * num_microbatches)


def expected_bubble_fraction(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """`interleaved_bubble_ratio` as a share of the step, `(pp - 1) / (V m + pp - 1)`: comparable with a measured
    `BubbleReport.fraction` of 1F1B (equal stages, no communication time, as the formula assumes)."""
    ratio = interleaved_bubble_ratio(pp, num_microbatches, virtual_stages)
    return ratio / (1 + ratio)


def analytic_bubble_fraction(
    schedule: str,
    pp: int,
    num_microbatches: int,
    F: float,
    B: float,
    W: float = 0.0,
    F_and_B: float | None = None,
    compute: float | None = None,
    virtual_stages: int = 1,
) -> float:
    """The analytic bubble as a share of the step: bubble / (bubble + per-rank compute).

    compute: one rank's compute time of the step; default `stages_per_rank * num_microbatches * (F + B)` (every
    micro-batch's forward and full backward through each of the rank's chunks, overlap not counted). Pass the
    measured `RankBubble.busy` to compare with a measured fraction on the same footing. virtual_stages: V chunks per
    rank under interleaved 1F1B / ZB-H1: the bubble stays the table's `(P-1)(F+B)` (resp. `(P-1)(F+B-2W)`) of ONE
    chunk while the compute is V m (F+B), so 1F1B's share is Megatron's `(P-1)/(V m)` relative (the ZB row is the
    same table entry over chunk times, an estimate: torch's interleaved ZB1P is not in DualPipe's table). Other
    arguments as in `analytic_bubble`.
    """
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    bubble = analytic_bubble(schedule, pp, F, B, W, F_and_B)
    if compute is None:
        compute = stages_per_rank(schedule, virtual_stages) * num_microbatches * (F + B)
    elif not (math.isfinite(compute) and compute >= 0):
        raise ValueError(f"compute must be a finite time >= 0, got {compute!r}")
    total = bubble + compute
    if total <= 0:
        raise ValueError("bubble + compute is zero: give non-zero slot times")
    return bubble / total


# ---------------------------------------------------------------------------------------------------------------
# Output


def _json_safe(value: Any) -> Any:
    """Metadata made JSON-encodable: tuples to lists, dataclass reports to their dict, NaN/inf kept as strings."""
    if isinstance(value, BubbleReport):
        return _json_safe(value.to_dict())
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def chrome_trace(timelines: Sequence[Sequence[Slot]], metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Chrome trace-event document (JSON object format) of `timelines`; see `write_chrome_trace`."""
    _check_timelines(timelines)
    origin = min(s.start for slots in timelines for s in slots)
    events: list[dict[str, Any]] = []
    for r, slots in enumerate(timelines):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"pp rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        if any(s.kind == "comm" for s in slots):
            events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "p2p"}})
        for s in slots:
            events.append(
                {
                    "name": s.label,
                    "cat": s.kind,
                    "ph": "X",
                    "pid": r,
                    "tid": 1 if s.kind == "comm" else 0,  # waits on their own track: they may overlap compute
                    "ts": (s.start - origin) * 1e6,
                    "dur": s.duration * 1e6,
                    "cname": _CNAME[s.kind],
                    "args": {"kind": s.kind, "stage": s.stage, "microbatch": s.microbatch, "rank": s.rank},
                }
            )
    other = {"bubble": bubble_fraction(timelines).to_dict()}
    if metadata:
        other.update(metadata)
    return {"traceEvents": _json_safe(events), "displayTimeUnit": "ms", "otherData": _json_safe(other)}


def write_chrome_trace(
    path: str | os.PathLike, timelines: Sequence[Sequence[Slot]], metadata: dict[str, Any] | None = None
) -> None:
    """Writes a Chrome trace-event JSON file (open it in https://ui.perfetto.dev or chrome://tracing).

    One process per rank ("pp rank r"; compute on thread 0, 'comm' waits on thread 1), one complete event
    ('ph': 'X') per slot named like "F3 s1", category = kind, `ts`/`dur` in microseconds from the earliest
    slot, `cname` colour per kind, args {kind, stage, microbatch, rank}. "otherData" holds the measured bubble
    report (key "bubble") and `metadata` (e.g. {"schedule": "zbh1", "analytic_bubble_fraction": ...}), which may
    override it. Written atomically (temporary file, then rename), mode 0o644.
    """
    doc = chrome_trace(timelines, metadata)
    write_bytes(Path(path), json.dumps(doc, allow_nan=False).encode(), mode=0o644)


def plot_timeline(path_png: str | os.PathLike, timelines: Sequence[Sequence[Slot]], title: str = "") -> None:
    """Draws a Gantt chart of the step to a PNG: one row per rank (rank 0 on top), one box per slot coloured by
    kind, the micro-batch written in each box wide enough for it, 'comm' waits as thin grey bars under the row,
    a legend of the kinds present, the measured bubble fraction in the title and per rank in the row labels.

    Uses matplotlib's Agg canvas directly (no pyplot, no display, no global backend change). Written atomically.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    report = bubble_fraction(timelines)
    origin, span = report.span_start, report.span
    n = len(timelines)
    width_in, dpi = 14.0, 110
    fig = Figure(figsize=(width_in, 1.2 + 0.55 * n), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_xlim(0.0, span)
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 at the top
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}\nbubble {report.per_rank[r].fraction:.1%}" for r in range(n)], fontsize=8)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    present = [k for k in KINDS if report.count_by_kind.get(k)]
    handles = [Patch(facecolor=_HEX[k], edgecolor="black", linewidth=0.4, label=_LEGEND[k]) for k in present]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    head = f"{title} — " if title else ""
    ax.set_title(f"{head}measured bubble {report.fraction:.1%} (span {span * 1e3:.2f} ms)", fontsize=10)
    fig.tight_layout()  # the layout is final here: box widths in pixels can be measured
    axes_px = ax.get_window_extent().width
    fontsize = 7 if n > 4 else 8
    char_px = 0.62 * fontsize * dpi / 72  # a digit's width, about 0.6 em

    for r, slots in enumerate(timelines):
        for s in slots:
            x, w = s.start - origin, s.duration
            if s.kind == "comm":
                ax.barh(r + 0.36, w, left=x, height=0.12, color=_HEX["comm"], linewidth=0)
                continue
            ax.barh(r, w, left=x, height=0.62, color=_HEX[s.kind], edgecolor="black", linewidth=0.4)
            text = s.microbatch_text
            if w / span * axes_px >= char_px * (len(text) + 1):
                ax.text(x + w / 2, r, text, ha="center", va="center", fontsize=fontsize, clip_on=True)

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes(Path(path_png), buf.getvalue(), mode=0o644)
