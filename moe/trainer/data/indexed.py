"""Megatron's indexed dataset: a `<prefix>.bin` of tokens and a `<prefix>.idx` that cuts it into sequences and
documents, as Megatron-core's `tools/preprocess_data.py` writes them (`megatron/core/datasets/indexed_dataset.py`,
`IndexedDatasetBuilder`; the "MMIDIDX" format).

The `.idx` file, little-endian, in this order:

| bytes | field |
|---|---|
| 9 | magic `b"MMIDIDX\\x00\\x00"` |
| 8 | version, uint64, always 1 |
| 1 | token dtype code, uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16 |
| 8 | S, the number of sequences, uint64 |
| 8 | D + 1, the number of document indices, uint64 |
| 4 S | sequence lengths in tokens, int32 |
| 8 S | sequence pointers: byte offset of each sequence in the `.bin`, int64 |
| 8 (D + 1) | document indices, int64: document `d` is sequences `[doc[d], doc[d + 1])`; starts at 0, ends at S |

(A multimodal `.idx` appends one int8 mode per sequence; text training has no use for it and it is refused.)
The `.bin` is the sequences' tokens back to back in that dtype, so the pointers are the exclusive prefix sums of
lengths x itemsize. Without sentence splitting (preprocess_data.py's default) a document is one sequence; with
`--append-eod` its last token is the end-of-text id.

Megatron picks the token dtype by vocabulary size (`DType.optimal_dtype`): uint16 below 65500 ids, else int32
(`best_dtype`).

`IndexedDatasetWriter` streams documents to the `.bin` and publishes both files atomically; `IndexedDataset` maps
them read-only after checking every field above against the files' lengths, so a corrupt or truncated shard is a
`ValueError` naming the file before training starts, never silently shorter data.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np

from moe.trainer.io.atomic import fsync_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's DType table (indexed_dataset.py): code -> numpy dtype.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
HEADER_BYTES = _HEADER.size  # 34
_UINT16_VOCAB_LIMIT = 65500  # Megatron's threshold (DType.optimal_dtype), kept for byte-identical files


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocess_data.py uses for `vocab_size` ids: uint16 below 65500, else int32."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    return np.dtype(np.uint16) if vocab_size < _UINT16_VOCAB_LIMIT else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def _token_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF or dtype.kind not in "iu":
        names = sorted(d.name for d in _CODE_OF if d.kind in "iu")
        raise ValueError(f"token dtype {dtype.name} is not an integer type of Megatron's DType table ({names})")
    return dtype


class IndexedDatasetWriter:
    """Writes `<prefix>.bin` / `<prefix>.idx` in Megatron's format, one document (= one sequence) at a time.

    Documents go straight to a temporary `.bin` beside the target (only their lengths stay in memory). `close()`
    writes the `.idx`, fsyncs both, removes an old `<prefix>.idx`, then renames the `.bin` and the `.idx` into
    place in that order: an `.idx` on disk always names a complete `.bin`. The files are created mode 0600
    (`tempfile.mkstemp`). Leaving the `with` block by an exception, or `abort()`, removes the temporary files and
    publishes nothing.

    Args:
        prefix: path without the `.bin` / `.idx` suffix.
        dtype: token dtype, an integer type of Megatron's table (usually `best_dtype(vocab_size)`).
        overwrite: replace existing files at `prefix` (else FileExistsError at construction).
    """

    def __init__(self, prefix: str | os.PathLike, dtype, *, overwrite: bool = False) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = _token_dtype(dtype)
        self.bin_path, self.idx_path = bin_path(prefix), idx_path(prefix)
        if not overwrite:
            for path in (self.bin_path, self.idx_path):
                if path.exists():
                    raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
        parent = self.bin_path.parent
        parent.mkdir(parents=True, exist_ok=True)
        self._sizes: list[int] = []
        self._info = np.iinfo(self.dtype)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.bin_path.name}.tmp-", dir=parent)
        self._tmp_bin = Path(tmp)
        self._tmp_idx: Path | None = None
        self._bin = os.fdopen(fd, "wb")
        self._done = False

    @property
    def num_documents(self) -> int:
        return len(self._sizes)

    def add_document(self, tokens) -> None:
        """Append one document: `tokens` a 1-D integer array `[L]` (L >= 0), every id representable in `dtype`."""
        if self._done:
            raise RuntimeError(f"writer of {self.prefix} is closed")
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document is a 1-D token array, got shape {array.shape}")
        if array.size and array.dtype.kind not in "iu":
            raise ValueError(f"document tokens must be integers, got dtype {array.dtype}")
        if array.size >= 1 << 31:
            raise ValueError(f"a document of {array.size} tokens does not fit the format's int32 length")
        if array.size and (int(array.min()) < self._info.min or int(array.max()) > self._info.max):
            raise ValueError(
                f"document {len(self._sizes)}: ids in [{int(array.min())}, {int(array.max())}] do not fit "
                f"{self.dtype.name} (choose the dtype with best_dtype(vocab_size))"
            )
        self._bin.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self._sizes.append(int(array.size))

    def close(self) -> None:
        """Write the `.idx` and publish both files (see the class docstring); a second call does nothing.
        ValueError (and nothing published) when no document holds a token."""
        if self._done:
            return
        try:
            if not any(self._sizes):
                raise ValueError(
                    f"{self.prefix}: no tokens written, nothing published (Megatron's reader cannot map an empty .bin)"
                )
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            sizes = np.asarray(self._sizes, dtype=np.int32)
            pointers = np.zeros(sizes.size, dtype=np.int64)
            np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
            pointers *= self.dtype.itemsize
            documents = np.arange(sizes.size + 1, dtype=np.int64)  # one sequence per document
            fd, tmp = tempfile.mkstemp(prefix=f".{self.idx_path.name}.tmp-", dir=self.idx_path.parent)
            self._tmp_idx = Path(tmp)
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], sizes.size, documents.size))
                f.write(sizes.tobytes())
                f.write(pointers.tobytes())
                f.write(documents.tobytes())
                f.flush()
                os.fsync(f.fileno())
            # An old .idx must not outlive its .bin: gone before the new .bin lands, back once it is whole.
            self.idx_path.unlink(missing_ok=True)
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
            fsync_path(self.idx_path.parent)
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Drop what was written: the temporary files are removed and nothing is published."""
        self._done = True
        if not self._bin.closed:
            self._bin.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class IndexedDataset:
    """A read-only memory map of `<prefix>.bin` / `<prefix>.idx`, checked in full when opened.

    Raises FileNotFoundError for a missing file and ValueError, naming the file, for: a bad magic, a version other
    than 1, an unknown or non-integer dtype code, an `.idx` whose length does not match its counts (truncated,
    trailing bytes, multimodal), negative lengths, pointers that are not the prefix sums of lengths x itemsize, a
    `.bin` whose size is not the tokens the `.idx` describes, document indices that do not start at 0, end at the
    sequence count, or decrease.

    Attributes:
        sizes: `[S] int32` tokens per sequence.
        document_indices: `[D + 1] int64`; document `d` is sequences `[document_indices[d], document_indices[d+1])`.
        document_offsets: `[D + 1] int64` token offsets of the documents in `tokens`.
        tokens: `[num_tokens]` the whole `.bin` (a read-only memory map in `dtype`).
        dtype: the token dtype.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_path, self.bin_path = idx_path(prefix), bin_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"indexed dataset {self.prefix!r}: {path} does not exist")
        self._read_index()
        self._map_tokens()

    def _fail(self, path: Path, what: str) -> ValueError:
        return ValueError(f"{path}: {what}")

    def _read_index(self) -> None:
        path = self.idx_path
        length = path.stat().st_size
        if length < HEADER_BYTES:
            raise self._fail(path, f"truncated: {length} bytes, shorter than the {HEADER_BYTES}-byte header")
        with open(path, "rb") as f:
            magic, version, code, num_seq, num_doc_idx = _HEADER.unpack(f.read(HEADER_BYTES))
        if magic != MAGIC:
            raise self._fail(path, f"not a Megatron indexed dataset index (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise self._fail(path, f"index version {version}; only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise self._fail(path, f"unknown dtype code {code} (Megatron's codes are {sorted(DTYPE_CODES)})")
        self.dtype = DTYPE_CODES[code]
        if self.dtype.kind not in "iu":
            raise self._fail(path, f"dtype code {code} is {self.dtype.name}, not an integer token type")
        expected = HEADER_BYTES + 12 * num_seq + 8 * num_doc_idx  # Python ints: no overflow on a garbage count
        if length != expected:
            hint = " (a multimodal index, with sequence modes: not supported)" if length == expected + num_seq else ""
            raise self._fail(
                path,
                f"{length} bytes, but {num_seq} sequences and {num_doc_idx} document indices need {expected}: "
                f"truncated or trailing bytes{hint}",
            )
        if num_doc_idx < 1:
            raise self._fail(path, "no document indices (at least the leading 0 is required)")
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        offset = HEADER_BYTES
        self.sizes = np.frombuffer(raw, dtype="<i4", count=num_seq, offset=offset)
        offset += 4 * num_seq
        pointers = np.frombuffer(raw, dtype="<i8", count=num_seq, offset=offset)
        offset += 8 * num_seq
        self.document_indices = np.frombuffer(raw, dtype="<i8", count=num_doc_idx, offset=offset)

        if num_seq and int(self.sizes.min()) < 0:
            i = int(np.argmin(self.sizes))
            raise self._fail(path, f"sequence {i} has negative length {int(self.sizes[i])}")
        ends = np.cumsum(self.sizes, dtype=np.int64)
        expected_pointers = (ends - self.sizes) * self.dtype.itemsize
        if not np.array_equal(pointers, expected_pointers):
            i = int(np.argmax(pointers != expected_pointers))
            fits = [k for k in (1, 2, 4, 8) if np.array_equal(pointers, (ends - self.sizes) * k)]
            hint = f" (they fit {fits[0]}-byte tokens: the dtype code is wrong)" if fits else ""
            raise self._fail(
                path,
                f"sequence {i} points at byte {int(pointers[i])}, but the lengths before it put it at "
                f"{int(expected_pointers[i])}: pointers and sizes are inconsistent{hint}",
            )
        doc = self.document_indices
        if int(doc[0]) != 0 or int(doc[-1]) != num_seq:
            raise self._fail(
                path, f"document indices run from {int(doc[0])} to {int(doc[-1])}; they must run from 0 to {num_seq}"
            )
        steps = np.diff(doc)
        if steps.size and int(steps.min()) < 0:
            d = int(np.argmin(steps))
            raise self._fail(path, f"document indices decrease at document {d} ({int(doc[d])} -> {int(doc[d + 1])})")
        self.num_tokens = int(ends[-1]) if num_seq else 0
        starts = np.concatenate([np.zeros(1, np.int64), ends])
        self.document_offsets = starts[doc]  # [D + 1] token offsets (documents are runs of whole sequences)
        self._sequence_offsets = starts

    def _map_tokens(self) -> None:
        path = self.bin_path
        expected = self.num_tokens * self.dtype.itemsize
        length = path.stat().st_size
        if length != expected:
            raise self._fail(
                path,
                f"{length} bytes, but {self.idx_path.name} describes {self.num_tokens} {self.dtype.name} tokens "
                f"({expected} bytes): {'truncated' if length < expected else 'trailing bytes'} or not its index",
            )
        # np.memmap cannot map an empty file.
        self.tokens = np.memmap(path, dtype=self.dtype, mode="r") if expected else np.empty(0, self.dtype)

    def __len__(self) -> int:
        """S, the number of sequences."""
        return int(self.sizes.size)

    @property
    def num_documents(self) -> int:
        """D, the number of documents."""
        return int(self.document_indices.size) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence `i` (negative counts from the end): a read-only view `[sizes[i]]` in `dtype`."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} of {n} in {self.prefix}")
        i %= n
        return self.tokens[self._sequence_offsets[i] : self._sequence_offsets[i + 1]]

    def document(self, d: int) -> np.ndarray:
        """Document `d`'s tokens (its sequences back to back): a read-only view in `dtype`."""
        n = self.num_documents
        if not -n <= d < n:
            raise IndexError(f"document {d} of {n} in {self.prefix}")
        d %= n
        return self.tokens[self.document_offsets[d] : self.document_offsets[d + 1]]
