"""Megatron's indexed dataset format (`moe/trainer/data/indexed.py`): files written by Megatron-core's own
`IndexedDatasetBuilder` read by ours and the reverse, the atomic streaming writer, and every corruption the reader
must refuse (a ValueError naming the file, never shorter data)."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from moe.trainer.data.indexed import HEADER_BYTES, IndexedDataset, IndexedDatasetWriter, best_dtype
from tests.clients.clients_env import import_megatron


@pytest.fixture(scope="module")
def megatron():
    """Megatron-core's `megatron.core.datasets.indexed_dataset`, unmodified."""
    return import_megatron("megatron.core.datasets.indexed_dataset")


def _documents(seed: int, dtype, num_docs: int = 40) -> list[np.ndarray]:
    """Random documents of 1..300 ids spanning the dtype's range, none all zeros, one of them a single token."""
    rng = np.random.default_rng(seed)
    high = 65499 if np.dtype(dtype) == np.uint16 else 1_000_000
    docs = [rng.integers(1, high, size=int(rng.integers(1, 300))).astype(dtype) for _ in range(num_docs)]
    docs[3] = np.array([high - 1], dtype=dtype)
    return docs


def _write_ours(prefix, docs, dtype, **kwargs):
    with IndexedDatasetWriter(prefix, dtype, **kwargs) as w:
        for doc in docs:
            w.add_document(doc)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_builder_files_read_by_ours(tmp_path, megatron, dtype):
    import torch

    docs = _documents(1, dtype)
    prefix = str(tmp_path / "mega")
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        # preprocess_data.py without sentence splitting: one sequence per document
        builder.add_document(torch.from_numpy(doc.astype(np.int64)), [doc.size])
    builder.finalize(prefix + ".idx")

    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == ds.num_documents == len(docs)
    assert ds.num_tokens == sum(d.size for d in docs)
    np.testing.assert_array_equal(ds.sizes, [d.size for d in docs])
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert ds[i].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(ds[i], doc)
        np.testing.assert_array_equal(ds.document(i), doc)
    np.testing.assert_array_equal(ds[-1], docs[-1])
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))


def test_megatron_split_sentences_documents(tmp_path, megatron):
    """preprocess_data.py with --split-sentences: several sequences per document, and an empty document."""
    import torch

    rng = np.random.default_rng(2)
    prefix = str(tmp_path / "split")
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    documents = []
    for n in (3, 1, 0, 2):
        sentences = [rng.integers(1, 60000, size=int(rng.integers(1, 20))) for _ in range(n)]
        tokens = np.concatenate(sentences) if sentences else np.zeros(0, np.int64)
        builder.add_document(torch.from_numpy(tokens), [s.size for s in sentences])
        documents.append(tokens)
    builder.finalize(prefix + ".idx")

    ds = IndexedDataset(prefix)
    assert len(ds) == 6 and ds.num_documents == 4
    np.testing.assert_array_equal(ds.document_indices, [0, 3, 4, 4, 6])
    for d, tokens in enumerate(documents):
        np.testing.assert_array_equal(ds.document(d), tokens)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_ours_read_by_megatron(tmp_path, megatron, dtype):
    docs = _documents(3, dtype)
    prefix = str(tmp_path / "ours")
    _write_ours(prefix, docs, dtype)

    theirs = megatron.IndexedDataset(prefix)
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == dtype
    np.testing.assert_array_equal(theirs.sequence_lengths, [d.size for d in docs])
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
    # Byte-identical to Megatron's own builder for the same documents.
    import torch

    mega = str(tmp_path / "mega")
    builder = megatron.IndexedDatasetBuilder(mega + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc.astype(np.int64)), [doc.size])
    builder.finalize(mega + ".idx")
    for suffix in (".bin", ".idx"):
        assert Path(prefix + suffix).read_bytes() == Path(mega + suffix).read_bytes(), suffix


def test_best_dtype_is_megatrons(megatron):
    for vocab in (1, 256, 65499, 65500, 65536, 129280):
        assert best_dtype(vocab) == np.dtype(megatron.DType.optimal_dtype(vocab))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="vocab_size"):
            best_dtype(bad)


def test_writer_publishes_atomically_private_and_streams(tmp_path):
    prefix = tmp_path / "sub" / "data"
    docs = _documents(4, np.uint16, num_docs=5)
    w = IndexedDatasetWriter(prefix, np.uint16)
    for doc in docs[:3]:
        w.add_document(doc)
    # Documents already streamed to a hidden temporary .bin; nothing published yet.
    assert sorted(p.name for p in prefix.parent.iterdir() if not p.name.startswith(".")) == []
    (tmp,) = prefix.parent.iterdir()
    w._bin.flush()
    assert tmp.stat().st_size == sum(d.size for d in docs[:3]) * 2
    for doc in docs[3:]:
        w.add_document(doc)
    w.close()
    w.close()  # idempotent
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["data.bin", "data.idx"]
    for suffix in (".bin", ".idx"):
        mode = stat.S_IMODE(os.stat(f"{prefix}{suffix}").st_mode)
        assert mode & 0o002 == 0 and mode == 0o600, oct(mode)
    ds = IndexedDataset(prefix)
    np.testing.assert_array_equal(ds.tokens, np.concatenate(docs))
    with pytest.raises(RuntimeError, match="closed"):
        w.add_document(docs[0])


def test_writer_abort_leaves_no_files_and_keeps_old_ones(tmp_path):
    prefix = tmp_path / "data"
    with pytest.raises(KeyError), IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_document(np.arange(1, 10))
        raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []

    _write_ours(prefix, [np.arange(1, 5)], np.int32)
    with pytest.raises(FileExistsError, match="data.bin"):
        IndexedDatasetWriter(prefix, np.int32)
    with (
        pytest.raises(ValueError, match="do not fit uint16"),
        IndexedDatasetWriter(prefix, np.uint16, overwrite=True) as w,
    ):
        w.add_document(np.array([1, 70000]))
    np.testing.assert_array_equal(IndexedDataset(prefix).tokens, [1, 2, 3, 4])  # the old files, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin", "data.idx"]

    _write_ours(prefix, [np.array([7, 8]), np.array([], np.int64), np.array([9])], np.int32, overwrite=True)
    ds = IndexedDataset(prefix)
    np.testing.assert_array_equal(ds.tokens, [7, 8, 9])
    np.testing.assert_array_equal(ds.sizes, [2, 0, 1])


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.array([[1, 2]]), "1-D"),
        (np.array([1.5, 2.0]), "integers"),
        (np.array([-1, 2]), "do not fit"),
    ],
)
def test_writer_refuses_bad_documents(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match), IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        w.add_document(bad)
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_float_dtype(tmp_path):
    with pytest.raises(ValueError, match="float32"):
        IndexedDatasetWriter(tmp_path / "d", np.float32)
    assert list(tmp_path.iterdir()) == []


# --- corruption: every case is a ValueError naming the damaged file --------------------------------------------


def _good(tmp_path, dtype=np.uint16):
    prefix = tmp_path / "good"
    _write_ours(prefix, _documents(5, dtype, num_docs=6), dtype)
    return prefix, bytearray(Path(f"{prefix}.idx").read_bytes())


def _header(idx: bytearray):
    return struct.unpack_from("<9sQBQQ", idx, 0)


def _rewrite(path, data: bytes):
    Path(path).write_bytes(bytes(data))


def _patch(idx: bytearray, offset: int, fmt: str, value) -> bytearray:
    struct.pack_into(fmt, idx, offset, value)
    return idx


def _seq_count(idx):
    return _header(idx)[3]


def _sizes_at(idx):
    return HEADER_BYTES


def _pointers_at(idx):
    return HEADER_BYTES + 4 * _seq_count(idx)


def _docs_at(idx):
    return HEADER_BYTES + 12 * _seq_count(idx)


IDX_CORRUPTIONS = {
    "bad magic": (lambda idx: _patch(idx, 0, "<9s", b"MMIDIDY\0\0"), "magic"),
    "version 2": (lambda idx: _patch(idx, 9, "<Q", 2), "version 2"),
    "unknown dtype code": (lambda idx: _patch(idx, 17, "<B", 9), "unknown dtype code 9"),
    "float dtype code": (lambda idx: _patch(idx, 17, "<B", 7), "float32"),
    "int32 code on a uint16 file": (lambda idx: _patch(idx, 17, "<B", 4), "fit 2-byte tokens: the dtype code is wrong"),
    "truncated header": (lambda idx: idx[:20], "truncated"),
    "truncated idx": (lambda idx: idx[:-8], "truncated"),
    "trailing bytes": (lambda idx: idx + b"\0" * 3, "trailing"),
    "multimodal": (lambda idx: idx + b"\0" * _seq_count(idx), "multimodal"),
    "sequence count too large": (lambda idx: _patch(idx, 18, "<Q", _seq_count(idx) + 1), "sequences"),
    "document count too large": (lambda idx: _patch(idx, 26, "<Q", _header(idx)[4] + 1), "document indices"),
    "no document indices": (
        lambda idx: _patch(idx[: _docs_at(idx)], 26, "<Q", 0),
        "no document indices",
    ),
    "negative size": (lambda idx: _patch(idx, _sizes_at(idx) + 4, "<i", -3), "negative length"),
    "size grown": (
        lambda idx: _patch(idx, _sizes_at(idx), "<i", struct.unpack_from("<i", idx, 34)[0] + 1),
        "inconsistent",
    ),
    "pointer moved": (lambda idx: _patch(idx, _pointers_at(idx) + 16, "<q", 2), "sequence 2 points at byte 2"),
    "doc_idx not from 0": (lambda idx: _patch(idx, _docs_at(idx), "<q", 1), "must run from 0"),
    "doc_idx short of the end": (lambda idx: _patch(idx, len(idx) - 8, "<q", 5), "must run from 0 to 6"),
    "doc_idx decreasing": (lambda idx: _patch(idx, _docs_at(idx) + 16, "<q", 0), "decrease at document 1"),
}


@pytest.mark.parametrize("case", IDX_CORRUPTIONS)
def test_corrupt_idx_is_refused_naming_the_file(tmp_path, case):
    prefix, idx = _good(tmp_path)
    corrupt, match = IDX_CORRUPTIONS[case]
    _rewrite(f"{prefix}.idx", corrupt(idx))
    with pytest.raises(ValueError, match=match) as info:
        IndexedDataset(prefix)
    assert f"{prefix}." in str(info.value)


@pytest.mark.parametrize("change, match", [(-2, "truncated"), (-1, "truncated"), (2, "trailing bytes")])
def test_bin_of_wrong_size_is_refused(tmp_path, change, match):
    prefix, _ = _good(tmp_path)
    data = Path(f"{prefix}.bin").read_bytes()
    _rewrite(f"{prefix}.bin", data[:change] if change < 0 else data + b"\1" * change)
    with pytest.raises(ValueError, match=match) as info:
        IndexedDataset(prefix)
    assert f"{prefix}.bin" in str(info.value)


def test_missing_files_are_named(tmp_path):
    prefix, _ = _good(tmp_path)
    os.unlink(f"{prefix}.bin")
    with pytest.raises(FileNotFoundError, match=r"good\.bin"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"nothing\.idx"):
        IndexedDataset(tmp_path / "nothing")


def test_index_errors(tmp_path):
    prefix, _ = _good(tmp_path)
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexError):
        ds[6]
    with pytest.raises(IndexError):
        ds.document(-7)
    assert not ds[0].flags.writeable


def test_writer_refuses_to_publish_no_tokens(tmp_path):
    for docs in ([], [np.array([], np.int64)]):
        with pytest.raises(ValueError, match="no tokens written"), IndexedDatasetWriter(tmp_path / "e", np.uint16) as w:
            for doc in docs:
                w.add_document(doc)
        assert list(tmp_path.iterdir()) == []
