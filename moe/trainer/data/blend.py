"""Megatron's `--data-path` blend of indexed datasets as windows of `seq_len` tokens in a seeded order.

The blend list is Megatron's (`megatron/core/datasets/utils.py`, `get_blend_from_list`): `[w1, prefix1, w2,
prefix2, ...]`, or prefixes alone (one prefix, an odd-length list, or an even-length list whose weight positions
are not numbers). Weights must be finite and >= 0 with a positive sum; they are normalised to sum to 1. Prefixes
without weights are weighted by their training windows, so the blend visits every dataset in proportion to its
size (Megatron's exhaustive blend does the same with whole datasets).

Windows follow the trainer's convention (`moe/trainer/data/token_file.py`, `TokenBatches`), not Megatron's GPTDataset
sampling: each dataset's documents, in file order, form one token stream; `eod_id`, when given, is appended after
every document (for data preprocessed without `--append-eod`; data written with it already ends its documents in
the end-of-text id); the stream is cut into non-overlapping windows of `seq_len` tokens and the tail shorter than
a window is dropped. So one prefix holding the documents of a `tokens.npy` gives exactly that file's windows, and,
with nothing held out, in the same order for the same seed.

The order:
- Which dataset each global sample comes from is Megatron's greedy blend (`megatron/core/datasets/helpers.cpp`,
  `build_blending_indices`): sample `n` goes to the dataset whose weight x max(n, 1) exceeds the samples it already
  has by the most (the first on a tie), and is that dataset's next sample. This depends on the weights only.
- Sample `k` of dataset `d` is window `permutation(d, epoch)[k mod W_d]` with `epoch = k // W_d` (W_d training
  windows): a fresh permutation per epoch from `numpy.random.default_rng([seed, epoch])` for dataset 0 (the
  trainer's own key) and `[seed, epoch, d]` for the others.

The order is a function of (seed, data_path, seq_len, held_out, eod_id) alone: never of ranks or of how many
samples are asked for (sample `i` is the same for any `num_samples > i`), so every parallel layout reads the same
windows.

Held out: `held_out` documents of every dataset (a count, or a fraction of its documents), spread evenly over the
file (document `floor((j + 1/2) D / k)` for j < k), never enter the training windows; their own stream, cut the
same way, is the validation data. The choice does not depend on the seed, so runs of different seeds validate on
the same documents.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from moe.trainer.data.indexed import IndexedDataset, bin_path, idx_path


@dataclass(frozen=True)
class BlendEntry:
    """One dataset of a blend: its prefix and its weight as written (None: weighted by size)."""

    prefix: str
    weight: float | None


def _as_weight(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def parse_data_path(data_path: Sequence[str | float | int | os.PathLike]) -> list[BlendEntry]:
    """Megatron's `--data-path` list as entries: `[w1, p1, w2, p2, ...]` or `[p1, p2, ...]`.

    Raises ValueError, naming the entry, for an empty list, a list that mixes numbers and prefixes at the weight
    positions, and weights that are not finite or are negative. (The sum and the files are checked by
    `BlendedWindows`.)
    """
    if isinstance(data_path, (str, os.PathLike)):
        data_path = [data_path]
    items = list(data_path)
    if not items:
        raise ValueError("data_path is empty: give a prefix, or weights and prefixes [w1, prefix1, w2, prefix2, ...]")
    pairs = len(items) % 2 == 0
    weights = [_as_weight(items[i]) for i in range(0, len(items), 2)] if pairs else []
    if pairs and all(w is not None for w in weights):
        entries = [BlendEntry(os.fspath(items[i + 1]).strip(), weights[i // 2]) for i in range(0, len(items), 2)]
        for i, entry in enumerate(entries):
            if not math.isfinite(entry.weight) or entry.weight < 0:
                raise ValueError(
                    f"data_path entry {2 * i} (weight {items[2 * i]!r} of {entry.prefix!r}): weights must be finite "
                    "and >= 0"
                )
        return entries
    if pairs and any(w is not None for w in weights):
        i = 2 * next(j for j, w in enumerate(weights) if w is None)
        raise ValueError(
            f"data_path entry {i} ({items[i]!r}): expected a weight there, as in [w1, prefix1, w2, prefix2, ...] "
            "(or give prefixes only)"
        )
    return [BlendEntry(os.fspath(item).strip(), None) for item in items]


def blending_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: `(dataset [N] int16, sample within it [N] int64)` for normalised `weights [K]`.

    Sample n goes to argmax_d(weights[d] * max(n, 1) - taken[d]) (the first on a tie), in float64 as Megatron's
    `build_blending_indices` computes it, so the two agree sample for sample. A Python loop: about 1 s per million
    samples for 3 datasets on one CPU core.
    """
    weights = np.asarray(weights, dtype=np.float64)
    dataset = np.zeros(num_samples, dtype=np.int16)
    within = np.zeros(num_samples, dtype=np.int64)
    # Datasets of weight 0 take no part: Megatron requires weights > 0, and its rule would hand a zero-weight
    # dataset a sample on a tie at error 0 (e.g. weights [0, 1] at n = 1).
    active = np.flatnonzero(weights > 0)
    if active.size == 1:
        dataset[:] = active[0]
        within[:] = np.arange(num_samples)
        return dataset, within
    w = weights[active].tolist()  # plain floats: this loop is the hot part, and the same IEEE doubles as the C++
    ids = active.tolist()
    taken = [0] * len(w)
    for n in range(num_samples):
        x = max(float(n), 1.0)
        best, best_error = 0, w[0] * x - taken[0]
        for d in range(1, len(w)):
            error = w[d] * x - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset[n] = ids[best]
        within[n] = taken[best]
        taken[best] += 1
    return dataset, within


def held_out_documents(num_documents: int, held_out: int | float) -> np.ndarray:
    """The `[k] int64` documents held out of `num_documents`: `held_out` an int count, or a float fraction in
    [0, 1) (rounded, at least one document when positive); spread evenly: `floor((j + 1/2) D / k)`."""
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float, np.integer, np.floating)):
        raise ValueError(f"held_out must be a document count (int) or a fraction (float), got {held_out!r}")
    if isinstance(held_out, (float, np.floating)):
        if not 0.0 <= held_out < 1.0:
            raise ValueError(f"held_out fraction must be in [0, 1), got {held_out}")
        k = max(1, round(held_out * num_documents)) if held_out > 0 else 0
    else:
        if held_out < 0:
            raise ValueError(f"held_out must be >= 0 documents, got {held_out}")
        k = int(held_out)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if k > num_documents:
        raise ValueError(f"held_out={held_out} asks for {k} of {num_documents} documents")
    return ((np.arange(k, dtype=np.int64) * 2 + 1) * num_documents) // (2 * k)


class TokenStream:
    """Some documents of an indexed dataset back to back (with `eod_id` after each, when given), cut into windows.

    Args:
        dataset: the indexed dataset.
        documents: `[n] int64` document ids in increasing order.
        eod_id: end-of-text id appended after each document, or None (the documents as stored).
        seq_len: S, tokens per window.
    """

    def __init__(self, dataset: IndexedDataset, documents: np.ndarray, eod_id: int | None, seq_len: int) -> None:
        self.dataset, self.eod_id, self.seq_len = dataset, eod_id, seq_len
        offsets = dataset.document_offsets
        starts, lengths = offsets[documents], offsets[documents + 1] - offsets[documents]
        if eod_id is None and documents.size:
            # Without separators, documents adjacent in the file are one run: a handful of pieces, not one per
            # document.
            new_run = np.ones(documents.size, dtype=bool)
            new_run[1:] = np.diff(documents) != 1
            run_starts = np.flatnonzero(new_run)
            starts, lengths = starts[run_starts], np.add.reduceat(lengths, run_starts)
        self._bin_start = starts.astype(np.int64)
        self._length = lengths.astype(np.int64)
        extra = 0 if eod_id is None else 1
        self._stream_start = np.concatenate([[0], np.cumsum(self._length + extra)]).astype(np.int64)
        self.num_tokens = int(self._stream_start[-1])
        self.num_windows = self.num_tokens // seq_len

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens `[start, start + count)` of the stream as `[count] int64`."""
        if start < 0 or start + count > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) of a stream of {self.num_tokens}")
        out = np.empty(count, dtype=np.int64)
        piece = int(np.searchsorted(self._stream_start, start, side="right")) - 1
        filled = 0
        tokens = self.dataset.tokens
        while filled < count:
            offset = start + filled - int(self._stream_start[piece])
            length = int(self._length[piece])
            if offset < length:
                take = min(length - offset, count - filled)
                begin = int(self._bin_start[piece]) + offset
                out[filled : filled + take] = tokens[begin : begin + take]
                filled += take
            if filled < count and self.eod_id is not None:
                out[filled] = self.eod_id  # the position just past the document
                filled += 1
            piece += 1
        return out

    def window(self, w: int) -> np.ndarray:
        """Window `w`: `[seq_len] int64`."""
        if not 0 <= w < self.num_windows:
            raise IndexError(f"window {w} of {self.num_windows}")
        return self.read(w * self.seq_len, self.seq_len)


class BlendedWindows:
    """Global samples of `seq_len` tokens from a `--data-path` blend, in an order fixed by the seed (see the
    module docstring for the format, the windows and the order).

    Args:
        data_path: Megatron's blend list `[w1, prefix1, w2, prefix2, ...]` or prefixes alone.
        seq_len: S, tokens per window.
        num_samples: N, the global samples needed (e.g. steps x global batch); sample `i < N` is the same for any N.
        seed: the windows' order (>= 0).
        held_out: documents per dataset kept for validation: a count (int) or a fraction (float in [0, 1)).
        eod_id: end-of-text id appended after every document, or None (documents as stored).

    Raises ValueError before reading any window: a bad blend list (the entry named), a weight sum that is not
    positive, a missing `.idx` / `.bin` (the entry and the file named), a corrupt file (the file named), a dataset
    with weight > 0 but no full training window, an `eod_id` the token dtype cannot have held.
    """

    def __init__(
        self,
        data_path: Sequence[str | float | int | os.PathLike],
        *,
        seq_len: int,
        num_samples: int,
        seed: int,
        held_out: int | float = 0,
        eod_id: int | None = None,
    ) -> None:
        checks = [("seq_len", seq_len, 1), ("num_samples", num_samples, 1), ("seed", seed, 0)]
        if eod_id is not None:
            checks.append(("eod_id", eod_id, 0))
        for name, value, low in checks:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.entries = parse_data_path(data_path)
        if len(self.entries) > np.iinfo(np.int16).max:  # the dataset index is int16, as Megatron's
            raise ValueError(f"data_path names {len(self.entries)} datasets; at most {np.iinfo(np.int16).max}")
        self.seq_len, self.num_samples, self.seed, self.eod_id = int(seq_len), int(num_samples), int(seed), eod_id
        self.datasets: list[IndexedDataset] = []
        self.train: list[TokenStream] = []
        self.validation: list[TokenStream] = []
        self.held_out_documents: list[np.ndarray] = []
        for i, entry in enumerate(self.entries):
            position = 2 * i + 1 if entry.weight is not None else i
            for path in (idx_path(entry.prefix), bin_path(entry.prefix)):
                if not path.is_file():
                    hint = ""
                    if _as_weight(entry.prefix) is not None:
                        hint = " (a weight without its prefix? weights and prefixes come in pairs)"
                    elif entry.prefix.endswith((".bin", ".idx")):
                        hint = " (give the prefix, without .bin / .idx)"
                    raise ValueError(f"data_path entry {position} ({entry.prefix!r}): {path} does not exist{hint}")
            dataset = IndexedDataset(entry.prefix)
            if (
                dataset.num_documents == 0
            ):  # an empty output of a preprocessing run, usually: refused whatever its weight
                raise ValueError(
                    f"data_path entry {position} ({entry.prefix!r}): the dataset has no documents "
                    f"({idx_path(entry.prefix)} indexes none)"
                )
            info = np.iinfo(dataset.dtype)
            if eod_id is not None and not info.min <= eod_id <= info.max:
                raise ValueError(f"eod_id={eod_id} does not fit {entry.prefix}'s token dtype {dataset.dtype.name}")
            try:
                held = held_out_documents(dataset.num_documents, held_out)
            except ValueError as e:
                raise ValueError(f"data_path entry {position} ({entry.prefix!r}): {e}") from None
            keep = np.setdiff1d(np.arange(dataset.num_documents, dtype=np.int64), held, assume_unique=True)
            self.datasets.append(dataset)
            self.held_out_documents.append(held)
            self.train.append(TokenStream(dataset, keep, eod_id, self.seq_len))
            self.validation.append(TokenStream(dataset, held, eod_id, self.seq_len))
        self.weights = self._normalised_weights()
        for i, (entry, weight, stream) in enumerate(zip(self.entries, self.weights, self.train)):
            if weight > 0 and stream.num_windows == 0:
                raise ValueError(
                    f"data_path entry {2 * i + 1 if entry.weight is not None else i} ({entry.prefix!r}): "
                    f"{stream.num_tokens} training tokens, less than one window of {self.seq_len}"
                )
        self.dataset_index, self.dataset_sample = blending_indices(self.weights, self.num_samples)

    def _normalised_weights(self) -> np.ndarray:
        if self.entries[0].weight is None:  # prefixes alone: by size
            raw = np.array([s.num_windows for s in self.train], dtype=np.float64)
            if raw.sum() <= 0:
                raise ValueError(
                    f"data_path {[e.prefix for e in self.entries]}: no dataset holds one training window of "
                    f"{self.seq_len} tokens"
                )
        else:
            raw = np.array([e.weight for e in self.entries], dtype=np.float64)
            total = raw.sum()
            if not (math.isfinite(total) and total > 0):
                raise ValueError(f"data_path weights {raw.tolist()} sum to {total}: the sum must be positive")
        return raw / raw.sum()  # Megatron's normalisation (utils.py, normalize)

    def __len__(self) -> int:
        """N, the global samples."""
        return self.num_samples

    @lru_cache(maxsize=8)  # noqa: B019 (one instance per run; the permutations of the current epochs)
    def _order(self, d: int, epoch: int) -> np.ndarray:
        key = [self.seed, epoch] if d == 0 else [self.seed, epoch, d]  # dataset 0: TokenBatches's key
        return np.random.default_rng(key).permutation(self.train[d].num_windows)

    def source(self, i: int) -> tuple[int, int]:
        """Global sample `i`'s (dataset, training window of that dataset)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        d, k = int(self.dataset_index[i]), int(self.dataset_sample[i])
        windows = self.train[d].num_windows
        return d, int(self._order(d, k // windows)[k % windows])

    def window(self, i: int) -> np.ndarray:
        """Global sample `i`: `[seq_len] int64` tokens."""
        d, w = self.source(i)
        return self.train[d].window(w)

    def windows(self, samples) -> np.ndarray:
        """Global samples `samples` (`[B]` indices): `[B, seq_len] int64`."""
        return (
            np.stack([self.window(int(i)) for i in samples]) if len(samples) else np.zeros((0, self.seq_len), np.int64)
        )

    @property
    def num_validation_windows(self) -> int:
        return sum(s.num_windows for s in self.validation)

    def validation_windows(self) -> np.ndarray:
        """The held-out documents' windows, dataset after dataset: `[V, seq_len] int64` (V may be 0)."""
        rows = [s.window(w) for s in self.validation for w in range(s.num_windows)]
        return np.stack(rows) if rows else np.zeros((0, self.seq_len), np.int64)

    def summary(self) -> list[dict]:
        """Per dataset: prefix, normalised weight, documents, held-out documents, training windows, and the epochs
        of it that the N samples take."""
        taken = np.bincount(self.dataset_index, minlength=len(self.entries))
        return [
            {
                "prefix": e.prefix,
                "weight": float(w),
                "documents": ds.num_documents,
                "held_out_documents": int(held.size),
                "train_windows": s.num_windows,
                "validation_windows": v.num_windows,
                "epochs": float(taken[d] / s.num_windows) if s.num_windows else 0.0,
            }
            for d, (e, w, ds, held, s, v) in enumerate(
                zip(self.entries, self.weights, self.datasets, self.held_out_documents, self.train, self.validation)
            )
        ]
