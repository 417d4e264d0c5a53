"""The asynchronous writer of flash checkpoints: the step blocks for a copy of this rank's state into CPU memory; a
background thread writes the rank's shard; rank 0 commits the checkpoint once every rank's shard is on disk.

Protocol of checkpoint `step_N` (files: moe/trainer/io/shard_files.py):
1. `save` (every rank, main thread): wait for this rank's previous checkpoint job to end (its error, if any, is
   raised here), copy this rank's tensors into reused CPU buffers (pinned for accelerator tensors), start the
   job's writer thread and return: training goes on.
2. Writer thread of every rank: writes `rank_R/{model,optimizer,state}.safetensors` into the hidden directory
   `.step_N.partial-SESSION` (each file: temporary name, fsync, rename; hashed while it streams), then
   `rank_R/index.json` (what it wrote, with the sha256 of each file): the rank's "done" marker. A rank whose write
   fails leaves `rank_R.error` (the message) instead, removes its files and keeps the exception for the main
   thread.
3. Rank 0's writer, after its own shard: waits (deadline `timeout_s`) for every rank's index (or error marker),
   checks that the ranks' boxes cover every tensor exactly once, writes `trainer_state.json`, `config.json`, the
   extra files (tokenizer) and, for an export, the whole-model `model.safetensors`; writes `manifest.json` last,
   fsyncs the directory, renames it to `step_N` (atomic, `moe.trainer.io.atomic.publish_directory`), fsyncs the parent,
   points `latest` at it and, with `keep_last`, removes the older checkpoints beyond the newest `keep_last`.
A crash at any point leaves the previous checkpoints and `latest` as they were, and at worst a hidden partial
directory, which the next run's first save removes. SESSION (drawn by rank 0, broadcast at the first save) keeps
a relaunched run from mistaking a crashed attempt's files for its own.

`close(ok)` ends the last job before the process exits: on the normal path (`ok`) every rank waits for its shard,
the ranks agree that all shards were written (one all-reduce, which also fails fast when a rank died), rank 0
commits and a second all-reduce tells every rank that the checkpoint is complete (or raises everywhere). On an
exception path it waits for this rank's shard, gives rank 0's commit a grace period and otherwise abandons the
checkpoint (removing its partial directory), without raising over the exception in flight.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe.trainer.io import shard_files as sf
from moe.trainer.io.atomic import fsync_path, publish_directory, write_bytes, write_json
from moe.trainer.io.boxes import Box, check_tiling, pieces
from moe.trainer.train.checkpoint import run_dir as ckpt
from moe.trainer.train.checkpoint.train_state import Entry
from moe.trainer.train.faults import FaultPlan
from moe.trainer.train.parallel_state import ParallelState

ABORT_GRACE_S = 60.0  # on an exception path, how long rank 0 still waits for the other ranks' shards
WRITER_NICE = 10  # the writer thread's niceness (Linux: per thread): the training threads keep the cores first
_POLL_S = 0.02


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write (this rank's shard, or rank 0's commit) failed."""


class _Aborted(Exception):
    pass


@dataclass
class SaveRequest:
    """What rank 0 adds to a checkpoint (other ranks leave it empty).

    trainer_state: `trainer_state.json`'s content.
    write_config: writes the model's `config.json` into a directory.
    extra_files: copied into the checkpoint (e.g. the tokenizer).
    export: a whole-model state dict to write as a model directory inside the checkpoint (`model.safetensors` +
        `config.json`, what evaluate.py / hf.py / --init read), and `write_model_dir(path, state_dict)` that writes
        one at a path that does not exist yet.
    """

    trainer_state: dict[str, Any] | None = None
    write_config: Callable[[Path], None] | None = None
    extra_files: tuple[Path, ...] = ()
    export: dict[str, torch.Tensor] | None = None
    write_model_dir: Callable[[Path, dict[str, torch.Tensor]], None] | None = None


@dataclass
class SaveStats:
    """Timings of one checkpoint on this rank (seconds) and its bytes."""

    step: int
    wait_previous_s: float = 0.0  # blocked on the previous checkpoint's job
    copy_s: float = 0.0  # the copy into CPU memory (what the step pays)
    write_s: float = 0.0  # the writer thread: this rank's files
    commit_s: float = 0.0  # rank 0: waiting for the others, the manifest, the rename
    shard_bytes: int = 0  # this rank's files
    total_bytes: int = 0  # rank 0: every file of the checkpoint


@dataclass(eq=False)
class _Job:
    step: int
    final: Path
    partial: Path
    session: str
    rank: int
    world: int
    tensors: dict[str, list[tuple[Entry, torch.Tensor]]]
    rank_tensors: dict[str, torch.Tensor]
    rank_info: dict[str, Any]
    request: SaveRequest
    stats: SaveStats
    layout: dict[str, Any]
    timeout_s: float
    keep_last: int
    faults: FaultPlan
    shard_done: threading.Event = field(default_factory=threading.Event)
    shard_ok: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    thread: threading.Thread | None = None
    reported: bool = False

    @property
    def rank_dir(self) -> Path:
        return self.partial / sf.rank_dir_name(self.rank)


class ShardWriter:
    """Asynchronous sharded checkpoints of one rank (see the module docstring).

    Args:
        run_dir: the run directory (`RUN_DIR/checkpoints/step_N`).
        parallel: this rank's groups (rank, world, and the all-reduces of `close`).
        timeout_s: rank 0's deadline for the other ranks' shards of one checkpoint.
        keep_last: after each commit, keep only the newest `keep_last` checkpoints (0: keep all).
        faults: injected faults (the "checkpoint_write" hook point, moe/trainer/train/faults.py); None: none.
    `stats` lists the `SaveStats` of every checkpoint taken.
    """

    def __init__(self, run_dir: str | Path, parallel: ParallelState, *, timeout_s: float = 600.0,
                 keep_last: int = 0, faults: FaultPlan | None = None) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.parallel = parallel
        self.timeout_s = float(timeout_s)
        self.keep_last = int(keep_last)
        self.faults = faults if faults is not None else FaultPlan()
        self.session: str | None = None
        self.stats: list[SaveStats] = []
        self._job: _Job | None = None
        self._buffers: dict[tuple[str, str, int], torch.Tensor] = {}

    # -- the main thread

    def save(self, step: int, entries: list[Entry], rank_tensors: dict[str, torch.Tensor],
             rank_info: dict[str, Any], request: SaveRequest | None = None) -> Path:  # fmt: skip
        """Checkpoint `step` (collective: every rank calls it): blocks for the previous job and the copy of this
        rank's entries that it stores (`Entry.write`) and its rank-local tensors, then writes in the background.
        Returns the directory the checkpoint will have."""
        stats = SaveStats(step)
        t0 = time.perf_counter()
        self.wait()  # the buffers are free again; raises the previous job's error
        if self.session is None:
            self._start_session()
        t1 = time.perf_counter()
        tensors = self._snapshot(entries)
        rank_tensors = {k: v.detach().to("cpu", copy=True) for k, v in rank_tensors.items()}
        t2 = time.perf_counter()
        stats.wait_previous_s, stats.copy_s = t1 - t0, t2 - t1
        root = ckpt.checkpoints_dir(self.run_dir)
        job = _Job(
            step=step, final=root / ckpt.checkpoint_name(step),
            partial=root / f".{ckpt.checkpoint_name(step)}.partial-{self.session}", session=self.session,
            rank=self.parallel.rank, world=self.parallel.layout.world, tensors=tensors, rank_tensors=rank_tensors,
            rank_info=rank_info, request=request or SaveRequest(), stats=stats,
            layout=self.parallel.layout.to_dict(), timeout_s=self.timeout_s, keep_last=self.keep_last,
            faults=self.faults,
        )  # fmt: skip
        self.stats.append(stats)
        job.thread = threading.Thread(target=_run_job, args=(job,), name=f"flash-checkpoint-{step}")
        self._job = job
        job.thread.start()  # not a daemon: the interpreter waits for it before exiting
        return job.final

    def _start_session(self) -> None:
        """First save of this process: rank 0 removes what crashed attempts left and draws the session; every rank
        takes it (one broadcast, which also orders the removal before any rank writes)."""
        box = [None]
        if self.parallel.is_main:
            ckpt.remove_partials(self.run_dir)
            box = [secrets.token_hex(6)]
        if self.parallel.layout.world > 1:
            dist.broadcast_object_list(box, src=0)
        self.session = box[0]

    @torch.no_grad()
    def _snapshot(self, entries: list[Entry]) -> dict[str, list[tuple[Entry, torch.Tensor]]]:
        """Copy the entries this rank stores into its CPU buffers (allocated at the first save, reused after)."""
        out: dict[str, list[tuple[Entry, torch.Tensor]]] = {section: [] for section in sf.SECTIONS}
        seen: dict[tuple[str, str], int] = {}
        pending_device = False
        for e in entries:
            if not e.write:
                continue
            n = seen.get((e.section, e.key), 0)
            seen[(e.section, e.key)] = n + 1
            slot = (e.section, e.key, n)  # a key may have several entries (ZeRO-1 segments of one parameter)
            buf = self._buffers.get(slot)
            src = e.tensor.detach()
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                pin = src.device.type != "cpu" and torch.cuda.is_available()
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
                self._buffers[slot] = buf
            buf.copy_(src, non_blocking=src.device.type != "cpu")
            pending_device |= src.device.type != "cpu"
            out[e.section].append((e, buf))
        if pending_device:
            torch.cuda.synchronize()
        return out

    def raise_if_failed(self) -> None:
        """Raise the error of a finished background job (once)."""
        job = self._job
        if job is not None and job.shard_done.is_set() and not job.thread.is_alive():
            self._raise(job)

    def wait(self) -> None:
        """Wait for the current job to end (this rank's shard; on rank 0 the commit); raises its error."""
        job = self._job
        if job is None:
            return
        job.thread.join()
        self.raise_if_failed()

    def close(self, ok: bool = True) -> None:
        """End the last job before the process exits (see the module docstring). `ok`: the normal end of training
        (collective: every rank calls it); False: on an exception path (local, never raises). An error already
        raised by `wait` / `raise_if_failed` is not raised again."""
        job, self._job = self._job, None
        if job is None:
            return
        if not ok:
            self._close_on_error(job)
            return
        job.shard_done.wait()
        try:
            any_failed = self._any(not job.shard_ok and not job.reported)
        except Exception as exc:  # a rank died: its collective fails, the checkpoint cannot complete
            job.cancel.set()
            job.thread.join()
            raise CheckpointWriteError(
                f"checkpoint of step {job.step}: the ranks could not agree that their shards were written ({exc})"
            ) from exc
        if any_failed:
            job.cancel.set()
            job.thread.join()
            if not isinstance(job.error, _Aborted):  # this rank's failure, or rank 0 read the other's error marker
                self._raise(job)
            job.reported = True
            raise CheckpointWriteError(f"checkpoint of step {job.step}: another rank failed to write its shard")
        job.thread.join()  # rank 0: the commit, whose inputs are all on disk now
        if self._any(job.error is not None and not job.reported):
            self._raise(job)
            raise CheckpointWriteError(f"checkpoint of step {job.step} was not committed (rank 0 failed)")

    @staticmethod
    def _raise(job: _Job) -> None:
        if job.error is not None and not job.reported:
            job.reported = True
            raise CheckpointWriteError(f"checkpoint of step {job.step} failed: {job.error}") from job.error

    def _close_on_error(self, job: _Job) -> None:
        job.shard_done.wait(self.timeout_s)
        if job.rank == 0:
            job.thread.join(ABORT_GRACE_S)
            if job.thread.is_alive():
                job.cancel.set()
        job.thread.join(self.timeout_s)
        if job.error is not None and not job.reported:
            job.reported = True
            print(f"flash checkpoint: step {job.step} was not completed: {job.error}", file=sys.stderr, flush=True)

    def _any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (an all-reduce over the world)."""
        if self.parallel.layout.world == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


# -- the writer thread


def _run_job(job: _Job) -> None:
    with contextlib.suppress(AttributeError, OSError):  # Linux: the niceness of this thread only
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    try:
        start = time.perf_counter()
        _write_shard(job)
        job.stats.write_s = time.perf_counter() - start
        job.shard_ok = True
    except BaseException as exc:  # kept for the main thread
        job.error = exc
        _mark_failed(job, exc)
    finally:
        job.shard_done.set()
    if job.rank != 0 or not job.shard_ok:
        return
    try:
        start = time.perf_counter()
        _commit(job)
        job.stats.commit_s = time.perf_counter() - start
    except BaseException as exc:
        job.error = exc
        shutil.rmtree(job.partial, ignore_errors=True)
    finally:
        job.tensors = {}  # the job keeps no reference to the buffers once it is over
        job.request.export = None


def _mark_failed(job: _Job, exc: BaseException) -> None:
    """Leave `rank_R.error` for rank 0 and remove this rank's files (best effort: the disk may be the problem)."""
    shutil.rmtree(job.rank_dir, ignore_errors=True)
    if job.rank == 0:
        shutil.rmtree(job.partial, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        if job.partial.is_dir():  # not if rank 0 gave the checkpoint up already
            marker = job.partial / f"{sf.rank_dir_name(job.rank)}.error"
            write_bytes(marker, f"{type(exc).__name__}: {exc}\n".encode())


def _write_shard(job: _Job) -> None:
    job.rank_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict] = {}
    tables: dict[str, dict[str, dict]] = {}
    fault = _FaultHook(job)
    for section in sf.SECTIONS:
        tensors: dict[str, torch.Tensor] = {}
        table: dict[str, dict] = {}
        rel = f"{sf.rank_dir_name(job.rank)}/{sf.SECTION_FILES[section]}"
        for entry, buf in job.tensors[section]:
            lo = entry.placement.flat_range[0]
            info = table.setdefault(entry.key, {"shape": list(entry.placement.global_shape),
                                                "dtype": sf.dtype_name(buf.dtype), "pieces": []})  # fmt: skip
            for piece in pieces(entry.placement):
                name = f"{entry.key}@{','.join(map(str, piece.global_box.offsets))}"
                tensors[name] = piece.view(buf.view(-1), lo)
                info["pieces"].append({"file": rel, "name": name, **piece.global_box.to_json()})
        record = sf.write_safetensors(job.partial / rel, tensors, {"step": str(job.step), "section": section},
                                      progress=fault.progress(rel))  # fmt: skip
        fault.done(record.bytes)
        files[rel] = record.to_json()
        tables[section] = table
    rel = f"{sf.rank_dir_name(job.rank)}/{sf.SECTION_FILES['rank_state']}"
    files[rel] = sf.write_safetensors(job.partial / rel, job.rank_tensors, {"step": str(job.step)}).to_json()
    index = {"format": sf.FORMAT, "session": job.session, "step": job.step, "rank": job.rank, "files": files,
             "tensors": tables, "state": job.rank_info}  # fmt: skip
    write_json(job.rank_dir / sf.RANK_INDEX, index)
    fsync_path(job.rank_dir)
    job.stats.shard_bytes = sum(f["bytes"] for f in files.values())


class _FaultHook:
    """The "checkpoint_write" hook point (moe/trainer/train/faults.py): progress through this rank's sharded bytes."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.before = 0
        self.total = sum(b.numel() * b.element_size() for part in job.tensors.values() for _, b in part)

    def progress(self, rel: str):
        def hook(written: int, total: int) -> None:
            self.job.faults.at("checkpoint_write", step=self.job.step, rank=self.job.rank,
                               written=self.before + written, total=self.total, what=rel)  # fmt: skip

        return hook

    def done(self, nbytes: int) -> None:
        self.before += nbytes


def _wait_for_ranks(job: _Job) -> dict[int, dict]:
    """Rank 0: every rank's index of this checkpoint (deadline `timeout_s`); raises for a rank's error marker."""
    deadline = time.monotonic() + job.timeout_s
    indexes: dict[int, dict] = {}
    while len(indexes) < job.world:
        for r in range(job.world):
            if r in indexes:
                continue
            marker = job.partial / f"{sf.rank_dir_name(r)}.error"
            if marker.is_file():
                raise CheckpointWriteError(f"rank {r} failed to write its shard: {marker.read_text().strip()}")
            path = job.partial / sf.rank_dir_name(r) / sf.RANK_INDEX
            if path.is_file():
                index = json.loads(path.read_text())
                if index.get("session") != job.session or index.get("step") != job.step:
                    raise CheckpointWriteError(f"{path} belongs to another run or step")
                indexes[r] = index
        if len(indexes) == job.world:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(job.world)) - set(indexes))
            raise CheckpointWriteError(f"ranks {missing} did not write their shards within {job.timeout_s:g} s")
        if job.cancel.wait(_POLL_S):
            missing = sorted(set(range(job.world)) - set(indexes))
            raise _Aborted(f"checkpoint of step {job.step} abandoned: ranks {missing} did not finish their shards")
    return indexes


def _commit(job: _Job) -> None:
    indexes = _wait_for_ranks(job)
    files: dict[str, dict] = {}
    tensors: dict[str, dict[str, dict]] = {section: {} for section in sf.SECTIONS}
    for r in range(job.world):
        index = indexes[r]
        files.update(index["files"])
        rel = f"{sf.rank_dir_name(r)}/{sf.RANK_INDEX}"
        files[rel] = sf.sha256_file(job.partial / rel).to_json()
        for section in sf.SECTIONS:
            for key, info in index["tensors"][section].items():
                have = tensors[section].setdefault(key, {**info, "pieces": []})
                if (have["shape"], have["dtype"]) != (info["shape"], info["dtype"]):
                    raise CheckpointWriteError(f"{section} tensor {key}: ranks disagree on its shape or dtype")
                have["pieces"] += info["pieces"]
    for section, table in tensors.items():  # every element stored exactly once
        for key, info in table.items():
            problem = check_tiling(tuple(info["shape"]), [Box.from_json(p) for p in info["pieces"]])
            if problem is not None:
                raise CheckpointWriteError(f"{section} tensor {key} is not stored exactly once: {problem}")
    request = job.request
    if request.trainer_state is None:
        raise CheckpointWriteError("rank 0's save request has no trainer state")
    files[sf.TRAINER_STATE] = write_json(job.partial / sf.TRAINER_STATE, request.trainer_state).to_json()
    if request.export is not None and request.write_model_dir is not None:
        export = job.partial / ".model"
        request.write_model_dir(export, request.export)
        for child in sorted(export.iterdir()):
            os.replace(child, job.partial / child.name)
        os.rmdir(export)
    elif request.write_config is not None:
        request.write_config(job.partial)
    for path in request.extra_files:
        shutil.copyfile(path, job.partial / Path(path).name)
    for child in sorted(job.partial.iterdir()):  # the files rank 0 added
        if child.is_file() and child.name not in files and not child.name.endswith((".tmp", ".error")):
            fsync_path(child)
            files[child.name] = sf.sha256_file(child).to_json()
    manifest = {
        "format": sf.FORMAT,
        "format_version": sf.FORMAT_VERSION,
        "step": job.step,
        "session": job.session,
        "world": job.world,
        "layout": job.layout,
        "created_unix": time.time(),
        "files": files,
        "tensors": tensors,
    }
    write_json(job.partial / sf.MANIFEST, manifest)  # last: a checkpoint with a manifest is complete
    fsync_path(job.partial)
    publish_directory(job.partial, job.final)
    ckpt.set_latest(job.final.parent.parent, job.step)
    if job.keep_last:
        ckpt.purge(job.final.parent.parent, job.keep_last)
    job.stats.total_bytes = sum(f["bytes"] for f in files.values()) + (job.final / sf.MANIFEST).stat().st_size
