"""`EventOverlap`: the handle returned by every communication call, as in DeepEP."""

from __future__ import annotations

import torch


class EventOverlap:
    """Wraps the completion event of a communication call.

    On the CPU executor communication runs on the buffer's comm thread; waiting on the event blocks the caller
    until it finishes and re-raises its error, if any. `extra_tensors` are kept alive until then.
    Usable as a context manager: leaving the `with` block waits.
    """

    def __init__(self, event=None, extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the caller (the CPU "current stream") wait until the communication finished."""
        if self.event is not None:
            self.event.wait()
        self.extra_tensors = None

    def query(self) -> bool:
        """True once the communication finished (never blocks)."""
        return self.event is None or self.event.query()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.current_stream_wait()
