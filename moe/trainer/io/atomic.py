"""Atomic writes: a reader sees a file or a directory whole, or not at all, also after a crash.

The one way files and directories are published in this project (training checkpoints, their `latest` pointer,
model directories, Hugging Face exports):
- `write_bytes` / `write_json`: a file is written under a temporary name beside it, flushed and fsynced, then
  renamed over the target (`os.replace` is atomic within a file system).
- `publish_directory`: a finished directory is renamed into place (replacing an existing one: moved aside first,
  removed after, so a reader sees the old or the new one, or briefly none; never a mix) and the parent is fsynced.
- `atomic_directory`: a private temporary directory is filled, every file fsynced, then `publish_directory`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FileRecord:
    """A written file's sha256 (hex) and size in bytes (what a checkpoint manifest lists)."""

    sha256: str
    bytes: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "bytes": self.bytes}


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's data and metadata to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> FileRecord:
    """Write `data` at `path` atomically (temporary name, fsync, rename); returns its sha256 and size. `mode`: the
    file's permission bits (default: as the umask leaves them)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)
    return FileRecord(hashlib.sha256(data).hexdigest(), len(data))


def json_bytes(obj: Any, *, indent: int = 1) -> bytes:
    """The project's JSON text of `obj`: sorted keys, indented, one trailing newline."""
    return (json.dumps(obj, indent=indent, sort_keys=True) + "\n").encode()


def write_json(path: Path, obj: Any, *, indent: int = 1) -> FileRecord:
    """Write `obj` as JSON (`json_bytes`) at `path` atomically; returns its sha256 and size."""
    return write_bytes(path, json_bytes(obj, indent=indent))


def publish_directory(partial: Path, final: Path) -> None:
    """Rename the finished directory `partial` to `final` (atomic), replacing a `final` that exists (moved aside to
    a hidden `.NAME.old-*` directory first, removed after), and flush the parent directory."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, old / "dir")
    os.rename(partial, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_directory(path: str | Path, fill: Callable[[Path], None], *, overwrite: bool = False) -> Path:
    """Create directory `path` atomically: `fill(tmp_dir)` writes the files into a private temporary directory
    beside it (mode 0700, files made 0600 and fsynced), then `publish_directory` puts it in place.

    An existing `path` is an error (FileExistsError) unless `overwrite`, which swaps the new directory in.
    """
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=parent))  # mode 0700
    try:
        fill(tmp)
        for child in tmp.rglob("*"):
            if child.is_file():
                os.chmod(child, 0o600)
                fsync_path(child)
        fsync_path(tmp)
        publish_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
