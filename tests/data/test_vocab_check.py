"""Issue 38, item 1: every id of every dataset of a `--data-path` blend checked against the vocabulary before
training starts (before: found mid-training, at the step whose window held the bad id, with a traceback), naming
the file, the document and the position; the clean verdict cached by the files' identity."""

from __future__ import annotations

import os

import numpy as np
import pytest

from moe.trainer.data.vocab_check import check_token_ids
from tests.clients.clients_env import import_megatron

VOCAB = 512


def _megatron_dataset(prefix, docs, dtype=np.int32) -> str:
    """Written by megatron-core's own `IndexedDatasetBuilder`."""
    indexed_dataset = import_megatron("megatron.core.datasets.indexed_dataset")
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    import torch

    for doc in docs:
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _docs(seed: int, n: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(5, 40))) for _ in range(n)]


def test_an_out_of_vocabulary_id_is_named_by_file_document_and_position(tmp_path):
    good = _megatron_dataset(tmp_path / "a_text_document", _docs(0))
    docs = _docs(1)
    docs[1][3] = 700  # the case: one token of the second document
    bad = _megatron_dataset(tmp_path / "oov_text_document", docs)
    with pytest.raises(ValueError, match=r"oov_text_document\.bin: document 1, position 3 \(token \d+ of the file\) "
                                         r"holds id 700, outside the model's vocabulary \[0, 512\)"):  # fmt: skip
        check_token_ids([good, bad], VOCAB, tmp_path / "cache", chunk_tokens=16)  # chunks: the id is not in the first


def test_a_clean_verdict_is_cached_by_the_files_identity(tmp_path):
    a = _megatron_dataset(tmp_path / "a", _docs(2))
    b = _megatron_dataset(tmp_path / "b", _docs(3), dtype=np.uint16)
    cache = tmp_path / "cache"
    assert check_token_ids([a, b], VOCAB, cache) == [a, b]
    assert check_token_ids([a, b], VOCAB, cache) == []  # a second run does not rescan
    assert check_token_ids([a, b], VOCAB + 100, cache) == [a, b]  # another vocabulary: another verdict
    # The file changes (another id, same size): its identity (mtime) changes, so it is scanned again, and caught.
    tokens = np.memmap(f"{b}.bin", dtype=np.uint16, mode="r+")
    tokens[5] = 600
    tokens.flush()
    del tokens
    os.utime(f"{b}.bin", ns=(os.stat(f"{b}.bin").st_atime_ns, os.stat(f"{b}.bin").st_mtime_ns + 1_000_000))
    with pytest.raises(ValueError, match=r"b\.bin: document 0, position 5 .* holds id 600"):
        check_token_ids([a, b], VOCAB, cache)


def test_negative_ids_of_a_signed_dataset(tmp_path):
    docs = _docs(4)
    docs[2][0] = -1
    prefix = _megatron_dataset(tmp_path / "neg", docs, dtype=np.int32)
    with pytest.raises(ValueError, match=r"document 2, position 0 .* holds id -1"):
        check_token_ids([prefix], VOCAB, None)


def test_a_scan_past_the_threshold_shows_a_progress_bar(tmp_path, monkeypatch, capsys):
    from moe.trainer.data import vocab_check

    prefix = _megatron_dataset(tmp_path / "p", _docs(5))
    monkeypatch.setattr(vocab_check, "PROGRESS_AFTER_S", -1.0)  # every scan lasts "past the threshold"
    check_token_ids([prefix], VOCAB, None, chunk_tokens=8)
    assert "check token ids" in capsys.readouterr().err
