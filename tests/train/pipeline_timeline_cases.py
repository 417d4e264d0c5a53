"""Rank cases of test_pipeline_timeline.py: two ranks record slots ordered by a message, then gather them."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from moe.trainer.pipeline.timeline import TimelineRecorder, gather_timelines

SKEW_S = 1000.0  # rank 1's clock runs this far ahead in the "two hosts" case


def _busy(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def gather_case(ctx, two_hosts: bool):
    """Rank 0 runs F0 and sends; rank 1 receives, then runs F0 of the next stage. Returns (gathered, raw slots).

    two_hosts: rank 1 pretends to be on another machine whose clock reads SKEW_S seconds ahead.
    """
    skew = SKEW_S if (two_hosts and ctx.rank == 1) else 0.0
    recorder = TimelineRecorder(ctx.rank, clock=lambda: time.perf_counter() + skew)
    recorder.start_step()
    token = torch.zeros(1)
    if ctx.rank == 0:
        with recorder.slot("F", 0, 0):
            _busy(0.02)
        dist.send(token, dst=1, group=ctx.group)
        with recorder.slot("comm", 0, 0):
            dist.recv(token, src=1, group=ctx.group)
    else:
        with recorder.slot("comm", 1, 0):
            dist.recv(token, src=0, group=ctx.group)
        with recorder.slot("F", 1, 0):
            _busy(0.02)
        with recorder.slot("B", 1, 0):
            _busy(0.01)
        dist.send(token, dst=0, group=ctx.group)
    host = f"host{ctx.rank}" if two_hosts else None
    return gather_timelines(recorder, ctx.group, host=host), list(recorder.slots)
