"""R ranks of mtdeepep in one process on one GPU, running concurrently: the single-process harness.

Rank processes that share one GPU are time-sliced: the GPU runs one context at a time, so their kernels never run
together. That proves data movement and protocol, but not the memory ordering between ranks that run at once, and
any bandwidth measured then times the scheduler. Here the ranks are R `Buffer`s of one process, each over its own
CUDA engine (its own device memory, status words and communication stream); their peer tables hold each other's
device pointers instead of IPC handles, and each rank has its own stream. The very same kernels then run
concurrently, as ranks on their own GPUs would: the place to find ordering bugs (under compute-sanitizer too) and to
measure bandwidth honestly.

Two ways to drive the ranks:

- `run(case, *args)`: one host thread per rank, each with its device and its rank's stream current, calls
  `case(ctx, *args)` with a `LocalRankContext` (rank, world_size, the collectives a case needs: `barrier`,
  `all_gather_object`, and `new_buffer`, which every rank calls together). Host synchronisation in one rank (the
  counts of a dispatch, `.cpu()`) then blocks only that rank, as in separate processes. The GPU test cases of
  tests/cuda run unchanged this way.
- `buffers(...)` + `stream(rank)`: the buffers of every rank, to enqueue work rank after rank from one thread
  (`with ranks.stream(r): buffers[r].dispatch(..., num_worst_tokens=...)`): calls that do not synchronise the host,
  back to back, as a benchmark wants.

Every wait here is bounded: thread barriers by `timeout_s` (a rank that does not arrive breaks the barrier for all,
naming the phase), device waits by the buffers' own timeout, the threads' join by `join_timeout_s`.

Example:

    with LocalRanks(4) as ranks:
        buffers = ranks.buffers(num_nvl_bytes=256 << 20)
        for r, buffer in enumerate(buffers):
            with ranks.stream(r):
                ...  # layout and dispatch of rank r (num_worst_tokens > 0: no host synchronisation)
        ranks.synchronize()
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import default_timeout
from ..buffer import Buffer
from ..engines import cuda as cuda_executor
from ..engines.cuda import CudaEngine, LocalGroup

_uids = itertools.count(1 << 40)  # buffer ids of single-process groups (never equal to a set-up's hash-based uid)
_current = threading.local()  # the LocalRankContext of the calling thread, inside `run`


def current_context() -> LocalRankContext | None:
    """The rank context of the calling thread when it runs inside `LocalRanks.run`, else None."""
    return getattr(_current, "context", None)


class LocalRanks:
    """`num_ranks` ranks in this process on one CUDA device (see the module docstring).

    device: the GPU (default: the current one). timeout_s: the buffers' timeout and the bound of every thread
    barrier (default: `MTDEEPEP_TIMEOUT_S`, else 100 s). join_timeout_s: how long `run` waits for its threads.
    """

    def __init__(self, num_ranks: int, *, device: torch.device | int | None = None, timeout_s: float | None = None,
                 join_timeout_s: float = 600.0) -> None:  # fmt: skip
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"mtdeepep: num_ranks must be an int >= 1, got {num_ranks!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("mtdeepep: LocalRanks needs a CUDA device")
        if cuda_executor._C_cuda is None:
            raise RuntimeError("mtdeepep: LocalRanks needs mtdeepep's CUDA executor (mtdeepep._C_cuda is not built)")
        torch.cuda.init()
        if cuda_executor._C_cuda.module_loading_lazy() == 1:
            # Seen on an H200: a kernel loaded at its first launch synchronises the context, which then waits for
            # the other ranks' kernels, which wait for this rank's next launch: every rank stops until the timeout.
            raise RuntimeError(
                "mtdeepep: LocalRanks needs CUDA's eager module loading: the ranks of one process wait for each "
                "other's kernels, and a lazily loaded kernel's first launch synchronises the whole context (a "
                "deadlock until the timeout). Set CUDA_MODULE_LOADING=EAGER before the process first uses CUDA."
            )
        index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
        self.device = torch.device("cuda", index)
        self.num_ranks = num_ranks
        self.timeout_s = default_timeout(timeout_s)
        self.join_timeout_s = join_timeout_s
        # Streams no other rank or engine of this process holds (torch's pool hands its streams out round-robin).
        self.streams = [cuda_executor.claim_stream(self.device) for _ in range(num_ranks)]
        self._created: list[list[Buffer]] = []
        self._contexts = [LocalRankContext(r, num_ranks, self) for r in range(num_ranks)]
        self._barrier = threading.Barrier(num_ranks, timeout=self.timeout_s)
        self._slots: list[Any] = [None] * num_ranks
        self._phase = ""

    # ---- buffers ----

    def buffers(self, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                timeout_s: float | None = None, **_ignored) -> list[Buffer]:  # fmt: skip
        """One `Buffer` per rank, connected to each other (DeepEP's constructor arguments; those that only concern
        transports are accepted and ignored). Destroyed by `close()` if not before."""
        timeout_s = self.timeout_s if timeout_s is None else default_timeout(timeout_s)
        num_ll_bytes = num_rdma_bytes if low_latency_mode else 0
        engines: list[CudaEngine] = []
        try:
            with torch.cuda.device(self.device):
                for rank in range(self.num_ranks):
                    engines.append(CudaEngine(rank=rank, num_ranks=self.num_ranks, num_nvl_bytes=num_nvl_bytes,
                                              num_ll_bytes=num_ll_bytes, timeout_s=timeout_s))  # fmt: skip
                local, uid = LocalGroup(engines), next(_uids)
                for engine in engines:
                    engine.connect_local(local, uid)
        except BaseException:
            for engine in engines:
                engine.buffer.destroy()
            raise
        buffers = [
            Buffer._over_engine(
                engine,
                num_nvl_bytes=num_nvl_bytes,
                num_rdma_bytes=num_rdma_bytes,
                low_latency_mode=low_latency_mode,
                timeout_s=timeout_s,
            )  # fmt: skip
            for engine in engines
        ]
        self._created.append(buffers)
        return buffers

    @contextlib.contextmanager
    def stream(self, rank: int) -> Iterator[torch.cuda.Stream]:
        """Rank `rank`'s stream as the current one (on the ranks' device)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.streams[rank]):
            yield self.streams[rank]

    def synchronize(self) -> None:
        """Waits for the work of every rank (the whole device)."""
        torch.cuda.synchronize(self.device)

    # ---- ranks as threads ----

    def run(self, case: Callable[..., Any], *args: Any) -> list[Any]:
        """`case(ctx, *args)` on every rank at once, one thread per rank; the results by rank. The first failure
        (by rank) is raised, with the rank named, once every thread ended (a failed rank breaks the thread barriers
        the others wait at, so they end too); a thread still running after `join_timeout_s` is reported by rank."""
        results: list[Any] = [None] * self.num_ranks
        errors: list[BaseException | None] = [None] * self.num_ranks

        def body(rank: int) -> None:
            _current.context = self._contexts[rank]
            try:
                with self.stream(rank):
                    results[rank] = case(self._contexts[rank], *args)
            except BaseException as error:  # noqa: BLE001 - reported to the caller below, by rank
                errors[rank] = error
                self._barrier.abort()  # the other ranks stop waiting for this one
            finally:
                _current.context = None

        self._barrier.reset()
        threads = [threading.Thread(target=body, args=(r,), name=f"mtdeepep-rank-{r}", daemon=True)
                   for r in range(self.num_ranks)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.join_timeout_s)
        stuck = [r for r, thread in enumerate(threads) if thread.is_alive()]
        if stuck:
            raise TimeoutError(f"mtdeepep: ranks {stuck} of {getattr(case, '__name__', case)} still run after "
                               f"{self.join_timeout_s:.0f} s (last collective: {self._phase or 'none'})")  # fmt: skip
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        # A rank that failed by itself, not one that only saw the barrier broken by another.
        first = next(((r, e) for r, e in failed if not isinstance(e, threading.BrokenBarrierError)), None)
        if first is None and failed:
            first = failed[0]
        if first is not None:
            rank, error = first
            raise RuntimeError(f"rank {rank} failed in {getattr(case, '__name__', case)}: "
                               f"{type(error).__name__}: {error}\n{self.device_states()}") from error  # fmt: skip
        return results

    def device_states(self) -> str:
        """The device-side state of every rank of every live buffer group (status words, operation counters, flags):
        what a failure report needs to tell a protocol bug from a slow or missing rank."""
        lines = []
        for group, buffers in enumerate(self._created):
            for buffer in buffers:
                if buffer._destroyed:
                    continue
                try:
                    lines.append(f"  buffers #{group} {buffer._engine.debug_state()}")
                except Exception as error:  # noqa: BLE001 - a report must not fail
                    lines.append(f"  buffers #{group} rank {buffer.rank}: state unreadable: {error}")
        return "device state:\n" + "\n".join(lines) if lines else "device state: no live buffers"

    def _collective(self, rank: int, phase: str, value: Any, combine: Callable[[list[Any]], list[Any]]) -> Any:
        """Every rank deposits `value`; once all did, `combine(values)` runs once (in rank 0's thread) and each rank
        gets its element of the result. Bounded by `timeout_s` at each step."""
        self._phase = phase
        self._slots[rank] = value
        self._wait(rank, phase)
        if rank == 0:
            try:
                self._outcome: Any = combine(list(self._slots))
            except BaseException as error:  # noqa: BLE001 - every rank raises it below
                self._outcome = error
        self._wait(rank, phase)
        outcome = self._outcome
        self._wait(rank, phase)  # everyone read the outcome before the next collective replaces it
        if isinstance(outcome, BaseException):
            raise RuntimeError(f"mtdeepep: {phase} failed in rank 0's thread: {outcome}") from outcome
        return outcome[rank]

    def _wait(self, rank: int, phase: str) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise threading.BrokenBarrierError(
                f"mtdeepep: rank {rank} left '{phase}': another rank failed or did not arrive within "
                f"{self.timeout_s:.0f} s"
            ) from None

    # ---- lifetime ----

    def close(self) -> None:
        """Destroys every buffer made by `buffers` or the contexts (after the device finished every rank's work)."""
        for buffers in self._created:
            for buffer in buffers:
                if not buffer._destroyed:
                    buffer._destroyed = True
                    buffer._engine.destroy()
        self._created.clear()
        for stream in self.streams:
            cuda_executor.release_stream(stream)

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class LocalRankContext:
    """What a case sees in a rank thread of `LocalRanks.run`: the pool contexts' `rank`, `world_size` and `cache`,
    with the collectives as methods (there is no process group: `group` is None)."""

    rank: int
    world_size: int
    ranks: LocalRanks = field(repr=False)
    cache: dict[str, Any] = field(default_factory=dict, repr=False)
    group: None = None

    def barrier(self) -> None:
        self.ranks._collective(self.rank, "barrier", None, lambda values: values)

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's `value`, by rank (the objects themselves: tensors are not copied)."""
        return self.ranks._collective(self.rank, "all_gather_object", value, lambda values: [values] * len(values))

    def new_buffer(self, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                   **kwargs) -> Buffer:  # fmt: skip
        """This rank's buffer of a new group of buffers; every rank calls it together with the same arguments."""

        def make(requests: list[Any]) -> list[Buffer]:
            if any(request != requests[0] for request in requests):
                raise ValueError(f"the ranks asked for different buffers: {requests}")
            return self.ranks.buffers(num_nvl_bytes, num_rdma_bytes, low_latency_mode, **kwargs)

        request = (num_nvl_bytes, num_rdma_bytes, low_latency_mode, sorted(kwargs.items()))
        return self.ranks._collective(self.rank, "new_buffer", request, make)
