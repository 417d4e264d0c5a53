"""A run's data from its `[data]` table: the `DataSource` the trainer reads, the tokenizer saved with the
run, and what run.json records. Everything is checked here, before any process group exists.

Three paths (`DataConfig` has the keys):
- built-in: python-stdlib or a directory of `*.py` files, tokenizer "bpe" / "bytes": the token file of
  moe/trainer/data/token_file.py and its window hold-out, unchanged (scripts/train.sh's losses stay bit-identical).
- corpus: any other corpus (`.txt .md .py .jsonl .jsonl.gz .parquet`, a directory, a glob or a file) or a tokenizer
  given as a path: tokenized once by local rank 0 into indexed shards in the cache (moe/trainer/data/tokenize.py, in
  parallel worker processes; a bad record fails naming its file and line), the other ranks waiting for them; read
  as a blend of the shards (weighted by size) with whole documents held out.
- data_path: Megatron-prepared indexed datasets blended by weight (moe/trainer/data/blend.py); `tokenizer` names the one
  that prepared them.
The last two go through `BlendedBatches` (moe/trainer/data/blended_batches.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe.trainer.data.blend import BlendedWindows, parse_data_path
from moe.trainer.data.blended_batches import BlendedBatches
from moe.trainer.data.corpus import Corpus
from moe.trainer.data.indexed import best_dtype
from moe.trainer.data.source import DataSource
from moe.trainer.data.token_file import TokenBatches, default_cache_dir, prepare_tokens
from moe.trainer.data.tokenize import DEFAULT_SHARD_TOKENS, cache_key, load_tokenized, tokenize_corpus
from moe.trainer.data.tokenizer import load_tokenizer, resolve_tokenizer, tokenizer_key
from moe.trainer.data.vocab_check import check_token_ids

if TYPE_CHECKING:  # annotations only: the config tree sits above the data
    from moe.trainer.train.training_config import DataConfig, TrainingConfig

WAIT_S = 3600.0  # how long the other ranks of a host wait for local rank 0's tokenization


@dataclass
class RunData:
    """batches: the trainer's data. tokenizer_files: the tokenizer's files (tokenizer.json, and
    tokenizer_config.json when its end-of-text token is not the default), copied into the run directory and every
    checkpoint. eos_id: the end-of-text id. meta: run.json's "data". summary: one line for --prepare-data."""

    batches: DataSource
    tokenizer_files: tuple[Path, ...]
    eos_id: int | None
    meta: dict[str, Any]
    summary: str

    @property
    def tokenizer_path(self) -> Path:
        return self.tokenizer_files[0]


def prepare_run_data(data: DataConfig, cfg: TrainingConfig, vocab_size: int, *, seed: int, build: bool,
                     prepare_only: bool = False) -> RunData:  # fmt: skip
    """The data of a run of `data` ([data]) and `cfg` ([training]: batch, sequence length, steps) for a model of
    `vocab_size` ids, seeded `seed`. `build`: this process builds
    what is missing from the cache (local rank 0; the others wait). `prepare_only`: build the cache, skip the
    batches. ValueError (naming the file, the line or the key) for anything that does not fit."""
    if data.builtin:
        tokens = prepare_tokens(data, vocab_size, build=build)
        batches = TokenBatches(tokens.tokens, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                               val_sequences=data.val_sequences, seed=seed, eod_id=tokens.eos_id,
                               fingerprint=tokens.directory.name)  # fmt: skip
        summary = f"{tokens.directory} ({tokens.meta['num_tokens']} tokens, {tokens.meta['num_files']} files)"
        return RunData(batches, (tokens.tokenizer_path,), tokens.eos_id, tokens.meta, summary)
    cache = Path(data.cache_dir) if data.cache_dir else default_cache_dir()
    if data.data_path is not None:
        tokenizer_dir = _saved_tokenizer(data.tokenizer, vocab_size, cache)
        prefixes, meta = list(data.data_path), {"data_path": list(data.data_path)}
    else:
        tokenized = _tokenized_corpus(data, vocab_size, cache, build=build)
        tokenizer_dir = tokenized.directory
        prefixes = [str(p) for p in tokenized.prefixes]
        meta = {k: v for k, v in tokenized.manifest.items() if k != "shards"}
        meta["directory"] = str(tokenized.directory)
    tok = load_tokenizer(tokenizer_dir)
    files = tuple(p for p in (tokenizer_dir / "tokenizer.json", tokenizer_dir / "tokenizer_config.json") if p.is_file())
    meta.update(tokenizer=data.tokenizer, eos_token=tok.eos_token, eos_id=tok.eos_id)
    if prepare_only:
        return RunData(None, files, tok.eos_id, meta, f"{tokenizer_dir} ({meta.get('num_tokens', '?')} tokens)")
    batches = _blended_batches(data, cfg, prefixes, seed, tok.eos_id, vocab_size)  # the blend's files checked first
    # Every id of every dataset against the vocabulary, before any process group exists (cached once clean).
    check_token_ids([e.prefix for e in parse_data_path(prefixes)], vocab_size, cache)
    meta["datasets"] = batches.summary()
    tokens = sum(d["train_windows"] for d in meta["datasets"]) * cfg.seq_len
    summary = f"{len(prefixes)} indexed datasets, {tokens} training tokens in windows of {cfg.seq_len}"
    return RunData(batches, files, tok.eos_id, meta, summary)


def _blended_batches(data: DataConfig, cfg: TrainingConfig, prefixes: list, seed: int, eos_id: int, vocab_size: int):
    windows = BlendedWindows(prefixes, seq_len=cfg.seq_len, num_samples=cfg.steps * cfg.global_batch, seed=seed,
                             held_out=data.held_out_documents)  # fmt: skip
    return BlendedBatches(windows, global_batch=cfg.global_batch, val_sequences=data.val_sequences, eod_id=eos_id,
                          vocab_size=vocab_size)  # fmt: skip


def _saved_tokenizer(spec: str, vocab_size: int, cache: Path) -> Path:
    """A directory holding the tokenizer `spec` ("bytes" or a path) as `tokenizer.json` (+ its config), checked
    against `vocab_size`: what the run saves. Written into the cache under the tokenizer's fingerprint (atomic
    files: ranks writing the same bytes at once are harmless)."""
    tok = resolve_tokenizer(spec, vocab_size)
    directory = cache / "tokenizers" / tok.fingerprint()[:20]
    if not (directory / "tokenizer.json").is_file():
        tok.save(directory)
    return directory


def _tokenized_corpus(data, vocab_size: int, cache: Path, *, build: bool):
    """The corpus's indexed shards in the cache (tokenized by this process when `build`, else waited for)."""
    corpus = Corpus(data.corpus, text_field=data.text_field, max_bytes=data.max_bytes)
    key = cache_key(corpus.fingerprint(), tokenizer_key(data.tokenizer, vocab_size, max_bytes=data.max_bytes),
                    dtype=best_dtype(vocab_size).name, shard_tokens=DEFAULT_SHARD_TOKENS)  # fmt: skip
    directory = cache / f"indexed-{key}"
    if (directory / "manifest.json").is_file():
        return load_tokenized(directory)
    if not build:
        deadline = time.monotonic() + WAIT_S
        while not (directory / "manifest.json").is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {WAIT_S:.0f} s for {directory} (local rank 0 tokenizes it); did it fail?")
            time.sleep(0.5)
        return load_tokenized(directory)
    tok = resolve_tokenizer(data.tokenizer, vocab_size, texts=corpus.texts())
    cores = len(os.sched_getaffinity(0))
    workers = min(8, cores - 1) if cores > 2 else 0  # worker processes only where there are cores to spare
    try:
        return tokenize_corpus(corpus, tok, directory, workers=workers, dtype=best_dtype(vocab_size),
                               shard_tokens=DEFAULT_SHARD_TOKENS)  # fmt: skip
    except FileExistsError:  # another process on this host published it first: the same files
        return load_tokenized(directory)
