"""The one launcher for multi-process tests and benchmarks: ranks are processes of this host joined by gloo.

- `RankPool(world_size)`: spawns the rank processes once (e.g. per test module) and runs many cases in them.
  `pool.run(case, *args)` calls `case(ctx, *args)` on every rank (`ctx` is a `RankContext`) and returns the
  results ordered by rank, or raises `RankFailure` with each failing rank's traceback. Every wait has a deadline:
  a case that hangs (or a rank that dies) fails with the ranks that gave no result, the stacks of the hung ranks
  are dumped to stderr, the processes are killed, and the next `run` starts fresh ones.
- `RankPools`: pools by world size, started on first use (the test suite's fixtures).
- `run_ranks(worker, world_size, args)`: one call of `worker(rank, world_size, group, *args)` on fresh ranks (the
  benchmarks' entry point).
- `run_processes(target, num_processes, args)`: hand-rolled processes for what a pool cannot host: a rank that
  kills itself, a process that dies during set-up. `target(proc, *args)` gets a `ProcessContext` (rank, port, a
  `send` for values reported before dying, `init_group` to join gloo); every process is joined under a deadline.
- `free_port()`: a free TCP port on 127.0.0.1.
- `cuda_skip_reason()`: why the GPU tests cannot run here (no CUDA device, or the CUDA executor is not built), or
  None; the one place that decides it for tests/cuda and bench/cuda_kernels.py.

Cases and targets must be module-level functions (they are pickled by name) of modules that the rank processes can
import: they inherit the parent's `sys.path`. The ranks are forked from a fork server that has imported torch (a
fresh interpreter otherwise: `MTDEEPEP_TEST_START_METHOD=spawn`, see `_start_context`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_POLL_S = 0.5  # how often a wait checks that its processes are still alive
_STACK_DUMP_S = 2.0  # how long hung ranks get to print their stacks before they are killed


class RankFailure(AssertionError):
    """A case failed on some rank, timed out, or a rank process died. The message holds the tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def num_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads per rank so that the ranks together use every core once."""
    return max(1, num_cores() // world_size)


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float | None = None) -> dist.ProcessGroup:
    """Joins the gloo group of `world_size` processes at 127.0.0.1:`port`; returns the world group."""
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **kwargs)
    return dist.group.WORLD


# The compiled CUDA executor (csrc/runtime/cuda, csrc/kernels/cuda), built by setup.py only with a CUDA torch and nvcc.
CUDA_EXTENSION_MODULE = "mtdeepep._C_cuda"


def cuda_skip_reason(need_executor: bool = True) -> str | None:
    """Why GPU tests cannot run in this process, or None when they can.

    need_executor: also require mtdeepep's CUDA executor (the extension `CUDA_EXTENSION_MODULE`); tests of plain
    PyTorch GPU paths (the MoE layer's GEMMs) pass False. Only the absence of a device is a reason to skip: on a
    machine with a GPU and a CUDA build of torch, a missing executor is a broken build, so the tests run and fail
    (with the import error) instead of skipping and letting the run pass. Does not create a CUDA context (spawned
    rank processes create their own).
    """
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, {build})"
    if need_executor and torch.version.cuda is None:  # a device, but torch built for another toolkit (ROCm)
        try:
            importlib.import_module(CUDA_EXTENSION_MODULE)
        except ImportError as error:
            return f"mtdeepep's CUDA executor is not built ({CUDA_EXTENSION_MODULE}: {error})"
    return None


def cuda_executor_import_error() -> str | None:
    """Why `mtdeepep._C_cuda` does not import (None when it does)."""
    try:
        importlib.import_module(CUDA_EXTENSION_MODULE)
    except ImportError as error:
        return f"{CUDA_EXTENSION_MODULE}: {error}"
    return None


# ---------------------------------------------------------------------------------------------------------------
# RankPool


@dataclass
class RankContext:
    """What a case sees inside a rank process. `cache` survives between the cases of one pool (e.g. buffers)."""

    rank: int
    world_size: int
    group: dist.ProcessGroup
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _PoolSettings:
    world_size: int
    port: int
    threads: int
    env: tuple[tuple[str, str], ...]
    pg_timeout_s: float | None
    caller: _Caller | None = None  # what a forked rank takes on from its caller (`_start_context`)


# How rank processes start. A spawned process is a fresh interpreter that imports torch: ~2.5 s of CPU per rank on
# the 2-core test machine, most of a short multi-process test. Instead a fork server that has imported torch (and
# nothing of this library, whose modules read their environment at import) forks each rank: the same fresh state but
# for torch's own import. A forked rank inherits the fork server's environment, not the caller's: the caller's whole
# environment travels with the rank and replaces it there before the rank runs its target or case (their modules are
# imported just before: this library and its test cases read their variables when they use them, not at import).
# That is exact but for the variables the preloaded modules read when they are imported (torch's, Triton's,
# OpenMP's, ...): when one of those differs from the server's, the ranks are spawned instead (`start_counts()` counts
# both, and why; the suite's summary prints them). MTDEEPEP_TEST_START_METHOD=spawn spawns always.
START_METHOD_ENV = "MTDEEPEP_TEST_START_METHOD"
# Third party only; torch.distributed.pipelining (the trainer's schedules) pulls in torch._dynamo and DTensor: ~2 s.
_FORKSERVER_PRELOAD = ["numpy", "torch", "torch.distributed", "torch.multiprocessing", "torch.distributed.pipelining"]
# Variables read at import by the preloaded modules (torch, numpy, Triton through torch._dynamo, the OpenMP / BLAS
# runtimes they load) or by the interpreter at its start: a fork server imported them under its own values.
_IMPORT_TIME_PREFIXES = (
    "TORCH", "PYTORCH", "TRITON", "CUDA", "NCCL", "NVIDIA", "HIP", "ROCM", "MUSA", "KINETO", "ATEN", "XLA", "OMP_",
    "MKL", "KMP_", "GOMP", "OPENBLAS", "NPY_", "NUMPY", "PYTHON", "LD_", "MALLOC", "LIBC",
)  # fmt: skip
# ... but for these, read when used: torch itself sets the inductor's cache directory in the caller at its first
# torch.compile (and megatron.core at import), which would otherwise spawn every launch after it.
_READ_WHEN_USED = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"})
_forkserver_env: dict[str, str] | None = None  # the environment the fork server started with (None: not started)
_start_counts: dict[str, int] = {}  # "forkserver" / "spawn: <why>" -> processes started


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest rewrites it every test


def start_counts() -> dict[str, int]:
    """Rank processes started by this process so far: 'forkserver' (forked from the fork server) and 'spawn: why'
    (fresh interpreters, with the reason: the switch, or the import-time variables that differ from the server's)."""
    return dict(_start_counts)


class _Caller:
    """What a forked rank takes on from its caller (see `_start_context`): the caller's environment, and its standard
    output and error as they are at the launch. The fork server's own are those of the moment it started (under
    pytest, the capture file of whichever test started it), so a rank's prints would miss the test that launched it.
    Pickled into the rank's arguments, the two descriptors travel as duplicates (multiprocessing's `DupFd`)."""

    def __init__(self, env: dict[str, str], streams: tuple | None = None) -> None:
        self.env = env
        self.streams = streams  # in the rank: handles of duplicates of the caller's descriptors 1 and 2

    def __reduce__(self):
        return (_Caller, (self.env, tuple(reduction.DupFd(fd) for fd in (1, 2))))

    def take_on(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        if self.streams is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            for target, handle in zip((1, 2), self.streams):
                fd = handle.detach()
                os.dup2(fd, target)
                os.close(fd)


def _start_context(num_processes: int) -> tuple[Any, _Caller | None]:
    """The multiprocessing context that starts the next `num_processes` ranks (see `START_METHOD_ENV`), and what a
    forked rank must take on from its caller (None for a spawned one, which inherits the caller's)."""
    global _forkserver_env
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV} must be 'spawn' or 'forkserver', got {method!r}")
    env = _environment()
    if method == "spawn":
        why = f"spawn: {START_METHOD_ENV}=spawn"
    else:
        if _forkserver_env is None:
            context = mp.get_context("forkserver")
            context.set_forkserver_preload(_FORKSERVER_PRELOAD)
            _forkserver_env = env
        changed = sorted(
            k for k in set(env) | set(_forkserver_env)
            if env.get(k) != _forkserver_env.get(k)
            and k.upper().startswith(_IMPORT_TIME_PREFIXES)
            and k not in _READ_WHEN_USED
        )  # fmt: skip
        if not changed:
            _start_counts["forkserver"] = _start_counts.get("forkserver", 0) + num_processes
            return mp.get_context("forkserver"), _Caller(env)
        why = f"spawn: the fork server's import-time variables differ: {', '.join(changed)}"
    _start_counts[why] = _start_counts.get(why, 0) + num_processes
    return mp.get_context("spawn"), None


def _take_on_caller(caller: _Caller | None) -> None:
    """A forked rank takes on its caller's environment and streams (see `_Caller`)."""
    if caller is not None:
        caller.take_on()


_READY = -1  # the task id of the start-up report


def _pool_worker(rank: int, settings: _PoolSettings, tasks, results) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for the stacks of a hung rank
    _take_on_caller(settings.caller)
    os.environ.update(dict(settings.env))
    torch.set_num_threads(settings.threads)
    try:
        group = init_gloo(rank, settings.world_size, settings.port, settings.pg_timeout_s)
    except BaseException:
        results.put((_READY, rank, False, traceback.format_exc()))
        return
    results.put((_READY, rank, True, None))
    ctx = RankContext(rank, settings.world_size, group)
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, case, args = task
        try:
            outcome = (task_id, rank, True, case(ctx, *args))
        except BaseException:
            outcome = (task_id, rank, False, traceback.format_exc())
        results.put(outcome)
    ctx.cache.clear()  # buffers go before the process group they use
    dist.destroy_process_group()


class RankPool:
    """`world_size` rank processes (spawned, gloo on 127.0.0.1) that run cases on request.

    timeout_s: default deadline of one `run`. start_timeout_s: deadline for every rank to join the group.
    threads: intra-op threads per rank (default: the cores shared evenly). env: environment variables set in the
    ranks before they join. pg_timeout_s: the process group's own timeout (default: torch's).
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, start_timeout_s: float = 90.0,
                 threads: int | None = None, env: dict[str, str] | None = None,
                 pg_timeout_s: float | None = None) -> None:  # fmt: skip
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._threads = threads_per_rank(world_size) if threads is None else threads
        self._env = tuple(sorted((env or {}).items()))
        self._pg_timeout_s = pg_timeout_s
        self._next_task = 0
        self.processes: list = []
        self._start()

    # -- lifetime

    def _start(self) -> None:
        context, caller = _start_context(self.world_size)
        settings = _PoolSettings(self.world_size, free_port(), self._threads, self._env, self._pg_timeout_s, caller)
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._results = context.Queue()
        self.processes = [
            context.Process(target=_pool_worker, args=(rank, settings, self._tasks[rank], self._results), daemon=True)
            for rank in range(self.world_size)
        ]
        for process in self.processes:
            process.start()
        self._collect(_READY, "start-up", self.start_timeout_s)

    def close(self, force: bool = False) -> None:
        """Stops the ranks: asks them to leave and joins them (30 s), then kills whatever is left."""
        if not force:
            for task_queue, process in zip(self._tasks, self.processes):
                if process.is_alive():
                    task_queue.put(None)
            deadline = time.monotonic() + 30
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        _kill(self.processes)
        self.processes = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # -- cases

    def run(self, case: Callable[..., Any], *args, timeout_s: float | None = None) -> list[Any]:
        """Runs `case(ctx, *args)` on every rank; returns the results ordered by rank.

        Raises `RankFailure` with every failing rank's traceback; on a deadline or a dead rank the pool is
        restarted before the next `run`.
        """
        if not self.processes:  # an earlier case broke the pool
            self._start()
        self._next_task += 1
        for task_queue in self._tasks:
            task_queue.put((self._next_task, case, args))
        name = f"{getattr(case, '__qualname__', case)}({', '.join(_short_repr(a) for a in args)})"
        outcomes = self._collect(self._next_task, name, self.timeout_s if timeout_s is None else timeout_s)
        return [outcomes[r] for r in range(self.world_size)]

    def _collect(self, task_id: int, name: str, timeout_s: float) -> dict[int, Any]:
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world_size:
            try:
                got_id, rank, ok, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive() and r not in outcomes]
                if dead or time.monotonic() > deadline:
                    self._fail_missing(name, outcomes, dead, timeout_s)
                continue
            if got_id == task_id:
                outcomes[rank] = (ok, value)
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if failures:
            if task_id == _READY:
                self.close(force=True)
            raise RankFailure(f"{name} failed on {self.world_size} ranks:\n" + "\n".join(failures))
        return {r: v for r, (_, v) in outcomes.items()}

    def _fail_missing(self, name: str, outcomes: dict, dead: list[int], timeout_s: float) -> None:
        missing = sorted(set(range(self.world_size)) - set(outcomes))
        hung = [r for r in missing if r not in dead]
        exitcodes = {r: self.processes[r].exitcode for r in dead}
        _dump_stacks([self.processes[r] for r in hung])
        self.close(force=True)
        reason = f"rank processes exited (exit codes {exitcodes})" if dead else f"timed out after {timeout_s:.0f} s"
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        raise RankFailure(
            f"{name}: {reason}; no result from ranks {missing} (their stacks are in the captured stderr)"
            + "".join("\n" + f for f in failures)
        )


class RankPools:
    """Rank pools by world size, each started on first use with the same settings (e.g. shared by the tests of a
    module); `close()` stops them all."""

    def __init__(self, **pool_kwargs) -> None:
        self._pool_kwargs = pool_kwargs
        self._pools: dict[int, RankPool] = {}

    def __getitem__(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, **self._pool_kwargs)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


# ---------------------------------------------------------------------------------------------------------------
# One-shot runs


def _call_worker(ctx: RankContext, worker: Callable[..., Any], *args) -> Any:
    return worker(ctx.rank, ctx.world_size, ctx.group, *args)


def run_ranks(worker: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float = 600,
              threads: int | None = None, pg_timeout_s: float | None = 300) -> list[Any]:  # fmt: skip
    """Runs `worker(rank, world_size, group, *args)` once on `world_size` fresh rank processes; returns the
    results by rank. Raises `RankFailure` if a rank fails or the ranks do not finish within `timeout_s`."""
    with RankPool(world_size, timeout_s=timeout_s, threads=threads, pg_timeout_s=pg_timeout_s) as pool:
        return pool.run(_call_worker, worker, *args)


@dataclass
class ProcessContext:
    """What a `run_processes` target gets: its rank among the processes, their number, a rendezvous port."""

    rank: int
    num_processes: int
    port: int
    _results: Any

    def send(self, value: Any) -> None:
        """Reports `value` to the parent now: it is in the pipe when this returns (the process may kill itself)."""
        self._results.put((self.rank, True, value))

    def init_group(self, timeout_s: float | None = None) -> dist.ProcessGroup:
        """Joins the gloo group of all the processes."""
        return init_gloo(self.rank, self.num_processes, self.port, timeout_s)


@dataclass
class ProcessResults:
    """What `run_processes` saw: each process's sent values (its return value last), exit codes and pids."""

    values: dict[int, list[Any]]
    exitcodes: list[int | None]
    pids: list[int]


def _process_entry(target: Callable[..., Any], proc: ProcessContext, args: tuple,
                   caller: _Caller | None = None) -> None:  # fmt: skip
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _take_on_caller(caller)
    try:
        value = target(proc, *args)
    except BaseException:
        proc._results.put((proc.rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    if value is not None:
        proc.send(value)


def run_processes(target: Callable[..., Any], num_processes: int, args: tuple = (),
                  timeout_s: float = 120.0) -> ProcessResults:  # fmt: skip
    """Runs `target(proc, *args)` in `num_processes` spawned processes (`proc` a `ProcessContext`) and joins them
    all within `timeout_s`. A process may kill itself (its exit code says so); one that raises fails the call
    with its traceback, and one still alive at the deadline is killed and fails it too."""
    context, caller = _start_context(num_processes)
    results = context.SimpleQueue()  # put() writes to the pipe before it returns, unlike Queue's feeder thread
    port = free_port()
    processes = [
        context.Process(
            target=_process_entry, args=(target, ProcessContext(rank, num_processes, port, results), args, caller)
        )
        for rank in range(num_processes)
    ]
    for process in processes:
        process.start()
    values: dict[int, list[Any]] = {rank: [] for rank in range(num_processes)}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s

    def drain() -> None:
        while not results.empty():
            rank, ok, value = results.get()
            if ok:
                values[rank].append(value)
            else:
                errors.append(f"--- process {rank} ---\n{value}")

    # Drain while waiting: a child writing more than the pipe holds blocks until it is read.
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        drain()
        for process in processes:
            process.join(timeout=_POLL_S / len(processes))
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    _dump_stacks([processes[r] for r in hung])
    _kill(processes)
    drain()
    if hung:
        errors.insert(0, f"processes {hung} did not finish within {timeout_s:.0f} s")
    if errors:
        raise RankFailure(f"{getattr(target, '__qualname__', target)}:\n" + "\n".join(errors))
    return ProcessResults(values, [p.exitcode for p in processes], [p.pid for p in processes])


# ---------------------------------------------------------------------------------------------------------------
# Process helpers


def _short_repr(value: Any, limit: int = 40) -> str:
    text = getattr(value, "__qualname__", None) or str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dump_stacks(processes: list) -> None:
    """Asks hung processes to print every thread's stack to stderr (faulthandler), then gives them a moment."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # it may have exited meanwhile
            os.kill(process.pid, signal.SIGUSR1)
    if alive:
        time.sleep(_STACK_DUMP_S)


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=10)
