"""The timeline of one overlapped decode step (generation.py with `overlap=True`): per rank, when each micro-batch
('A', 'B') computed and when its MoE dispatches and combines were in flight, drawn like the pipeline's timelines
(moe/trainer/pipeline/timeline.py): a PNG and a Chrome trace-event JSON for https://ui.perfetto.dev.

Input: per rank, the interleaver's events of the step (`DecodeTrace.events[i]`, gathered to one rank with
`all_gather_object`). Times are `time.perf_counter` seconds (CLOCK_MONOTONIC on Linux: one clock for the processes
of a machine), so the ranks line up.

Lanes per rank: 'A compute', 'A comm', 'B compute', 'B comm'. A communication bar runs from its issue to the end of
its wait; its darker part is the exposed wait (the side had the baton back and was blocked), the rest was in
flight under the other micro-batch's compute.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe.layer.interleave import Event, comms_of, compute_spans
from moe.trainer.io.atomic import write_bytes
from moe.trainer.pipeline.overlap import draw_comm, save_with_legend

SIDES = ("A", "B")
_COLOURS = {"A": "#f4a259", "B": "#5b8e7d"}
_CNAME = {"A": "thread_state_running", "B": "good", "comm": "grey"}


def step_summary(events: Sequence[Event]) -> dict[str, float]:
    """Seconds of one rank's overlapped step: `step` (first to last event), `in_flight` (the communications' issue ->
    done, summed), `exposed` (their blocked waits, summed), `hidden` = `in_flight - exposed`."""
    comms = comms_of(list(events))
    in_flight = sum(c.in_flight for c in comms)
    exposed = sum(c.exposed for c in comms)
    step = max(e.t for e in events) - min(e.t for e in events) if events else 0.0
    return {"step": step, "in_flight": in_flight, "exposed": exposed, "hidden": in_flight - exposed}


def _origin(per_rank: Sequence[Sequence[Event]]) -> float:
    times = [e.t for events in per_rank for e in events]
    if not times:
        raise ValueError("no events: the step was not run with overlap=True")
    return min(times)


def chrome_trace(per_rank: Sequence[Sequence[Event]], metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace-event document: one process per rank, threads 'A compute' (0), 'A comm' (1), 'B compute' (2),
    'B comm' (3); complete events ('X') in microseconds from the earliest event; a communication's args give its
    exposed wait (us)."""
    origin = _origin(per_rank)
    out: list[dict[str, Any]] = []
    for r, events in enumerate(per_rank):
        events = list(events)
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"ep rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for i, side in enumerate(SIDES):
            for tid, what in ((2 * i, "compute"), (2 * i + 1, "comm")):
                out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": f"{side} {what}"}})
            for start, end in compute_spans(events, side):
                ts, dur = (start - origin) * 1e6, (end - start) * 1e6
                out.append({"name": f"{side} compute", "cat": "compute", "ph": "X", "pid": r, "tid": 2 * i, "ts": ts,
                            "dur": dur, "cname": _CNAME[side]})  # fmt: skip
            for comm in comms_of(events):
                if comm.side != side:
                    continue
                out.append({"name": f"{side} {comm.name}", "cat": "comm", "ph": "X", "pid": r, "tid": 2 * i + 1,
                            "ts": (comm.issue - origin) * 1e6, "dur": comm.in_flight * 1e6, "cname": _CNAME["comm"],
                            "args": {"exposed_us": comm.exposed * 1e6}})  # fmt: skip
    other = {"ranks": [step_summary(events) for events in per_rank], **(metadata or {})}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def write_chrome_trace(path: str | os.PathLike, per_rank: Sequence[Sequence[Event]], metadata=None) -> None:
    """Writes `chrome_trace` as JSON, atomically (mode 0o644)."""
    write_bytes(Path(path), json.dumps(chrome_trace(per_rank, metadata), allow_nan=False).encode(), mode=0o644)


def plot_step(path_png: str | os.PathLike, per_rank: Sequence[Sequence[Event]], title: str = "") -> None:
    """Draws the step (see the module docstring), written atomically as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    origin = _origin(per_rank)
    lanes = [(r, side, what) for r in range(len(per_rank)) for side in SIDES for what in ("compute", "comm")]
    fig = Figure(figsize=(13.0, 0.45 * len(lanes) + 1.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r} {side} {what}" for r, side, what in lanes], fontsize=7)
    ax.set_xlabel("ms from the step's start")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    for row, (r, side, what) in enumerate(lanes):
        events = list(per_rank[r])
        if what == "compute":
            for start, end in compute_spans(events, side):
                ax.barh(row, (end - start) * 1e3, left=(start - origin) * 1e3, height=0.6, color=_COLOURS[side],
                        edgecolor="black", linewidth=0.3)  # fmt: skip
            continue
        for comm in comms_of(events):
            if comm.side != side:
                continue
            draw_comm(ax, row, comm, origin)
    sums = [step_summary(events) for events in per_rank]
    in_flight = sum(s["in_flight"] for s in sums)
    hidden = sum(s["hidden"] for s in sums) / in_flight if in_flight else 0.0
    head = f"{title} — " if title else ""
    ax.set_title(f"{head}step {max(s['step'] for s in sums) * 1e3:.2f} ms; MoE comm in flight "
                 f"{in_flight * 1e3:.2f} ms over the ranks, {hidden:.0%} of it under the other micro-batch",
                 fontsize=9)  # fmt: skip
    compute = {_COLOURS["A"]: "micro-batch A compute", _COLOURS["B"]: "micro-batch B compute"}
    save_with_legend(fig, ax, path_png, compute, "dispatch / combine in flight")
