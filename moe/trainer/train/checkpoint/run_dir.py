"""The checkpoints of a run directory: names, the `latest` pointer, which checkpoints are complete, and which one a
resumed run takes.

Layout of a run directory:
```
RUN_DIR/checkpoints/step_N/                   one complete checkpoint (moe/trainer/io/shard_files.py: manifest.json,
...) RUN_DIR/checkpoints/latest                    text file: the name of the newest committed checkpoint ("step_N")
RUN_DIR/checkpoints/.step_N.partial-SESSION/  a checkpoint being written (or left by a crash)
```
A checkpoint is complete when its `manifest.json` (written last, before the directory is renamed into place) lists
files that all exist with their sizes (and, verified, their sha256). A directory that fails this is skipped with a
warning, whatever `latest` says: a resumed run takes the newest complete checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from moe.trainer.io import shard_files as sf
from moe.trainer.io.atomic import fsync_path, write_bytes

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = sf.TRAINER_STATE
_STEP_RE = re.compile(r"^step_(\d+)$")
_PARTIAL_RE = re.compile(r"^\.step_\d+\.(partial|old)-")


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def remove_partials(run_dir: str | Path) -> list[Path]:
    """Remove the hidden directories that unfinished checkpoints left (call when none is being written); returns
    them."""
    root = checkpoints_dir(run_dir)
    stale = [p for p in root.iterdir() if p.is_dir() and _PARTIAL_RE.match(p.name)] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def set_latest(run_dir: str | Path, step: int) -> None:
    """Point `latest` at `step_N` (which must exist)."""
    root = checkpoints_dir(run_dir)
    if not (root / checkpoint_name(step)).is_dir():
        raise FileNotFoundError(f"no checkpoint {root / checkpoint_name(step)}")
    write_bytes(root / LATEST, (checkpoint_name(step) + "\n").encode())
    fsync_path(root)


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


def _step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoints_dir(run_dir)
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def purge(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints (0: keep all; `latest` always points to the
    newest); returns the removed directories. Incomplete `step_N` directories are left for inspection."""
    complete = list_checkpoints(run_dir)
    old = [p for _, p in complete[:-keep_last]] if keep_last > 0 else []
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete `step_N` directories of a run, by step."""
    return [(s, p) for s, p in _step_dirs(run_dir) if is_complete(p)]


def is_complete(path: Path, *, verify_checksums: bool = False) -> bool:
    return sf.check_checkpoint(Path(path), verify_checksums=verify_checksums) is None


def find_resumable(run_dir: str | Path, *, verify_checksums: bool = False, verify_state: bool = False,
                   warn: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:  # fmt: skip
    """The newest complete checkpoint of a run (None: none) and the newer ones skipped, with the reason each is not
    complete (`verify_checksums`: every file's sha256 verified; `verify_state`: the trainer state's). `warn`: print a
    warning line per skipped checkpoint to stderr."""
    skipped = []
    for _, path in reversed(_step_dirs(run_dir)):
        reason = sf.check_checkpoint(path, verify_checksums=verify_checksums, verify_state=verify_state)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
        if warn:
            print(f"warning: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
    return None, skipped


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of a complete checkpoint, verified before it is trusted: its sha256 against the manifest's,
    and its step against the manifest's (ValueError naming the checkpoint otherwise)."""
    path = Path(path)
    reason = sf.check_checkpoint(path, verify_state=True)
    if reason is not None:
        raise ValueError(f"{path} is not a complete trainer checkpoint: {reason}")
    state = json.loads((path / TRAINER_STATE).read_text())
    if state.get("step") != sf.read_manifest(path).get("step"):
        raise ValueError(f"{path}: {TRAINER_STATE} is of step {state.get('step')}, its manifest of another")
    return state


def no_resumable_reason(run_dir: str | Path, skipped: list[tuple[Path, str]]) -> str:
    """Why a run directory has no checkpoint to continue from: none at all, or each one's reason to be refused."""
    if not skipped:
        return f"{run_dir} has no checkpoint to continue from"
    reasons = "; ".join(f"{path.name}: {reason}" for path, reason in skipped)
    return f"{run_dir} has no checkpoint to continue from (every checkpoint was refused: {reasons})"
