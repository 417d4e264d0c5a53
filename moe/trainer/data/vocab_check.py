"""Every token id of indexed datasets checked against a model's vocabulary before training starts.

A dataset prepared with another tokenizer holds ids the model's embedding cannot look up; found mid-training, it
costs the steps before it (and a resume dies at the same place). `check_token_ids` scans each `.bin` once, vectorised
over its memory map in fixed-size chunks (memory stays bounded whatever the file's size), with a progress bar when
the scan lasts over a second, and names the first bad id's file, document and position. A clean verdict is cached
under the files' identity (paths, sizes, modification times) and the vocabulary size, so the next run of the same
data does not rescan.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moe.trainer.data.indexed import IndexedDataset, bin_path, idx_path
from moe.trainer.io.atomic import write_json

CHUNK_TOKENS = 1 << 22  # tokens per vectorised step: 16 MiB of int32
PROGRESS_AFTER_S = 1.0


def _identity(prefix: str, vocab_size: int) -> str:
    """What a verdict depends on: both files' resolved paths, sizes and modification times, and `vocab_size`."""
    parts = [str(vocab_size)]
    for path in (bin_path(prefix), idx_path(prefix)):
        stat = path.stat()
        parts += [str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _first_bad(tokens: np.ndarray, vocab_size: int) -> int | None:
    """Index of the first id of `tokens` outside `[0, vocab_size)`, or None."""
    low_possible = np.issubdtype(tokens.dtype, np.signedinteger)
    if int(tokens.max()) < vocab_size and (not low_possible or int(tokens.min()) >= 0):
        return None
    bad = tokens >= vocab_size
    if low_possible:
        bad |= tokens < 0
    return int(np.argmax(bad))


class _Progress:
    """A tqdm bar over the bytes to scan, shown only once the scan has lasted `PROGRESS_AFTER_S`."""

    def __init__(self, total_bytes: int) -> None:
        self.total, self.done, self.started, self.bar = total_bytes, 0, time.monotonic(), None

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        if self.bar is None and time.monotonic() - self.started > PROGRESS_AFTER_S:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # tqdm is optional: no bar
                self.started = float("inf")
                return
            self.bar = tqdm(total=self.total, initial=self.done, unit="B", unit_scale=True, desc="check token ids",
                            dynamic_ncols=True)  # fmt: skip
        elif self.bar is not None:
            self.bar.update(num_bytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_token_ids(prefixes: Sequence[str | os.PathLike], vocab_size: int, cache_dir: str | os.PathLike | None,
                    *, chunk_tokens: int = CHUNK_TOKENS) -> list[str]:  # fmt: skip
    """Checks that every id of the indexed datasets `prefixes` lies in `[0, vocab_size)`.

    ValueError naming the `.bin`, the document, the position in it and the id of the first one outside. A clean
    verdict is recorded in `cache_dir/token-id-checks/` (None: not cached) under the files' identity: a dataset
    checked before is not read again. Returns the prefixes this call scanned (not the cached ones).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    verdicts = None if cache_dir is None else Path(cache_dir) / "token-id-checks"
    todo = []
    for prefix in dict.fromkeys(os.fspath(p) for p in prefixes):
        key = _identity(prefix, vocab_size)
        if verdicts is None or not (verdicts / f"{key}.json").is_file():
            todo.append((prefix, key))
    datasets = [(prefix, key, IndexedDataset(prefix)) for prefix, key in todo]
    progress = _Progress(sum(d.tokens.nbytes for _, _, d in datasets))
    try:
        for prefix, key, dataset in datasets:
            tokens = dataset.tokens
            if not (np.issubdtype(tokens.dtype, np.unsignedinteger) and np.iinfo(tokens.dtype).max < vocab_size):
                for lo in range(0, tokens.size, chunk_tokens):
                    chunk = tokens[lo : lo + chunk_tokens]
                    bad = _first_bad(chunk, vocab_size)
                    if bad is not None:
                        raise ValueError(_bad_id_message(dataset, lo + bad, int(chunk[bad]), vocab_size))
                    progress.advance(chunk.nbytes)
            if verdicts is not None:
                _record(verdicts / f"{key}.json", prefix, vocab_size, int(tokens.size))
    finally:
        progress.close()
    return [prefix for prefix, _ in todo]


def _bad_id_message(dataset: IndexedDataset, position: int, token: int, vocab_size: int) -> str:
    document = int(np.searchsorted(dataset.document_offsets, position, side="right")) - 1
    within = position - int(dataset.document_offsets[document])
    return (
        f"{dataset.bin_path}: document {document}, position {within} (token {position} of the file) holds id "
        f"{token}, outside the model's vocabulary [0, {vocab_size}) (was it prepared with another tokenizer?)"
    )


def _record(path: Path, prefix: str, vocab_size: int, num_tokens: int) -> None:
    """Writes a clean verdict atomically (ranks of one host writing the same verdict at once are harmless)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"prefix": prefix, "vocab_size": vocab_size, "num_tokens": num_tokens})
