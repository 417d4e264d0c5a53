"""Corpus, tokenizer, token cache and the layout-independent global batches."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from moe.trainer.data import token_file as data_mod
from moe.trainer.data.token_file import TokenBatches, corpus_files, prepare_tokens
from moe.trainer.train.training_config import DataConfig

WORDS = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "value", "items", "(", ")", ":", "="]


def _write_corpus(root, num_files=12, seed=0):
    rng = random.Random(seed)
    for i in range(num_files):
        sub = root / ("pkg" if i % 2 else "") / ("tests" if i == 5 else "")
        sub.mkdir(parents=True, exist_ok=True)
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(200)]
        (sub / f"mod_{i:02d}.py").write_text("\n".join(lines) + "\n# é ünïcode\n")
    (root / "notes.txt").write_text("not python")
    return root


def test_stdlib_corpus_listing():
    files = corpus_files(DataConfig())
    root = data_mod.corpus_root(DataConfig())
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel) and len(rel) > 500
    assert "os.py" in rel and "json/__init__.py" in rel
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/")[:-1])


def test_missing_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        prepare_tokens(DataConfig(corpus=str(tmp_path / "nowhere"), cache_dir=str(tmp_path)), 300)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.py files"):
        prepare_tokens(DataConfig(corpus=str(tmp_path / "empty"), cache_dir=str(tmp_path)), 300)


def test_max_bytes_takes_a_sorted_prefix(tmp_path):
    corpus = _write_corpus(tmp_path / "c")
    all_files = corpus_files(DataConfig(corpus=str(corpus)))
    assert all("tests" not in p.parts for p in all_files) and len(all_files) == 11
    some = corpus_files(DataConfig(corpus=str(corpus), max_bytes=all_files[0].stat().st_size + 1))
    assert some == all_files[:2]


@pytest.mark.parametrize("kind, vocab", [("bpe", 320), ("bytes", 300)])
def test_tokens_built_once_and_reused(tmp_path, kind, vocab):
    corpus = _write_corpus(tmp_path / "c")
    cfg = DataConfig(corpus=str(corpus), tokenizer=kind, cache_dir=str(tmp_path / "cache"))
    data = prepare_tokens(cfg, vocab)
    tok = Tokenizer.from_file(str(data.tokenizer_path))
    assert data.tokens.dtype == np.uint16 and int(data.tokens.max()) < vocab
    if kind == "bpe":  # merges up to the vocabulary (this small corpus may run out of pairs seen twice a little before)
        assert 300 <= tok.get_vocab_size() <= vocab
    else:
        assert tok.get_vocab_size() == 257
    # The stream is the files in sorted order, each followed by the end-of-text token, and decodes back.
    texts = [p.read_text() for p in corpus_files(cfg)]
    eos = np.flatnonzero(np.asarray(data.tokens) == data.eos_id)
    assert len(eos) == len(texts) and eos[-1] == len(data.tokens) - 1
    assert tok.decode(np.asarray(data.tokens[: eos[0]]).tolist()) == texts[0]
    if kind == "bpe":  # merges compress: fewer tokens than bytes
        assert len(data.tokens) < 0.8 * sum(len(t.encode()) for t in texts)
    # A second call finds the entry: nothing is rebuilt.
    stamp = (data.directory / "tokens.npy").stat().st_mtime_ns
    again = prepare_tokens(cfg, vocab, build=False, timeout_s=1)
    assert again.directory == data.directory and (again.directory / "tokens.npy").stat().st_mtime_ns == stamp
    # Another vocabulary or tokenizer is another entry.
    assert prepare_tokens(cfg, vocab + 16).directory != data.directory
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_waiting_rank_times_out_with_a_clear_error(tmp_path):
    corpus = _write_corpus(tmp_path / "c", num_files=2)
    cfg = DataConfig(corpus=str(corpus), cache_dir=str(tmp_path / "cache"))
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="local rank 0 builds"):
        prepare_tokens(cfg, 300, build=False, timeout_s=1.0)
    assert time.monotonic() - start < 10


def test_cache_entry_is_private_under_a_private_umask(tmp_path):
    corpus = _write_corpus(tmp_path / "c", num_files=2)
    old = os.umask(0o077)
    try:
        data = prepare_tokens(DataConfig(corpus=str(corpus), cache_dir=str(tmp_path / "cache")), 300)
    finally:
        os.umask(old)
    for path in [data.directory, *data.directory.iterdir()]:
        assert path.stat().st_mode & 0o077 == 0, path
    assert json.loads((data.directory / "meta.json").read_text())["num_files"] == 2


def _stream(n=10_000, vocab=300):
    return np.random.default_rng(0).integers(0, vocab, n).astype(np.uint16)


def test_batches_do_not_depend_on_the_layout():
    tokens = _stream()
    batches = TokenBatches(tokens, seq_len=16, global_batch=8, val_sequences=5, seed=3)
    for step in (1, 2, 77):
        full = batches.global_batch_tokens(step)
        assert full.shape == (8, 16) and full.dtype == torch.int64
        for dp in (1, 2, 4, 8):
            parts = [batches.local_batch(step, r, dp) for r in range(dp)]
            assert torch.equal(torch.cat(parts), full)
    # Rows are windows of the stream.
    w = batches.windows(1)[0]
    assert torch.equal(
        batches.global_batch_tokens(1)[0], torch.from_numpy(tokens[w * 16 : (w + 1) * 16].astype(np.int64))
    )


def test_epochs_visit_every_training_window_once_and_never_the_held_out_ones():
    batches = TokenBatches(_stream(), seq_len=16, global_batch=8, val_sequences=5, seed=1)
    n = batches.num_train  # 625 - 5 = 620 windows
    assert n == 620
    seen = np.concatenate([batches.windows(s) for s in range(1, 1 + 2 * n // 8 + 1)])
    first, second = seen[:n], seen[n : 2 * n]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert not np.array_equal(first, second)  # a new order each epoch
    val = batches.val_tokens()
    assert val.shape == (5, 16)
    assert torch.equal(val[0], torch.from_numpy(_stream()[620 * 16 : 621 * 16].astype(np.int64)))


def test_order_depends_on_the_seed_only():
    a = TokenBatches(_stream(), seq_len=16, global_batch=8, val_sequences=0, seed=1)
    b = TokenBatches(_stream(), seq_len=16, global_batch=8, val_sequences=0, seed=1)
    c = TokenBatches(_stream(), seq_len=16, global_batch=8, val_sequences=0, seed=2)
    assert np.array_equal(a.windows(5), b.windows(5)) and not np.array_equal(a.windows(5), c.windows(5))


def test_too_small_corpus():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TokenBatches(_stream(100), seq_len=16, global_batch=8, val_sequences=0, seed=0)
