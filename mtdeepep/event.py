"""`EventOverlap`: the handle returned by every communication call, as in DeepEP (V1 and V2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._C import EventHandle


class EventOverlap:
    """Wraps the completion event (`mtdeepep.EventHandle`, None when already complete) of a communication call.

    On the CPU executor communication runs on the buffer's comm thread; waiting on the event blocks the caller until it
    finishes and re-raises its error, if any. `extra_tensors` are kept alive until then. Usable as a context manager:
    leaving the `with` block waits (`with event(release_handle=True):` also drops the event afterwards, as DeepEP V2).
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], None] | None = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The caller (the CPU "current stream") waits until the communication finished; re-raises its error."""
        if self.event is not None:
            self.event.wait()
        self.extra_tensors = None
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def query(self) -> bool:
        """True once the communication finished (never blocks)."""
        return self.event is None or self.event.query()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """Runs `hook_after_wait` once, after the next `current_stream_wait()` (DeepEP V2)."""
        if self.hook_after_wait is not None:
            raise ValueError("mtdeepep: a hook is already registered on this EventOverlap")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def as_event(previous_event: Any) -> EventHandle | None:
    """The event a call must wait for: `previous_event` may be an `EventOverlap` (DeepEP V1) or an `EventHandle`
    (V2); ValueError for anything else."""
    if previous_event is None:
        return None
    if isinstance(previous_event, EventOverlap):
        return previous_event.event
    if isinstance(previous_event, EventHandle):
        return previous_event
    raise ValueError(
        f"mtdeepep: previous_event must be an EventOverlap or an EventHandle, got {type(previous_event).__name__}"
    )
