"""`BlendedBatches`: the trainer's global batches over indexed datasets (Megatron's `--data-path`, or a corpus
tokenized into shards), a `DataSource` (moe/trainer/data/source.py).

Global batch `s` (1-based) is samples `[(s - 1) G, s G)` of `moe.trainer.data.blend.BlendedWindows` (G = global_batch):
Megatron's greedy blend over the datasets, each dataset's windows in a seeded permutation per epoch, documents
packed across boundaries. Data-parallel rank `r` of `dp` takes rows `[r G / dp, (r + 1) G / dp)` and reads only
those from the memory maps. Sample `i` does not depend on the number of steps, the layout or the rank, so every
layout trains on the same tokens and a resume at step `s` continues the uninterrupted order mid-epoch.

Validation: the held-out documents of every dataset (whole documents, never windows cut out of one), at most
`val_sequences` of their windows spread evenly.

`identity()`: a sha256 over the normalised weights, each dataset's `.idx` (its documents' lengths: a changed,
added or removed document changes it) and `.bin` size, and the window settings, with the prefixes and weights
spelled out. A checkpoint saves it; a resume on other data, or with other weights, is refused.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Any

import numpy as np
import torch

from moe.trainer.data.blend import BlendedWindows
from moe.trainer.data.indexed import bin_path, idx_path
from moe.trainer.data.source import rank_rows
from moe.trainer.io.shard_files import sha256_file


class BlendedBatches:
    """Global batches `[global_batch, seq_len] int64` from a blend of indexed datasets.

    Args:
        windows: the blend's samples (`BlendedWindows`, built for at least `steps x global_batch` samples).
        global_batch: sequences per optimizer step.
        val_sequences: at most this many held-out windows in `val_tokens()`.
        eod_id: the end-of-text id ending the documents (the tokenizer's), or None.
        vocab_size: the model's vocabulary; a batch holding an id outside `[0, vocab_size)` raises ValueError
            naming the dataset (checked on every batch: the files are not scanned up front).
    """

    def __init__(self, windows: BlendedWindows, *, global_batch: int, val_sequences: int, eod_id: int | None,
                 vocab_size: int | None = None) -> None:  # fmt: skip
        self.blend = windows
        self.seq_len = windows.seq_len
        self.global_batch = int(global_batch)
        self.val_sequences = int(val_sequences)
        self.eod_id = eod_id
        self.vocab_size = vocab_size
        self.num_train = sum(s.num_windows for s in windows.train)
        if windows.num_samples < global_batch:
            raise ValueError(f"{windows.num_samples} samples are fewer than one global batch of {global_batch}")

    @property
    def num_samples(self) -> int:
        return self.blend.num_samples

    def samples(self, step: int) -> np.ndarray:
        """Global sample indices `[global_batch] int64` of optimizer step `step` (1-based)."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        if step * self.global_batch > self.num_samples:
            raise ValueError(
                f"step {step} needs samples up to {step * self.global_batch}, the blend was built for "
                f"{self.num_samples} (steps x global_batch)"
            )
        return np.arange((step - 1) * self.global_batch, step * self.global_batch, dtype=np.int64)

    def _rows(self, samples: np.ndarray) -> torch.Tensor:
        rows = self.blend.windows(samples)
        if self.vocab_size is not None and rows.size and (rows.min() < 0 or rows.max() >= self.vocab_size):
            bad = [int(i) for i, row in zip(samples, rows) if row.min() < 0 or row.max() >= self.vocab_size][0]
            d, w = self.blend.source(bad)
            raise ValueError(
                f"{self.blend.entries[d].prefix}: window {w} holds ids outside the model's vocabulary "
                f"[0, {self.vocab_size}) (was it prepared with another tokenizer?)"
            )
        return torch.from_numpy(rows)

    def global_batch_tokens(self, step: int) -> torch.Tensor:
        """`[global_batch, seq_len] int64` tokens of step `step`."""
        return self._rows(self.samples(step))

    def local_batch(self, step: int, dp_rank: int, dp: int) -> torch.Tensor:
        """`[global_batch / dp, seq_len] int64`: data-parallel rank `dp_rank`'s rows of step `step` (only those
        are read)."""
        return self._rows(self.samples(step)[rank_rows(self.global_batch, dp_rank, dp)])

    def val_tokens(self) -> torch.Tensor:
        """`[V, seq_len] int64`, V <= val_sequences: windows of the held-out documents, spread evenly over them
        (dataset after dataset)."""
        streams = [(s, w) for s in self.blend.validation for w in range(s.num_windows)]
        k = min(self.val_sequences, len(streams))
        if k == 0:
            return torch.zeros((0, self.seq_len), dtype=torch.int64)
        pick = (np.arange(k) * 2 + 1) * len(streams) // (2 * k)
        return torch.from_numpy(np.stack([streams[i][0].window(streams[i][1]) for i in pick]))

    @cached_property
    def _fingerprint(self) -> str:
        b = self.blend
        datasets = [
            {"idx_sha256": sha256_file(idx_path(e.prefix)).sha256, "bin_bytes": bin_path(e.prefix).stat().st_size}
            for e in b.entries
        ]
        doc = {
            "weights": [float(w) for w in b.weights],
            "datasets": datasets,
            "seq_len": b.seq_len,
            "held_out": [int(h.size) for h in b.held_out_documents],
            "eod_appended": b.eod_id,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def identity(self) -> dict[str, Any]:
        """The data's fingerprint and, for the message of a refused resume, the prefixes and weights."""
        return {
            "source": "indexed",
            "fingerprint": self._fingerprint,
            "prefixes": [e.prefix for e in self.blend.entries],
            "weights": [round(float(w), 12) for w in self.blend.weights],
        }

    def summary(self) -> list[dict]:
        """Per dataset: prefix, weight, documents, held-out documents, windows and the epochs the run takes."""
        return self.blend.summary()
