"""The engine seam: what an executor implements under the DeepEP facades (`Buffer`, V1, and `ElasticBuffer`, V2).

The facades check arguments, keep DeepEP's names, defaults and return tuples, and call one engine. An engine moves
the data: set-up exchange, layout, dispatch, combine, low-latency dispatch/combine, destroy, with one event type
(`mtdeepep._C.EventHandle`). Arguments reach it already checked (shapes, dtypes, devices, contiguity, values).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .. import _C
from .handles import DispatchRecord

Event = _C.EventHandle  # the one event type; None stands for "already complete"


@dataclass
class DispatchOutputs:
    """What a (non-cached) dispatch returns: DeepEP's tuple, minus the event, with the handle tuple (its record
    attached, see `mtdeepep.engines.handles`)."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: list[int]
    handle: tuple
    event: Any


class Engine(ABC):
    """One executor's normal and low-latency modes for one group. Arguments are checked by the facade."""

    #: the kind of handle this engine issues and accepts ('intranode' or 'internode'); low-latency: 'low_latency'
    handle_kind: str
    device: torch.device
    rank: int
    num_ranks: int
    num_nodes: int
    num_ranks_per_node: int
    group: tuple[tuple[int, ...], int]  # see mtdeepep.engines.setup.group_key

    # ---- normal mode ----
    @abstractmethod
    def layout(self, topk_idx: torch.Tensor, num_experts: int, previous: Event | None, async_finish: bool) -> tuple:
        """`(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 or None, num_tokens_per_expert [E]
        int32, is_token_in_rank [T, R] bool, event)`."""

    @abstractmethod
    def dispatch(
        self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, expert_alignment: int,
        num_worst_tokens: int, num_channels: int, previous: Event | None, async_finish: bool,
    ) -> DispatchOutputs:  # fmt: skip
        """Sends each token once to every rank that owns one of its experts (see `Buffer.dispatch`)."""

    @abstractmethod
    def cached_dispatch(
        self, data, scales, record: DispatchRecord, num_worst_tokens: int, num_channels: int, previous: Event | None,
        async_finish: bool, out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
        """The layout of `record`'s dispatch again: `(recv_data, recv_scales, event)`. `out`: placed outputs
        `(recv_data, recv_scales)` from `placed_empty` (engines that return tensors from it), which the peers write
        directly and which are returned."""

    @abstractmethod
    def combine(
        self, x, topk_weights, bias0, bias1, record: DispatchRecord, num_channels: int, previous: Event | None,
        async_finish: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
        """Sums the rows of `record`'s dispatch per source token in FP32: `(combined, combined_weights, event)`."""

    @abstractmethod
    def recv_sources(self, handle: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Source rank and source token index (int64 `[n_valid]` each) of every valid received row of a dispatch,
        from its handle (the only knowledge of a handle's layout a facade needs, e.g. V2's `recv_src_metadata`)."""

    # ---- low-latency mode ----
    @abstractmethod
    def ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int, cumulative_stats,
                    wait_stats, use_fp8: bool, round_scale: bool, use_ue8m0: bool, async_finish: bool,
                    return_recv_hook: bool) -> tuple:  # fmt: skip
        """`(recv_x, recv_scales, recv_count, handle, event, hook)` (see `Buffer.low_latency_dispatch`)."""

    @abstractmethod
    def ll_combine(self, x, topk_idx, topk_weights, record: DispatchRecord, handle: tuple, zero_copy: bool,
                   async_finish: bool, return_recv_hook: bool, out, wait_stats) -> tuple:  # fmt: skip
        """`(combined, event, hook)` (see `Buffer.low_latency_combine`)."""

    @abstractmethod
    def ll_clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None: ...

    @abstractmethod
    def ll_next_combine_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int): ...

    # ---- buffer and lifetime ----
    @abstractmethod
    def empty(self, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An output tensor from the executor's allocator (pooled, pre-faulted memory on CPU)."""

    def placed_empty(self, sizes: tuple[int, int], dtype: torch.dtype, num_topk: int) -> torch.Tensor | None:
        """A `[rows, hidden]` output in memory the peers write directly, for `cached_dispatch(out=...)` (saves the
        receiver's copy), keeping room for the combine of such rows with `num_topk` weights while it lives; None when
        the engine has none (or no room left): use `empty`."""
        return None

    @abstractmethod
    def local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor: ...

    @abstractmethod
    def set_timeout(self, timeout_s: float) -> None: ...

    @abstractmethod
    def interrupt(self, reason: str) -> None:
        """Ends every wait of this rank now and tells the peers (Ctrl-C)."""

    @abstractmethod
    def destroy(self) -> None:
        """Finishes the queued work, then releases everything; a no-op in a forked child (the parent's group is not
        touched)."""


# Engines that run operations on a Python worker thread of their own (the internode engine, the Triton executor) and
# were not destroyed: the exit hook (`shutdown_all_engines`) ends their waits and joins their workers.
LIVE_WORKER_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


class WorkerEngine(Engine):
    """An engine whose operations run in submission order on a Python worker thread of its own (the internode engine,
    the Triton executor), while the caller waits only for the part of each it needs now (its outputs).

    A subclass calls `_start_worker` in its constructor and provides `_task` (what wraps each operation on the
    worker) and `_await_outputs` (how long the caller waits for an operation's outputs, and the error after that).
    """

    rank: int

    def _start_worker(self, name: str) -> None:
        self._busy = 0  # operations queued on the worker and not finished
        self._busy_lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mtdeepep-{name}-{self.rank}")
        LIVE_WORKER_ENGINES.add(self)  # for the exit hook (`shutdown_all_engines`)

    @abstractmethod
    def _check_usable(self) -> None:
        """Raises when this engine can take no further operation."""

    @abstractmethod
    def _task(self, body: Callable[[], None]) -> Callable[[], None]:
        """`body` as the worker runs it (without autograd, with the engine's own bookkeeping)."""

    @abstractmethod
    def _await_outputs(self, notified: Future) -> tuple:
        """The caller's wait for an operation's outputs (`notified`'s result), bounded; raises a CommTimeoutError
        naming this rank after interrupting it when the worker does not get there."""

    def _queue(self, body: Callable[[], None], finished: Callable[[BaseException | None], None]) -> None:
        """Queues `body` (see `_task`) on the worker; `finished(its error or None)` runs when it ends."""
        task = self._task(body)

        def run() -> None:
            error = None
            try:
                task()
            except BaseException as failure:  # noqa: BLE001 - handed to `finished`
                error = failure
            finally:
                with self._busy_lock:
                    self._busy -= 1
            finished(error)

        with self._busy_lock:
            self._busy += 1
        self._worker.submit(run)

    def _run(
        self, operation: Callable[[Callable[[tuple], None]], None], previous: Event | None, async_finish: bool
    ) -> tuple[tuple, Event | None]:
        """Queues `operation(notify)` on the worker (after `previous`) and waits until it calls `notify(outputs)`.

        Returns `(outputs, event)`: without `async_finish` the caller also waits for the rest of the operation (the
        event is then None). An error before `notify` is raised here, one after it by the event's wait.
        """
        self._check_usable()
        notified: Future = Future()
        done = _C.EventHandle.pending()

        def body() -> None:
            if previous is not None:
                previous.wait()
            operation(notified.set_result)
            if not notified.done():
                raise RuntimeError("mtdeepep: internal error: the operation never notified")

        def finished(error: BaseException | None) -> None:
            if error is not None and not notified.done():
                notified.set_exception(error)  # raised by the caller's wait below
                error = None
            done.complete(error)

        self._queue(body, finished)
        try:
            outputs = self._await_outputs(notified)
            if not async_finish:
                done.wait()
                return outputs, None
        except KeyboardInterrupt:
            self.interrupt(f"rank {self.rank} was interrupted (KeyboardInterrupt)")
            raise
        return outputs, done


def shutdown_all_engines() -> None:
    """At exit: every live worker engine with work in flight (`_busy`) is interrupted ("exiting") so its waits end at
    once and its peers are told, then each is destroyed (its worker joined) while the interpreter can still run it.
    Composing engines first (the internode engine destroys the node engine it composes; destroy is idempotent)."""
    engines = sorted(LIVE_WORKER_ENGINES, key=lambda engine: engine.handle_kind != "internode")
    for engine in engines:
        with contextlib.suppress(Exception):
            if engine._busy:
                engine.interrupt(f"rank {engine.rank} is exiting with operations in flight")
            engine.destroy()
