"""While a communication is in flight: the one seam between code that communicates and work that can run meanwhile.

Code that communicates marks the point where its data is moving and it is about to wait:

    results = start(async_finish=True)
    with in_flight("dispatch_backward"):       # enter: this thread's in-flight work runs; the block: the wait
        event.current_stream_wait()

Work that can run meanwhile is registered on the calling thread, in one of two ways:

- `run_at_next_in_flight(work)`: one-shot work, run (oldest first) by the next in-flight point of this thread, or
  dropped by `withdraw(work)` if its owner ran it itself. The MoE layer's deferred expert weight-gradient GEMMs
  (`moe.layer.wgrad`) queue themselves so; the dispatch's backward (a combine of the gradients) runs them.
- `while_in_flight(worker)`: for the duration of a block, every in-flight point of this thread enters
  `worker(name)` (a context manager) around its wait: `__enter__` runs while the data moves, `__exit__` after the
  wait. DualPipeV's interleaver (`moe.layer.interleave`) and decode's two micro-batches hand the other side the
  baton so; nested workers are entered in the order they were registered.

Who marks points: mtdeepep's differentiable ops (`mtdeepep.autograd`: the dispatch's backward 'dispatch_backward',
the combine's backward 'combine_backward') and the MoE layer's forward ('dispatch', 'combine') and the all-to-all
dispatcher's backward. A point with no work registered does nothing, and the ops then communicate synchronously
(`has_work()`): the same kernels either way, so results do not depend on what ran in between.

Everything is thread-local: a CPU backward runs on the thread that called it, and an interleaver's two sides run on
two threads, each with its own work. Work must not touch the tensors being sent or received.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from .utils.thread_local import thread_local_setting

_THREAD = threading.local()  # `.queue`: one-shot work; `.workers`: the registered workers, outermost first

Worker = Callable[[str], AbstractContextManager]


def _queue() -> list[Callable[[], Any]]:
    queue = getattr(_THREAD, "queue", None)
    if queue is None:
        queue = _THREAD.queue = []
    return queue


def workers() -> tuple[Worker, ...]:
    """This thread's registered workers, outermost first."""
    return getattr(_THREAD, "workers", ())


def has_work() -> bool:
    """Whether an in-flight point of this thread would run anything (queued work or a worker)."""
    return bool(getattr(_THREAD, "queue", None)) or bool(workers())


def run_at_next_in_flight(work: Callable[[], Any]) -> None:
    """Queue `work()` to run at the next in-flight point of this thread (after what is already queued)."""
    _queue().append(work)


def withdraw(work: Callable[[], Any]) -> None:
    """Drop every queued `work` (compared with ==) of this thread: its owner ran it already."""
    queue = _queue()
    queue[:] = [w for w in queue if w != work]


def run_queued() -> int:
    """Runs (and empties) this thread's queued work, oldest first, including work queued while it runs; returns how
    many ran. An in-flight point calls it; so may code that needs the work done without a communication."""
    queue, count = _queue(), 0
    while queue:
        queue.pop(0)()
        count += 1
    return count


@contextlib.contextmanager
def while_in_flight(worker: Worker | None) -> Iterator[None]:
    """On this thread, within the block, every in-flight point enters `worker(name)` around its wait (after the
    outer workers). `None` registers nothing."""
    if worker is None:
        yield
        return
    with thread_local_setting(_THREAD, "workers", (*workers(), worker), default=()):
        yield


@contextlib.contextmanager
def in_flight(name: str, active: bool = True) -> Iterator[None]:
    """Marks a communication this thread has started and is about to wait for (the block is the wait): on enter the
    queued work runs, then each worker's `__enter__`; after the block the workers' `__exit__` (innermost first).

    `active=False` (nothing is in flight, e.g. a dispatcher whose `*_begin` already finished the communication) or
    no work registered: nothing happens.
    """
    if not active:
        yield
        return
    run_queued()
    with contextlib.ExitStack() as stack:
        for worker in workers():
            stack.enter_context(worker(name))
        yield
