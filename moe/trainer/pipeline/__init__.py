"""Pipeline parallelism: stages, schedules (1F1B, ZB-H1, DualPipeV; 1F1B and ZB-H1 interleaved over virtual stages)
and the per-rank timeline (bubble report)."""

from moe.trainer.pipeline.runner import PipelineRunner, pipeline_moe_options
from moe.trainer.pipeline.split import StageSplit, check_schedule, split_layers, stages_of_rank, stages_per_rank
from moe.trainer.pipeline.stage_modules import DeepseekV3Stage, keep_stages
from moe.trainer.pipeline.timeline import (
    KINDS,
    BubbleReport,
    RankBubble,
    Slot,
    TimelineRecorder,
    analytic_bubble,
    analytic_bubble_fraction,
    bubble_fraction,
    expected_bubble_fraction,
    gather_timelines,
    interleaved_bubble_ratio,
    plot_timeline,
    write_chrome_trace,
)

__all__ = [
    "DeepseekV3Stage",
    "PipelineRunner",
    "pipeline_moe_options",
    "StageSplit",
    "check_schedule",
    "keep_stages",
    "split_layers",
    "stages_of_rank",
    "stages_per_rank",
    "KINDS",
    "BubbleReport",
    "RankBubble",
    "Slot",
    "TimelineRecorder",
    "analytic_bubble",
    "analytic_bubble_fraction",
    "bubble_fraction",
    "expected_bubble_fraction",
    "interleaved_bubble_ratio",
    "gather_timelines",
    "plot_timeline",
    "write_chrome_trace",
]
