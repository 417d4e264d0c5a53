"""Issue 39: a peer killed between two buffer set-ups, as a fault-tolerance test of a user would do it: two ranks
create and destroy buffers in a loop and one is SIGKILLed. `forked_trials` is a `run_processes` target
(test_setup_liveness.py): two long-lived host processes fork a fresh pair of ranks per trial, so that many kills (at
chosen points, or at random moments of the loop) cost one spawn.
"""

from __future__ import annotations

import ast
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

import mtdeepep as deep_ep
from mtdeepep.engines.setup import setup_prefix

from .reliability_cases import wait_child

NVL_BYTES = 1 << 20
LL_BYTES = 1 << 20


def make_buffer(group: dist.ProcessGroup, kind: str, round_: int, timeout_s: float):
    """The round's buffer: `kind` is 'intranode', 'internode' (two nodes of one rank: the network stage's set-up
    too) or 'elastic' (`ElasticBuffer`); every third round of a `Buffer` is in low-latency mode, as in the issue."""
    if kind == "elastic":
        return deep_ep.ElasticBuffer(group, num_bytes=NVL_BYTES, explicitly_destroy=True,
                                     num_cpu_timeout_secs=timeout_s)  # fmt: skip
    kwargs = {"num_ranks_per_node": 1} if kind == "internode" else {}
    low_latency = round_ % 3 == 2
    return deep_ep.Buffer(group, NVL_BYTES, LL_BYTES if low_latency else 0, low_latency_mode=low_latency,
                          num_qps_per_rank=2 if low_latency else 1, explicitly_destroy=True, timeout_s=timeout_s,
                          **kwargs)  # fmt: skip


def _outcome(error: BaseException) -> tuple[str, str, float]:
    return type(error).__name__, str(error), time.time()


# ---------------------------------------------------------------------------------------------------------------
# Many trials in one launch: pairs of ranks forked from two host processes


@dataclass(frozen=True)
class Trial:
    """One pair of forked ranks. `kill_at`: 'after_setup' (the victim, rank 1, SIGKILLs itself right after round
    `round_`'s set-up returned, before any call on the buffer), 'after_destroy' (right after that round's destroy()
    returned, before its next Buffer) or 'random' (its host SIGKILLs it `delay_s` after both ranks' first set-up)."""

    kind: str
    kill_at: str
    round_: int = 2
    delay_s: float = 0.0


def _trial_rank(store_address: tuple[str, int], number: int, rank: int, trial: Trial, timeout_s: float,
                ready_fd: int, report_fd: int) -> None:  # fmt: skip
    """A forked trial rank: joins the trial's group (its own prefix of the hosts' store), sets up a first buffer,
    writes to `ready_fd`, then loops set-ups (`Buffer(...)` / `destroy()`). The survivor (rank 0) writes its error
    to `report_fd` and exits; the victim (rank 1) writes its wall time and kills itself at `trial.kill_at`, or loops
    until its host kills it."""
    code = 1
    try:
        store = dist.TCPStore(*store_address, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"trial/{number}", store), rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s))  # fmt: skip
        group = dist.group.WORLD

        def kill_here(position: str, round_: int) -> None:
            if rank == 1 and trial.kill_at == position and trial.round_ == round_:
                os.write(report_fd, repr(time.time()).encode())
                os.kill(os.getpid(), signal.SIGKILL)

        for round_ in range(1_000_000):
            try:
                buffer = make_buffer(group, trial.kind, round_, timeout_s)
            except Exception as error:  # noqa: BLE001 - reported to the host
                os.write(report_fd, "\x00".join(map(str, _outcome(error))).encode())
                code = 0
                break
            kill_here("after_setup", round_)
            buffer.destroy()
            if round_ == 0:
                os.write(ready_fd, b"r")
            kill_here("after_destroy", round_)
    finally:
        os._exit(code)


def forked_trials(proc, trials: list[Trial], timeout_s: float):
    """2 host processes (never a process group of their own: they fork the trials' ranks, which must not inherit
    one). Per trial each forks its rank and waits for it (at most the set-up timeout and a margin). Returns, per
    trial, host 1's (kill wall time, victim pid, host) or host 0's survivor report (error type, message, wall time)."""
    store = dist.TCPStore("127.0.0.1", proc.port, world_size=2, is_master=proc.rank == 0,
                          timeout=timedelta(seconds=60))  # fmt: skip
    results = []
    for number, trial in enumerate(trials):
        ready_r, ready_w = os.pipe()
        report_r, report_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(report_r)
            _trial_rank(("127.0.0.1", proc.port), number, proc.rank, trial, timeout_s, ready_w, report_w)
        os.close(ready_w)
        os.close(report_w)
        try:
            if proc.rank == 1 and trial.kill_at == "random":
                assert os.read(ready_r, 1) == b"r", f"trial {number}: rank 1 (pid {pid}) failed its first round"
                time.sleep(trial.delay_s)
                killed_at = time.time()
                os.kill(pid, signal.SIGKILL)
            report = b""
            while chunk := os.read(report_r, 1 << 16):
                report += chunk
            code = wait_child(pid, timeout_s + 10.0)
            if proc.rank == 1:
                assert code == -signal.SIGKILL, f"trial {number}: the victim (pid {pid}) exited {code}: {report!r}"
                results.append((killed_at if trial.kill_at == "random" else float(report), pid, socket.gethostname()))
            else:
                assert code == 0 and report, f"trial {number}: the survivor (pid {pid}) exited {code} without a report"
                kind, message, at = report.decode().split("\x00")
                results.append((kind, message, float(at)))
            store.set(f"done/{number}/{proc.rank}", "1")  # the next trial's ranks start together
            store.wait([f"done/{number}/{1 - proc.rank}"])
        finally:
            os.close(ready_r)
            os.close(report_r)
    _leave(store, proc.rank)
    return results


def _leave(store: dist.TCPStore, rank: int) -> None:
    """Host 0 holds the store: it leaves only once host 1 is done with it."""
    if rank == 1:
        store.set("left/1", "1")
    else:
        store.wait(["left/1"])


# ---------------------------------------------------------------------------------------------------------------
# A job restarted in the same store


def _job_rank(store_address: tuple[str, int], job: str, rank: int, late_s: float, big: int, done_fd: int) -> None:
    """A forked rank of job `job`. Its process group rendezvous under the job's own prefix, but mtdeepep's set-up
    records go to the store shared by both jobs (as in a store that outlives a job). Job 'A': a first buffer, then
    rank 0 asks for `big` bytes (its set-up fails and publishes why), then both SIGKILL themselves. Job 'B': the same
    two set-ups, with the peer that A's records could mislead arriving `late_s` late each time: rank 1 in the first
    (A's rank 1 left a live record of a dead process), rank 0 in the second (A's rank 0 left a failure for it).
    Writes its outcomes to `done_fd`."""
    import mtdeepep.engines.setup as setup

    code = 1
    try:
        store = dist.TCPStore(*store_address, is_master=False, timeout=timedelta(seconds=30))
        setup._store = lambda: store  # the records of both jobs in one store
        dist.init_process_group("gloo", store=dist.PrefixStore(job, store), rank=rank, world_size=2,
                                timeout=timedelta(seconds=20))  # fmt: skip
        group = dist.group.WORLD
        outcomes = []
        for round_, late_rank in enumerate((1, 0)):
            if job == "B" and rank == late_rank:
                time.sleep(late_s)
            start = time.monotonic()
            nvl_bytes = big if job == "A" and round_ == 1 and rank == 0 else NVL_BYTES
            try:
                deep_ep.Buffer(group, nvl_bytes, explicitly_destroy=True, timeout_s=20.0).destroy()
                outcomes.append(("ok", "", time.monotonic() - start))
            except Exception as error:  # noqa: BLE001 - reported to the host
                outcomes.append((type(error).__name__, str(error), time.monotonic() - start))
        os.write(done_fd, repr(outcomes).encode())
        if job == "A":
            os.kill(os.getpid(), signal.SIGKILL)
        code = 0
    finally:
        os._exit(code)


def restarted_job_in_the_same_store(proc, late_s: float, big: int):
    """2 host processes fork job A's ranks, then job B's (see `_job_rank`). Returns this host's [(rank's pid, its
    outcomes) of job A, of job B] and the live record its rank left for the group after B."""
    store = dist.TCPStore("127.0.0.1", proc.port, world_size=2, is_master=proc.rank == 0,
                          timeout=timedelta(seconds=60))  # fmt: skip
    results = []
    for job in ("A", "B"):
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(done_r)
            _job_rank(("127.0.0.1", proc.port), job, proc.rank, late_s, big, done_w)
        os.close(done_w)
        report = b""
        while chunk := os.read(done_r, 1 << 16):
            report += chunk
        os.close(done_r)
        code = wait_child(pid, 60.0)
        assert code == (-signal.SIGKILL if job == "A" else 0), f"job {job}: rank {proc.rank} exited {code}: {report!r}"
        results.append((pid, ast.literal_eval(report.decode())))
        store.set(f"{job}/done/{proc.rank}", "1")
        store.wait([f"{job}/done/{1 - proc.rank}"])
    live = store.get(f"{setup_prefix((0, 1))}/live/{proc.rank}").decode()
    _leave(store, proc.rank)
    return results, live


# ---------------------------------------------------------------------------------------------------------------
# Issue 38, item 3: ranks at different buffer generations


def _attempt(group, timeout_s: float, nvl_bytes: int = NVL_BYTES) -> tuple[str, str]:
    try:
        deep_ep.Buffer(group, nvl_bytes, explicitly_destroy=True, timeout_s=timeout_s).destroy()
    except Exception as error:  # noqa: BLE001 - returned for the test to judge
        return type(error).__name__, str(error)
    return "ok", ""


def diverged_generations(proc, big: int, timeout_s: float):
    """As issue 38 found it: rank 1 never builds the group's first buffer (rank 0 times out in its set-up); then
    rank 0 asks for `big` bytes of /dev/shm for its second buffer and fails at once; only then does rank 1 build
    its first. Returns each rank's outcomes."""
    group = proc.init_group()
    if proc.rank == 0:
        outcomes = [_attempt(group, timeout_s), _attempt(group, timeout_s, big)]
        dist.barrier()
        dist.barrier()  # rank 0 hosts the store: it stays until rank 1's attempt has read it
        return outcomes
    dist.barrier()
    outcomes = [_attempt(group, timeout_s)]
    dist.barrier()
    return outcomes
