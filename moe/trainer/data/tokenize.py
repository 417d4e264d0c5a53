"""Tokenize a corpus into Megatron indexed datasets, in parallel worker processes, streamed to disk.

Pipeline: the parent reads the corpus in chunks of raw records (`Corpus.chunks`, about `chunk_bytes` each); a pool
of `workers` processes (spawned: no forked tokenizer threads) decodes and checks each chunk (`decode_chunk`) and
encodes its documents (`TextTokenizer.encode_documents`); the parent writes the results in input order, whatever
order the workers finish in, so the files depend only on the corpus, the tokenizer and `shard_tokens`, never on
`workers`. At most `2 * workers` chunks are in flight (submitted, not yet written): memory is bounded by a few chunks
and their tokens, whatever the corpus's size.

Output, published atomically as one directory (`moe.trainer.io.atomic.atomic_directory`: a reader sees all of it or
none):
- `shard_NNNNN.bin` / `.idx`: indexed datasets (`moe.trainer.data.indexed`), each document's ids then the end-of-text
  id, one sequence per document; a new shard starts after the document that brings a shard to `shard_tokens` tokens.
- `tokenizer.json` (+ `tokenizer_config.json` for a non-default end-of-text token): the tokenizer that made them.
- `manifest.json`: the shards with their document and token counts, dtype, end-of-text id and token, the corpus
  and tokenizer fingerprints.
A bad input anywhere (`CorpusError`, naming the file and line) aborts the build: no directory appears.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe.trainer.data.corpus import DEFAULT_CHUNK_BYTES, Chunk, Corpus, decode_chunk
from moe.trainer.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from moe.trainer.data.tokenizer import TextTokenizer
from moe.trainer.io.atomic import atomic_directory, write_json

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard: files that copy and map comfortably


@dataclass
class TokenizedCorpus:
    """A built token directory: `manifest` as written, `prefixes` the shards' paths without `.bin` / `.idx`."""

    directory: Path
    manifest: dict

    @property
    def prefixes(self) -> list[Path]:
        return [self.directory / shard["prefix"] for shard in self.manifest["shards"]]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    def datasets(self) -> list[IndexedDataset]:
        """Each shard's `IndexedDataset` (memory-mapped, checked when opened)."""
        return [IndexedDataset(p) for p in self.prefixes]


def load_tokenized(directory: str | os.PathLike) -> TokenizedCorpus:
    """The token directory `tokenize_corpus` built; FileNotFoundError without a manifest."""
    directory = Path(directory)
    with open(directory / MANIFEST) as f:
        return TokenizedCorpus(directory, json.load(f))


def cache_key(corpus_fingerprint: str, tokenizer_key: str, **settings) -> str:
    """A short stable key (hex) of a token directory: the corpus's `Corpus.fingerprint()`, the tokenizer's
    (`tokenizer_key` or `TextTokenizer.fingerprint()`), the settings that change the files (dtype, shard_tokens)
    and this module's format version."""
    doc = {"format": FORMAT_VERSION, "corpus": corpus_fingerprint, "tokenizer": tokenizer_key, **settings}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:20]


# One tokenizer per worker process, set by the pool's initializer (a spawned worker has nothing else to keep).
_worker: dict = {}


def _init_worker(tokenizer: TextTokenizer, dtype: str, text_field: str) -> None:
    # The pool is the parallelism: a worker's tokenizer stays on one thread so `workers` processes use `workers`
    # cores (tokenizers reads this variable at every batch).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=tokenizer, dtype=np.dtype(dtype), text_field=text_field)


def _encode_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    texts = decode_chunk(chunk, _worker["text_field"])
    return _worker["tokenizer"].encode_documents(texts, _worker["dtype"])


def _encoded(
    corpus: Corpus, tokenizer: TextTokenizer, dtype: np.dtype, workers: int, chunk_bytes: int
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """(tokens, lengths, disk bytes) per chunk, in corpus order; `workers` 0 encodes in this process."""
    if workers == 0:  # this process's tokenizer settings (its threads) stay as the caller has them
        _worker.update(tokenizer=tokenizer, dtype=dtype, text_field=corpus.text_field)
        try:
            for chunk in corpus.chunks(chunk_bytes):
                yield (*_encode_chunk(chunk), chunk.disk_bytes)
        finally:
            _worker.clear()
        return
    # A process pool (not multiprocessing.Pool): a worker that dies (killed for memory...) raises
    # BrokenProcessPool here instead of leaving its task's result waited for forever.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer, dtype.name, corpus.text_field),
    )
    try:
        pending: deque = deque()
        for chunk in corpus.chunks(chunk_bytes):
            pending.append((pool.submit(_encode_chunk, chunk), chunk.disk_bytes))
            del chunk  # the worker has its copy; keep the parent's memory to the chunks in flight
            if len(pending) >= 2 * workers:
                future, disk = pending.popleft()
                yield (*future.result(), disk)
        while pending:
            future, disk = pending.popleft()
            yield (*future.result(), disk)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _progress_bar(total: int, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", dynamic_ncols=True)


def tokenize_corpus(
    corpus: Corpus,
    tokenizer: TextTokenizer,
    out_dir: str | os.PathLike,
    *,
    workers: int = 2,
    dtype: np.dtype | type | str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool | None = None,
    overwrite: bool = False,
) -> TokenizedCorpus:
    """Tokenize `corpus` with `tokenizer` into the directory `out_dir` (module docstring) and return it.

    Args:
        workers: tokenizing processes (0: in this process).
        dtype: token dtype of the shards (default `best_dtype(tokenizer.vocab_size)`: uint16 below 65500 ids).
        chunk_bytes: raw bytes per task sent to a worker.
        shard_tokens: tokens after which a shard is closed (at a document's end).
        progress: a tqdm bar over the corpus's bytes (None: when stderr is a terminal).
        overwrite: replace an existing `out_dir` (else FileExistsError).
    Raises CorpusError (ValueError) for bad input, naming the file and line; nothing is published then.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an int >= 0, got {workers!r}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    dtype = best_dtype(tokenizer.vocab_size) if dtype is None else np.dtype(dtype)
    start = time.perf_counter()
    shards: list[dict] = []

    def fill(tmp: Path) -> None:
        bar = _progress_bar(corpus.total_bytes, progress)
        writer, docs, tokens = None, 0, 0
        try:
            for chunk_tokens, lengths, disk_bytes in _encoded(corpus, tokenizer, dtype, workers, chunk_bytes):
                ends = np.cumsum(lengths)
                for begin, end in zip((ends - lengths).tolist(), ends.tolist()):
                    if writer is None:
                        prefix = f"shard_{len(shards):05d}"
                        writer = IndexedDatasetWriter(tmp / prefix, dtype)
                        shards.append({"prefix": prefix})
                    writer.add_document(chunk_tokens[begin:end])
                    docs, tokens = docs + 1, tokens + end - begin
                    if tokens >= shard_tokens:
                        writer.close()
                        shards[-1].update(documents=docs, tokens=tokens)
                        writer, docs, tokens = None, 0, 0
                if bar is not None:
                    bar.update(disk_bytes)
            if writer is not None:
                writer.close()
                shards[-1].update(documents=docs, tokens=tokens)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            if bar is not None:
                bar.close()
        tokenizer.save(tmp)
        manifest = {
            "format": FORMAT_VERSION,
            "corpus": corpus.source,
            "corpus_fingerprint": corpus.fingerprint(),
            "num_files": len(corpus.files),
            "corpus_bytes": corpus.total_bytes,
            "text_field": corpus.text_field,
            "tokenizer": tokenizer.source,
            "tokenizer_fingerprint": tokenizer.fingerprint(),
            "tokenizer_vocab": tokenizer.vocab_size,
            "eos_token": tokenizer.eos_token,
            "eos_id": tokenizer.eos_id,
            "dtype": dtype.name,
            "shard_tokens": shard_tokens,
            "shards": shards,
            "num_documents": sum(s["documents"] for s in shards),
            "num_tokens": sum(s["tokens"] for s in shards),
            "build_s": round(time.perf_counter() - start, 2),
        }
        write_json(tmp / MANIFEST, manifest)

    atomic_directory(out_dir, fill, overwrite=overwrite)
    return load_tokenized(out_dir)
