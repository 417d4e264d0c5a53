"""Model directories (the CKPT_DIR format): `model.safetensors` (a full state dict, our key names, see model.py)
and `config.json` (transformers' config.json content plus our extensions under `"mtdeepep"`).

Writes are atomic: everything goes into a private temporary directory beside the target (mode 0700, files 0600),
each file and the directory are fsynced, then the directory is renamed into place and the parent fsynced. A reader
sees the whole directory or none. The trainer may add its own files in the same step (`write_extra`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe.models.deepseek_v3.config import DeepseekV3Config
from moe.train.shard_files import read_full_section

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "mtdeepep.deepseek_v3"
FORMAT_VERSION = 1


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def main_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype of the embedding (the training dtype); float32 if absent."""
    weight = state_dict.get("embed_tokens.weight")
    return weight.dtype if weight is not None else torch.float32


def config_json(config: DeepseekV3Config, dtype: torch.dtype) -> dict:
    """config.json content of a model directory."""
    out = config.to_hf_dict(dtype=str(dtype).removeprefix("torch."))
    out["mtdeepep"] = {"format": FORMAT, "format_version": FORMAT_VERSION, **config.extensions()}
    return out


def atomic_directory(path: str | Path, fill: Callable[[Path], None], *, overwrite: bool = False) -> Path:
    """Create directory `path` atomically: `fill(tmp_dir)` writes the files, then the rename publishes them.

    An existing `path` is an error (FileExistsError) unless `overwrite`, which swaps the new directory in (a reader
    sees the old or the new one, or briefly none; never a mix) and removes the old one.
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
                _fsync_path(child)
        _fsync_path(tmp)
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=parent))
            os.rename(path, old / "dir")
        os.rename(tmp, path)
        _fsync_path(parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def write_model_dir(
    path: str | Path,
    state_dict: dict[str, torch.Tensor],
    config: DeepseekV3Config,
    *,
    write_extra: Callable[[Path], None] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `state_dict` (a `full_state_dict`, tensors in their dtype) and `config` as a model directory.

    Args:
        write_extra: called with the temporary directory before it is published, to add other files (e.g. the
            trainer's optimizer state) in the same atomic step.
        overwrite: replace an existing directory (otherwise FileExistsError).
    """
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        text = json.dumps(config_json(config, main_dtype(tensors)), indent=2, sort_keys=True) + "\n"
        _write_private(tmp / CONFIG_FILE, text.encode())
        if write_extra is not None:
            write_extra(tmp)

    return atomic_directory(path, fill, overwrite=overwrite)


def read_config(path: str | Path) -> DeepseekV3Config:
    """The `DeepseekV3Config` of a model directory (our extensions included)."""
    with open(Path(path) / CONFIG_FILE) as f:
        return DeepseekV3Config.from_dict(json.load(f), source=str(Path(path) / CONFIG_FILE))


def read_model_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], DeepseekV3Config]:
    """`(state_dict, config)` of a model directory written by `write_model_dir` (tensors on the CPU, in their
    stored dtype), or of a training checkpoint without `model.safetensors` (a sharded flash checkpoint: the model's
    boxes of every rank assembled, moe/train/shard_files.py)."""
    path = Path(path)
    if not (path / MODEL_FILE).is_file() and (path / "manifest.json").is_file() and (path / CONFIG_FILE).is_file():
        return read_full_section(path, "model"), read_config(path)
    for name in (MODEL_FILE, CONFIG_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a model directory: {name} is missing")
    return load_file(str(path / MODEL_FILE)), read_config(path)
