"""Model directories (the CKPT_DIR format): `model.safetensors` (a full state dict, our key names, see model.py)
and `config.json` (transformers' config.json content plus our extensions under `"mtdeepep"`).

Writes are atomic (`moe.trainer.io.atomic.atomic_directory`): everything goes into a private temporary directory beside
the target (mode 0700, files 0600), each file and the directory are fsynced, then the directory is renamed into place
and the parent fsynced. A reader sees the whole directory or none. The trainer may add its own files in the same
step (`write_extra`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe.trainer.io.atomic import atomic_directory, write_json
from moe.trainer.io.shard_files import MANIFEST, read_full_section
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "mtdeepep.deepseek_v3"
FORMAT_VERSION = 1


def main_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype of the embedding (the training dtype); float32 if absent."""
    weight = state_dict.get("embed_tokens.weight")
    return weight.dtype if weight is not None else torch.float32


def config_json(config: DeepseekV3Config, dtype: torch.dtype, eos_token_id: int | None = None) -> dict:
    """config.json content of a model directory (with transformers' `eos_token_id` when given)."""
    out = config.to_hf_dict(dtype=str(dtype).removeprefix("torch."))
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    out["mtdeepep"] = {"format": FORMAT, "format_version": FORMAT_VERSION, **config.extensions()}
    return out


def write_model_dir(
    path: str | Path,
    state_dict: dict[str, torch.Tensor],
    config: DeepseekV3Config,
    *,
    write_extra: Callable[[Path], None] | None = None,
    overwrite: bool = False,
    eos_token_id: int | None = None,
) -> Path:
    """Write `state_dict` (a `full_state_dict`, tensors in their dtype) and `config` as a model directory.

    Args:
        write_extra: called with the temporary directory before it is published, to add other files (e.g. the
            trainer's optimizer state) in the same atomic step.
        overwrite: replace an existing directory (otherwise FileExistsError).
        eos_token_id: the end-of-text id, written to config.json (generation stops there; tokenizer.py reads it).
    """
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, config_json(config, main_dtype(tensors), eos_token_id), indent=2)
        if write_extra is not None:
            write_extra(tmp)

    return atomic_directory(path, fill, overwrite=overwrite)


def read_config(path: str | Path) -> DeepseekV3Config:
    """The `DeepseekV3Config` of a model directory (our extensions included)."""
    source = Path(path) / CONFIG_FILE
    with open(source) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc})") from None
    return DeepseekV3Config.from_dict(doc, source=str(source))


def check_model_dir(path: str | Path) -> None:
    """ValueError unless `path` is a directory `read_model_dir` reads: `config.json` and either `model.safetensors`
    or a sharded checkpoint's manifest (cheap: no tensor is read)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path} is not a model directory or checkpoint: no {CONFIG_FILE}")
    if not (path / MODEL_FILE).is_file() and not (path / MANIFEST).is_file():
        raise ValueError(f"{path} is not a model directory or checkpoint: neither {MODEL_FILE} nor {MANIFEST}")


def read_model_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], DeepseekV3Config]:
    """`(state_dict, config)` of a model directory written by `write_model_dir` (tensors on the CPU, in their
    stored dtype), or of a training checkpoint without `model.safetensors` (a sharded flash checkpoint: the model's
    boxes of every rank assembled, moe/trainer/io/shard_files.py)."""
    path = Path(path)
    if not (path / MODEL_FILE).is_file() and (path / MANIFEST).is_file() and (path / CONFIG_FILE).is_file():
        return read_full_section(path, "model"), read_config(path)
    for name in (MODEL_FILE, CONFIG_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a model directory: {name} is missing")
    return load_file(str(path / MODEL_FILE)), read_config(path)
