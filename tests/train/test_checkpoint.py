"""Atomic checkpoint directories and the `latest` pointer: an interrupted save leaves nothing a reader takes for a
whole checkpoint."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from moe.train import checkpoint as ckpt
from mtdeepep.utils.testing import run_processes


def _save(run_dir: Path, step: int, payload: bytes, die_after_bytes: int | None = None) -> None:
    """A checkpoint of two files and the trainer state; with `die_after_bytes` the process SIGKILLs itself in the
    middle of the second file."""
    with ckpt.atomic_directory(ckpt.checkpoints_dir(run_dir) / ckpt.checkpoint_name(step)) as tmp:
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(payload)
        with open(tmp / "optimizer.safetensors", "wb") as f:
            if die_after_bytes is not None:
                f.write(payload[:die_after_bytes])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(payload)
        ckpt.write_json(tmp / ckpt.TRAINER_STATE, {"step": step})
    ckpt.set_latest(run_dir, step)


def _crashing_save(proc, run_dir: str) -> None:
    _save(Path(run_dir), 2, b"x" * 100_000, die_after_bytes=50_000)


def test_complete_save_and_latest(tmp_path):
    _save(tmp_path, 1, b"a" * 10)
    _save(tmp_path, 3, b"b" * 10)
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_3"
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 3]
    assert ckpt.read_trainer_state(tmp_path / "checkpoints" / "step_3") == {"step": 3}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1", "step_3"]


def test_no_checkpoint_yet(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None and ckpt.list_checkpoints(tmp_path) == []


def test_exception_during_save_leaves_nothing(tmp_path):
    _save(tmp_path, 1, b"a")
    final = ckpt.checkpoints_dir(tmp_path) / "step_2"
    with pytest.raises(RuntimeError, match="disk full"), ckpt.atomic_directory(final) as tmp:
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]


def test_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 1, b"a" * 10)
    result = run_processes(_crashing_save, 1, (str(tmp_path),), timeout_s=60)
    assert result.exitcodes == [-signal.SIGKILL]
    root = tmp_path / "checkpoints"
    leftovers = [p for p in root.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").is_file()  # the crash really was mid-write
    assert not (root / "step_2").exists()
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_1"
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    # The next save removes the leftover.
    assert ckpt.remove_stale_temporaries(tmp_path) == leftovers
    _save(tmp_path, 2, b"c" * 10)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 1, b"old")
    _save(tmp_path, 1, b"new")
    assert (tmp_path / "checkpoints" / "step_1" / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]


def test_bad_pointer_is_reported(tmp_path):
    _save(tmp_path, 1, b"a")
    (tmp_path / "checkpoints" / "latest").write_text("step_9\n")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("../../etc\n")
    with pytest.raises(ValueError, match="not a checkpoint name"):
        ckpt.latest_checkpoint(tmp_path)
