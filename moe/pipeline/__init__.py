"""Pipeline parallelism: stages, schedules (1F1B, ZB-H1, DualPipeV) and the per-rank timeline (bubble report)."""

from moe.pipeline.timeline import (
    KINDS,
    BubbleReport,
    RankBubble,
    Slot,
    TimelineRecorder,
    analytic_bubble,
    analytic_bubble_fraction,
    bubble_fraction,
    gather_timelines,
    plot_timeline,
    write_chrome_trace,
)

__all__ = [
    "KINDS",
    "BubbleReport",
    "RankBubble",
    "Slot",
    "TimelineRecorder",
    "analytic_bubble",
    "analytic_bubble_fraction",
    "bubble_fraction",
    "gather_timelines",
    "plot_timeline",
    "write_chrome_trace",
]
