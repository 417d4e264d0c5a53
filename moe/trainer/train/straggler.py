"""Slow-rank detection: every rank's per-phase times (moe/layer/phase_timer.py) gathered every `straggler_interval`
steps; a rank whose time in a phase exceeds the median of its peers by `straggler_factor` (and by
`straggler_min_seconds` per step) is reported with that phase.

Peers are the ranks that do the same work: every rank without pipeline parallelism, the ranks of one pipeline stage
with it (stages hold different layers, so their times differ by design; a pipeline-only layout has no peers to
compare and reports nothing).

Reading a report: compute phases (forward, backward, optimizer) are the signal. A rank that is late makes the
others *wait* inside the next communication phase (dispatch, combine, grad_sync, p2p), where the wait is counted;
with three or more peers the waiting ranks are the majority, so the median absorbs the wait and the late rank's
compute phase stands out. A communication phase is reported when a rank spends longer in it than its peers, but a
delay *inside* one (e.g. a slow copy out of the receive buffer) makes the peers wait in the same phase or the next
one depending on timing, so it is reliably attributed only when the peers do not wait in that same phase; with two
peers the one that waited also exceeds the median. The findings are therefore listed compute phases first, each
with its kind.

Cost: the timer itself (about a microsecond per phase boundary, counted in `events`) and one all-gather of
`len(PHASES) + 3` float64 per rank every `straggler_interval` steps, timed in each report (`gather_s`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe.layer.phase_timer import COMPUTE_PHASES, PHASES, PhaseTimer


@dataclass(frozen=True)
class SlowRank:
    """One finding: `rank`'s time in `phase` per step against the median of its peers."""

    rank: int
    phase: str
    seconds_per_step: float
    median_seconds_per_step: float

    @property
    def compute(self) -> bool:
        return self.phase in COMPUTE_PHASES

    @property
    def excess(self) -> float:
        return self.seconds_per_step - self.median_seconds_per_step

    @property
    def ratio(self) -> float | None:
        """Time over the median (None when the median is 0: the peers did not run the phase)."""
        m = self.median_seconds_per_step
        return None if m <= 0 else self.seconds_per_step / m

    def describe(self) -> str:
        kind = "" if self.compute else " (communication: includes waiting for peers)"
        ratio = "" if self.ratio is None else f" (x{self.ratio:.2f})"
        return (
            f"rank {self.rank} is slow in {self.phase}{kind}: {1e3 * self.seconds_per_step:.1f} ms/step vs the "
            f"median {1e3 * self.median_seconds_per_step:.1f} ms/step of its peers{ratio}"
        )


def find_slow_ranks(
    seconds_RP: list[list[float]], peers: list[list[int]], factor: float, min_seconds: float
) -> list[SlowRank]:
    """The slow (rank, phase) pairs.

    Args:
        seconds_RP: `[world][len(PHASES)]` seconds per step of every rank in every phase.
        peers: groups of ranks that do the same work (each rank in one group; groups of one are not judged).
        factor: a rank is slow when its time exceeds `factor` x the median of its group ...
        min_seconds: ... and the median by more than this many seconds per step (jitter of short phases).
    Returns the findings, compute phases first, then by excess over the median (largest first).
    """
    out = []
    for group in peers:
        if len(group) < 2:
            continue
        for p, phase in enumerate(PHASES):
            values = [seconds_RP[r][p] for r in group]
            median = statistics.median(values)
            for r, v in zip(group, values):
                if v > factor * median and v - median > min_seconds:
                    out.append(SlowRank(r, phase, v, median))
    return sorted(out, key=lambda s: (not s.compute, -s.excess))


def stage_peers(world: int, pp: int) -> list[list[int]]:
    """The ranks of each pipeline stage (ranks are numbered stage-major: `pp_rank * (world // pp) + ...`)."""
    size = world // pp
    return [list(range(s * size, (s + 1) * size)) for s in range(pp)]


class StragglerMonitor:
    """Gathers the ranks' phase times every `interval` steps and finds the slow ranks (collective over the world).

    Args:
        timer: this rank's `PhaseTimer` (what the trainer, the MoE layers and the pipeline runner time on).
        world, pp: the layout (peers are the ranks of a pipeline stage).
        interval, factor, min_seconds: `straggler_interval`, `straggler_factor`, `straggler_min_seconds`.
    """

    def __init__(self, timer: PhaseTimer, *, world: int, pp: int, interval: int, factor: float,
                 min_seconds: float) -> None:  # fmt: skip
        self.timer = timer
        self.world = world
        self.peers = stage_peers(world, pp)
        self.interval = interval
        self.factor = factor
        self.min_seconds = min_seconds
        self.steps = 0  # steps timed since the last report
        self.first_step: int | None = None

    def step_done(self, step: int) -> None:
        """Count a timed step (an anomalous one too: it ran its phases)."""
        if self.first_step is None:
            self.first_step = step
        self.steps += 1

    def due(self, step: int) -> bool:
        return step % self.interval == 0 and self.steps > 0

    def report(self, step: int) -> tuple[dict[str, Any], list[SlowRank]]:
        """Collective: `(phase_times event, findings)` over the steps since the last report; resets the timer."""
        totals, events, mismatches = self.timer.take()
        steps = self.steps
        mine = torch.tensor([*totals, float(events), float(mismatches), float(steps)], dtype=torch.float64)
        start = time.perf_counter()
        if self.world > 1:
            parts = [torch.empty_like(mine) for _ in range(self.world)]
            dist.all_gather(parts, mine)
            table = torch.stack(parts)
        else:
            table = mine.unsqueeze(0)
        gather_s = time.perf_counter() - start
        per_step = (table[:, : len(PHASES)] / table[:, -1:].clamp(min=1)).tolist()
        findings = find_slow_ranks(per_step, self.peers, self.factor, self.min_seconds)
        phases = {}
        for p, phase in enumerate(PHASES):
            column = [row[p] for row in per_step]
            worst = max(range(self.world), key=column.__getitem__)
            phases[phase] = {"median": statistics.median(column), "max": column[worst], "max_rank": worst,
                             "min": min(column)}  # fmt: skip
        event = {
            "kind": "phase_times",
            "step": step,
            "first_step": self.first_step,
            "steps": steps,
            "seconds_per_step": phases,
            "timer_events_per_step": float(table[:, -3].max()) / max(steps, 1),
            "timer_mismatches": int(table[:, -2].sum()),
            "gather_s": gather_s,
        }
        self.steps, self.first_step = 0, None
        return event, findings


def slow_rank_event(step: int, first_step: int | None, finding: SlowRank) -> dict[str, Any]:
    """The metrics.jsonl record of one finding."""
    return {
        "kind": "slow_rank",
        "step": step,
        "first_step": first_step,
        "rank": finding.rank,
        "phase": finding.phase,
        "communication": not finding.compute,
        "seconds_per_step": finding.seconds_per_step,
        "median_seconds_per_step": finding.median_seconds_per_step,
        "ratio": finding.ratio,
    }
