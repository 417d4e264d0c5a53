"""Files of a sharded (flash) checkpoint: safetensors written as a stream with their SHA-256, the manifest, and the
reader that takes any rank's boxes of a tensor from the files that hold them.

The file format only (no training logic): model code reads checkpoints through it (`read_full_section`) without
importing the trainer. A checkpoint directory (see moe/trainer/train/checkpoint/writer.py for how it is written):
```
step_N/
  manifest.json              written last: the format, the step, the layout, every file with its sha256 and size,
                             and for every tensor its global shape, dtype and stored boxes (file, name, offsets)
  trainer_state.json         step, seed, data position, LR schedule, optimizer step count, layout
  config.json                the model's config (a model directory's config.json)
  tokenizer.json             files copied into every checkpoint
  model.safetensors          the last checkpoint of a run only: the whole model, a model directory with config.json
  rank_00000/
    model.safetensors        this rank's boxes of the model's tensors (its experts, its TP shard, its stages)
    optimizer.safetensors    its boxes of the optimizer state (exp_avg, exp_avg_sq, FP32 masters; ZeRO-1 shards)
    state.safetensors        rank-local tensors: generator states, FP8 delayed-scaling amax histories
    index.json               what the rank wrote (files, boxes, rank-local JSON state); the rank's "done" marker
  rank_00001/ ...
```
Tensors are safetensors (read with `safetensors.safe_open`, no pickle); everything else is JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe.trainer.io.atomic import FileRecord
from moe.trainer.io.boxes import Box, Placement, pieces

FORMAT = "mtdeepep.flash_checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
SECTIONS = ("model", "optimizer")  # sharded sections (resharded on load); rank-local state is per rank
SECTION_FILES = {"model": "model.safetensors", "optimizer": "optimizer.safetensors", "rank_state": "state.safetensors"}
RANK_INDEX = "index.json"
_CHUNK = 16 << 20

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint")
    return dtype


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> FileRecord:
    """Write `tensors` (CPU) as a safetensors file at `path`, streamed from the tensors' memory (no serialised copy
    of the whole file) and hashed on the way: to `path.tmp`, flushed and fsynced, then renamed to `path`.

    progress: called after every chunk with `(bytes written, total bytes)` (the fault-injection hook of the tests).
    Returns the file's sha256 and size.
    """
    header: dict[str, Any] = {}
    offset = 0
    flat = []
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name}: write_safetensors takes CPU tensors, got {t.device}")
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + raw.numel()],
        }
        offset += raw.numel()
        flat.append(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    total = 8 + len(head) + offset
    digest = hashlib.sha256()
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    with open(tmp, "wb") as f:

        def put(data) -> None:
            nonlocal written
            f.write(data)
            digest.update(data)
            written += len(data)
            if progress is not None:
                progress(written, total)

        put(struct.pack("<Q", len(head)) + head)
        for raw in flat:
            view = memoryview(raw.numpy()).cast("B")
            for start in range(0, len(view), _CHUNK):
                put(view[start : start + _CHUNK])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return FileRecord(digest.hexdigest(), total)


def sha256_file(path: Path) -> FileRecord:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileRecord(digest.hexdigest(), size)


# -- the manifest


def read_manifest(path: Path) -> dict[str, Any]:
    with open(Path(path) / MANIFEST) as f:
        return json.load(f)


def check_checkpoint(path: Path, *, verify_checksums: bool = False, verify_state: bool = False) -> str | None:
    """None when `path` is a complete flash checkpoint: its manifest is readable, of this format, of the step its
    name says, and every file it lists exists with the listed size (and, with `verify_checksums`, the listed
    sha256; with `verify_state`, the sha256 of the trainer state alone: cheap, and what a reader of the step must
    verify before it trusts it). Otherwise the reason it is not."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    if not (path / MANIFEST).is_file():
        return f"no {MANIFEST} (the checkpoint was not finished)"
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        return f"{MANIFEST} is not {FORMAT} version {FORMAT_VERSION}"
    if path.name.startswith("step_") and path.name != f"step_{manifest.get('step')}":
        return f"{MANIFEST} is of step {manifest.get('step')}"
    files = manifest.get("files", {})
    if TRAINER_STATE not in files:
        return f"{MANIFEST} lists no {TRAINER_STATE}"
    for rel, record in files.items():
        file = path / rel
        if not file.is_file():
            return f"{rel} is missing"
        size = file.stat().st_size
        if size != record["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {record['bytes']} (truncated or rewritten)"
        verify = verify_checksums or (verify_state and rel == TRAINER_STATE)
        if verify and sha256_file(file).sha256 != record["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (corrupted)"
    return None


# -- reading


@dataclass(frozen=True)
class _Stored:
    file: str
    name: str
    box: Box


class CheckpointReader:
    """Reads a complete checkpoint's tensors in any layout (use as a context manager: the files stay open, memory
    mapped, until it exits).

    `read_into(section, key, placement, dest)` fills `dest` (this rank's tensor of `key` at `placement`: the local
    tensor, or its 1-D flat data under ZeRO-1) from the stored boxes that intersect it, reading only those.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        reason = check_checkpoint(self.path)
        if reason is not None:
            raise ValueError(f"{self.path} is not a complete checkpoint: {reason}")
        self.manifest = read_manifest(self.path)
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}
        self._index: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype, list[_Stored]]]] = {}
        for section in SECTIONS:
            table = {}
            for key, info in self.manifest["tensors"].get(section, {}).items():
                stored = [_Stored(p["file"], p["name"], Box.from_json(p)) for p in info["pieces"]]
                table[key] = (tuple(info["shape"]), dtype_from_name(info["dtype"]), stored)
            self._index[section] = table

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    @property
    def world(self) -> int:
        return int(self.manifest["world"])

    def _file(self, rel: str):
        if rel not in self._open:
            from safetensors import safe_open

            self._open[rel] = self._stack.enter_context(safe_open(str(self.path / rel), framework="pt"))
        return self._open[rel]

    def keys(self, section: str) -> list[str]:
        return list(self._index[section])

    def shape_and_dtype(self, section: str, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype, _ = self._entry(section, key)
        return shape, dtype

    def _entry(self, section: str, key: str):
        try:
            return self._index[section][key]
        except KeyError:
            raise ValueError(f"{self.path}: the checkpoint has no {section} tensor {key!r}") from None

    def _read_box(self, stored: _Stored, box: Box) -> torch.Tensor:
        f = self._file(stored.file)
        if not box.shape:
            return f.get_tensor(stored.name)
        return f.get_slice(stored.name)[box.within(stored.box)]

    @torch.no_grad()
    def read_into(self, section: str, key: str, placement: Placement, dest: torch.Tensor) -> None:
        """Fill `dest` with this rank's part of tensor `key` (ValueError if the checkpoint lacks any of it or holds
        another shape). `dest`: the local tensor (`placement.local_shape`), or the 1-D flat data when
        `placement.flat` is set; contiguous; cast to its dtype."""
        shape, _, stored = self._entry(section, key)
        if shape != tuple(placement.global_shape):
            raise ValueError(
                f"{section} tensor {key}: the checkpoint holds shape {shape}, this model "
                f"{tuple(placement.global_shape)}"
            )
        if not dest.is_contiguous() or dest.numel() != placement.numel:
            raise ValueError(f"{key}: the destination must be contiguous with {placement.numel} elements")
        flat, lo = dest.view(-1), placement.flat_range[0]
        for piece in pieces(placement):
            need = piece.global_box
            target = piece.view(flat, lo)
            covered = 0
            for s in stored:
                common = need.intersect(s.box)
                if common is None or common.numel == 0:
                    continue
                target[common.within(need)].copy_(self._read_box(s, common))
                covered += common.numel
            if covered != need.numel:
                raise ValueError(f"{section} tensor {key}: the checkpoint holds {covered} of the {need.numel} elements "
                                 f"of {need}")  # fmt: skip

    def read_full(self, section: str, key: str) -> torch.Tensor:
        """The whole tensor `key` in its stored dtype."""
        shape, dtype, _ = self._entry(section, key)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(section, key, Placement(shape, shape), out)
        return out

    def rank_index(self, rank: int) -> dict[str, Any]:
        """What rank `rank` of the saving layout recorded (`index.json`): its rank-local JSON state among it."""
        with open(self.path / rank_dir_name(rank) / RANK_INDEX) as f:
            return json.load(f)

    def rank_tensor(self, rank: int, name: str) -> torch.Tensor | None:
        """A rank-local tensor (generator state, amax history) of rank `rank`, None if it saved none by that name."""
        rel = f"{rank_dir_name(rank)}/{SECTION_FILES['rank_state']}"
        f = self._file(rel)
        return f.get_tensor(name) if name in f.keys() else None  # noqa: SIM118 (safe_open has no __contains__)


def read_full_section(path: str | Path, section: str = "model") -> dict[str, torch.Tensor]:
    """Every tensor of a section, whole (e.g. the model's full state dict: what a model directory holds)."""
    with CheckpointReader(path) as reader:
        return {key: reader.read_full(section, key) for key in reader.keys(section)}
