"""Checkpoint directories written atomically, and the `latest` pointer.

Layout of a run directory:
```
RUN_DIR/checkpoints/step_N/      one checkpoint (what --init, evaluate.py and hf.py export take)
RUN_DIR/checkpoints/latest       text file: the name of the newest complete checkpoint ("step_N")
```
A checkpoint is written into a hidden temporary directory (`.step_N.tmp-PID`) next to its final place; every file
and the directory are flushed to disk, then it is renamed to `step_N` (an atomic rename: a reader sees the whole
directory or none), and only then is `latest` replaced (written to a temporary file, flushed, renamed over the old
pointer). A crash at any point leaves the previous checkpoint and pointer intact and, at worst, a hidden
temporary directory that the next save removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under `root` (and `root`), children before parents."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yields a fresh temporary directory next to `final`; when the block ends without an exception it is flushed
    and renamed to `final` (a `final` that exists already is replaced); on an exception it is removed.

    The temporary directory does not exist when the block starts (only its parent does), so writers that create
    their target themselves can be given it; the block creates it (`mkdir`) or lets a writer do so.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if not tmp.is_dir():
            raise RuntimeError(f"nothing was written to {tmp}")
        fsync_tree(tmp)
        old = None
        if final.exists():  # a re-save of the same step: move the old one aside, then swap
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path`'s content with `text` atomically (temporary file, fsync, rename, fsync of the directory)."""
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove the hidden temporary directories that interrupted saves left; returns them."""
    root = checkpoints_dir(run_dir)
    stale = [p for p in root.glob(".step_*.*-*") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def set_latest(run_dir: str | Path, step: int) -> None:
    """Point `latest` at `step_N` (which must exist)."""
    root = checkpoints_dir(run_dir)
    if not (root / checkpoint_name(step)).is_dir():
        raise FileNotFoundError(f"no checkpoint {root / checkpoint_name(step)}")
    write_text_atomic(root / LATEST, checkpoint_name(step) + "\n")


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint `latest` points to, or None when the run has none. Raises ValueError when the pointer names
    something that is not a complete checkpoint."""
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not _STEP_RE.match(name):
        raise ValueError(f"{pointer} holds {name!r}, not a checkpoint name")
    path = root / name
    if not is_complete(path):
        raise ValueError(f"{pointer} points to {path}, which is not a complete checkpoint")
    return path


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete `step_N` directories of a run, by step (temporary directories are hidden and skipped)."""
    root = checkpoints_dir(run_dir)
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_RE.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def is_complete(path: Path) -> bool:
    """A trainer checkpoint directory with its trainer state (written last, inside the atomic directory)."""
    return path.is_dir() and (path / TRAINER_STATE).is_file()


def read_trainer_state(path: Path) -> dict[str, Any]:
    if not is_complete(path):
        raise ValueError(f"{path} is not a complete trainer checkpoint (no {TRAINER_STATE})")
    return json.loads((path / TRAINER_STATE).read_text())
