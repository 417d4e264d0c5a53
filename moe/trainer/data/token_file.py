"""Training data: a text corpus present on every machine, a tokenizer trained on it, a memory-mapped token file
built once and reused, and the global batches in an order that depends only on the seed.

- Corpus: this Python's standard library sources (`*.py` under `sysconfig`'s stdlib directory, without test
  suites and site-packages), or the `*.py` files of a given directory; files sorted by relative path, documents
  separated by an end-of-text token.
- Tokenizer: byte-level BPE trained with Hugging Face `tokenizers` to the model's vocabulary size ("bpe"), or
  plain bytes ("bytes": the byte-level alphabet and no merges).
- Cache: `<cache_dir>/<key>/{tokenizer.json, tokens.npy, meta.json}`, the key a hash of the corpus contents and
  the tokenizer settings. One process builds it in a temporary directory and renames it into place (atomic);
  the others wait for it with a deadline.
- Batches: the token stream is cut into non-overlapping windows of `seq_len` tokens; the last `val_sequences`
  windows are held out; epoch `e` visits the training windows in the order `permutation(seed, e)`. Global batch
  `s` (1-based) takes the next `global_batch` windows; data-parallel rank `r` of `dp` takes rows
  `[r * global_batch / dp, (r + 1) * global_batch / dp)`. Every layout trains on the same tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from moe.trainer.data import tokenizer as data_tokenizer
from moe.trainer.data.source import rank_rows
from moe.trainer.io.atomic import fsync_path
from moe.trainer.models.deepseek_v3.model_tokens import END_OF_TEXT

if TYPE_CHECKING:  # annotations only: the config tree sits above the data
    from moe.trainer.train.training_config import DataConfig

EOS = END_OF_TEXT  # generation finds it by this name in a checkpoint's tokenizer.json
FORMAT_VERSION = 1
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_BYTE_ALPHABET = 256


def default_cache_dir() -> Path:
    env = os.environ.get("MTDEEPEP_DATA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mtdeepep" / "data"


def corpus_root(cfg: DataConfig) -> Path:
    """The corpus directory; ValueError if it does not exist."""
    root = Path(sysconfig.get_paths()["stdlib"]) if cfg.corpus == "python-stdlib" else Path(cfg.corpus)
    if not root.is_dir():
        raise ValueError(f"corpus {cfg.corpus!r}: directory {root} does not exist")
    return root


def corpus_files(cfg: DataConfig) -> list[Path]:
    """The corpus's `*.py` files sorted by relative path (test suites, site-packages and caches left out), cut at
    `max_bytes`; ValueError if there are none."""
    root = corpus_root(cfg)
    found = sorted(
        (p for p in root.rglob("*.py") if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not found:
        raise ValueError(f"corpus {cfg.corpus!r}: no *.py files under {root}")
    if cfg.max_bytes is None:
        return found
    files, total = [], 0
    for p in found:
        if total >= cfg.max_bytes:
            break
        files.append(p)
        total += p.stat().st_size
    return files


def _read_corpus(cfg: DataConfig) -> tuple[list[str], str]:
    """The documents' texts and a fingerprint of the corpus (relative paths and content hashes)."""
    root = corpus_root(cfg)
    digest = hashlib.sha256()
    texts = []
    for p in corpus_files(cfg):
        raw = p.read_bytes()
        digest.update(p.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(raw).digest())
        texts.append(raw.decode("utf-8", errors="replace"))
    return texts, digest.hexdigest()


def _cache_key(cfg: DataConfig, vocab_size: int, corpus_digest: str) -> str:
    import tokenizers

    settings = {
        "format": FORMAT_VERSION,
        "corpus": corpus_digest,
        "tokenizer": cfg.tokenizer,
        "vocab_size": vocab_size,
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]


def train_tokenizer(texts: list[str], vocab_size: int, kind: str):
    """A byte-level `tokenizers.Tokenizer` with the end-of-text token as id 0: BPE merges up to `vocab_size`
    ("bpe"), or none ("bytes"). Every id is below `vocab_size`. (moe/trainer/data/tokenizer.py's trainer, unwrapped.)"""
    return data_tokenizer.train_tokenizer(texts, vocab_size, kind).tokenizer


@dataclass
class TokenData:
    """A built cache entry: `tokens` is a read-only memory map `[N]` (uint16 below 65536 ids, else int32)."""

    directory: Path
    tokens: np.ndarray
    eos_id: int
    meta: dict

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / "tokenizer.json"


def prepare_tokens(cfg: DataConfig, vocab_size: int, *, build: bool = True, timeout_s: float = 900.0) -> TokenData:
    """The tokenizer and token file of this corpus and vocabulary, from the cache.

    build: this process builds a missing entry (one process per host: the others pass False and wait for it up to
        `timeout_s`, raising TimeoutError after).
    Raises ValueError for a missing or empty corpus, before anything else.
    """
    texts, corpus_digest = _read_corpus(cfg)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    entry = cache / _cache_key(cfg, vocab_size, corpus_digest)
    if not (entry / "meta.json").is_file():
        if build:
            _build_entry(entry, texts, cfg, vocab_size, corpus_digest)
        else:
            _wait_for(entry / "meta.json", timeout_s)
    return load_tokens(entry)


def load_tokens(entry: Path) -> TokenData:
    meta = json.loads((entry / "meta.json").read_text())
    tokens = np.load(entry / "tokens.npy", mmap_mode="r")
    return TokenData(entry, tokens, int(meta["eos_id"]), meta)


def _build_entry(entry: Path, texts: list[str], cfg: DataConfig, vocab_size: int, corpus_digest: str) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        start = time.perf_counter()
        tok = train_tokenizer(texts, vocab_size, cfg.tokenizer)
        eos_id = tok.token_to_id(EOS)
        dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
        encoded = tok.encode_batch(texts)
        lengths = [len(e.ids) + 1 for e in encoded]
        tokens = np.empty(sum(lengths), dtype=dtype)
        pos = 0
        for e, n in zip(encoded, lengths):
            tokens[pos : pos + n - 1] = e.ids
            tokens[pos + n - 1] = eos_id
            pos += n
        tok.save(str(tmp / "tokenizer.json"))
        np.save(tmp / "tokens.npy", tokens)
        meta = {
            "format": FORMAT_VERSION,
            "corpus": cfg.corpus,
            "corpus_sha256": corpus_digest,
            "num_files": len(texts),
            "num_chars": sum(len(t) for t in texts),
            "num_tokens": int(tokens.size),
            "dtype": np.dtype(dtype).name,
            "tokenizer": cfg.tokenizer,
            "vocab_size": vocab_size,
            "tokenizer_vocab": tok.get_vocab_size(),
            "eos_id": eos_id,
            "build_s": round(time.perf_counter() - start, 2),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        for name in ("tokenizer.json", "tokens.npy", "meta.json"):
            fsync_path(tmp / name)
        try:
            os.rename(tmp, entry)  # atomic: readers see the whole entry or none
        except OSError:
            if not (entry / "meta.json").is_file():  # not a concurrent builder's finished entry
                raise
        fsync_path(entry.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f} s for {path.parent} (the token cache that local rank 0 builds); did it fail?"
            )
        time.sleep(0.5)


class TokenBatches:
    """Global batches of `[global_batch, seq_len]` windows of a token stream, in an order fixed by `seed`.

    Args:
        tokens: `[N]` integer token stream (e.g. `TokenData.tokens`, a memory map).
        seq_len: S, tokens per sequence (the model sees S inputs and predicts S - 1 next tokens).
        global_batch: sequences per optimizer step.
        val_sequences: windows held out at the end of the stream.
        seed: the order of the training windows (a new permutation per epoch).
        eod_id: the end-of-text id that ends every document (None: unknown).
        fingerprint: what identifies the token stream (e.g. the cache entry's key), saved with checkpoints; a resume
            on another stream is refused (None: not recorded).
    A `DataSource` (moe/trainer/data/source.py).
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, val_sequences: int, seed: int,
                 eod_id: int | None = None, fingerprint: str | None = None) -> None:  # fmt: skip
        self.tokens = tokens
        self.eod_id = eod_id
        self.fingerprint = fingerprint
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        num_windows = tokens.shape[0] // seq_len
        self.num_val = val_sequences
        self.num_train = num_windows - val_sequences
        if self.num_train < global_batch:
            raise ValueError(
                f"the corpus has {num_windows} windows of {seq_len} tokens ({val_sequences} held out): fewer than one "
                f"global batch of {global_batch}; use a larger corpus or a smaller batch"
            )

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one instance per run; the permutations of recent epochs)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_train)

    def windows(self, step: int) -> np.ndarray:
        """Window indices `[global_batch] int64` of optimizer step `step` (1-based)."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        k = np.arange((step - 1) * self.global_batch, step * self.global_batch)
        epochs, within = k // self.num_train, k % self.num_train
        return np.array([self._order(int(e))[j] for e, j in zip(epochs, within)], dtype=np.int64)

    def _rows(self, windows: np.ndarray) -> torch.Tensor:
        S = self.seq_len
        rows = np.stack([np.asarray(self.tokens[w * S : (w + 1) * S]) for w in windows])
        return torch.from_numpy(rows.astype(np.int64))

    def global_batch_tokens(self, step: int) -> torch.Tensor:
        """`[global_batch, seq_len] int64` tokens of step `step`."""
        return self._rows(self.windows(step))

    def local_batch(self, step: int, dp_rank: int, dp: int) -> torch.Tensor:
        """`[global_batch / dp, seq_len] int64`: data-parallel rank `dp_rank`'s rows of step `step`."""
        return self._rows(self.windows(step)[rank_rows(self.global_batch, dp_rank, dp)])

    def val_tokens(self) -> torch.Tensor:
        """`[val_sequences, seq_len] int64`: the held-out windows (never in a training batch)."""
        return self._rows(np.arange(self.num_train, self.num_train + self.num_val))

    def identity(self) -> dict:
        """The token stream's fingerprint, when known (see `DataSource.identity`)."""
        return {} if self.fingerprint is None else {"source": "corpus", "fingerprint": self.fingerprint}
