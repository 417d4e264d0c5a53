"""A text corpus on disk: which files, in which order, read as documents without holding the corpus in memory.

- Sources: "python-stdlib" (this Python's standard library sources, the trainer's default), a directory (searched
  recursively), a glob pattern (`**` allowed) or one file.
- Formats, by file name: `.txt`, `.md`, `.py`: one document per file (UTF-8); `.jsonl`, `.jsonl.gz`: one document
  per line, the string at `text_field` of a JSON object (blank lines are not records); `.parquet` (needs pyarrow):
  one document per row, the string column `text_field`.
- Order: files sorted by their path relative to the source's root (a directory, or a glob's directory part), so a
  corpus's order never depends on the file system; records in file order.
- `max_bytes`: the sorted files are taken until their on-disk sizes reach it (the last file whole), today's rule.
- Directories left out while searching: `__pycache__` and hidden ones (`.git`...); for "python-stdlib" also the
  test suites and site-packages (the trainer's rule since it began); a user's `test/` folder is data. A glob takes
  every file it matches (Python's `glob`: hidden names only when the pattern names them).

Reading is split so that a pool of workers can do the costly part: `Corpus.chunks` (the parent) reads raw bytes
into `Chunk`s of about `chunk_bytes`; `decode_chunk` (any process) parses and checks them into the documents' texts.
Every bad input is a `CorpusError` whose message starts with `path:line:` (the line of a JSONL record, the row of
a parquet record, the line of the bad byte of a text file): missing or unreadable files, empty files (except empty
`.py` files, which are package markers), invalid UTF-8, a JSONL line that is not a JSON object or lacks the field
or holds a non-string there, a truncated `.gz`. A corrupt file is an error, never a shorter corpus.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moe.trainer.io.shard_files import sha256_file

STDLIB = "python-stdlib"
TEXT_SUFFIXES = (".txt", ".md", ".py")
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
SKIP_DIRS = frozenset({"__pycache__"})
DEFAULT_CHUNK_BYTES = 1 << 20
_PARQUET_BATCH_ROWS = 1024


class CorpusError(ValueError):
    """Bad corpus input; the message names the file (and the line or row) at fault."""


def _at(path: str | Path, line: int | None, what: str) -> CorpusError:
    return CorpusError(f"{path}:{line}: {what}" if line is not None else f"{path}: {what}")


def file_format(path: str | Path) -> str:
    """The format of a corpus file by its name: "text", "jsonl", "jsonl.gz" or "parquet"; CorpusError otherwise."""
    name = str(path)
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    for suffix in RECORD_SUFFIXES:
        if name.endswith(suffix):
            return suffix[1:]
    raise _at(path, None, f"not a corpus format (supported: {', '.join(SUFFIXES)})")


@dataclass(frozen=True)
class CorpusFile:
    """One file of a corpus: its path, its path relative to the source's root (the sort key and the name in the
    fingerprint), its format, and its size (bytes) and modification time (ns) when listed."""

    path: Path
    relpath: str
    format: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Segment:
    """Consecutive raw records of one file. `records`: bytes per JSONL line (blank ones included, so that record i
    is line `first_line + i`), the whole file's bytes for a text file (`first_line` 1), or str / None per parquet
    row (`first_line`: the row number, 1-based)."""

    path: str
    format: str
    first_line: int
    records: list


@dataclass
class Chunk:
    """About `chunk_bytes` of raw records, possibly of several files, in corpus order; `disk_bytes` is the part of
    the files' on-disk sizes it stands for (a progress bar in bytes adds up to the corpus's size)."""

    segments: list[Segment] = field(default_factory=list)
    disk_bytes: int = 0
    raw_bytes: int = 0


class Corpus:
    """The files of a corpus source, listed and checked (exist, readable, non-empty) when constructed.

    Args:
        source: "python-stdlib", a directory, a glob pattern or a file.
        text_field: the JSONL key / parquet column holding each document's text.
        max_bytes: keep the sorted files until their sizes reach this (None: all).
        suffixes: the file names a directory search keeps (default: every supported format; "python-stdlib":
            `.py`). A glob or a file must name a supported format (CorpusError otherwise).
    Raises CorpusError (a ValueError) naming the file for each bad input it can see without reading contents.
    """

    def __init__(
        self,
        source: str | os.PathLike,
        *,
        text_field: str = "text",
        max_bytes: int | None = None,
        suffixes: tuple[str, ...] | None = None,
    ) -> None:
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.source = str(source)
        self.text_field = text_field
        self.max_bytes = max_bytes
        if self.source == STDLIB:
            root = Path(sysconfig.get_paths()["stdlib"])
            found = _search(root, suffixes or (".py",), STDLIB_SKIP_DIRS)
        elif Path(self.source).is_dir():
            root = Path(self.source)
            found = _search(root, suffixes or SUFFIXES, SKIP_DIRS)
        elif glob.has_magic(self.source):
            root = _glob_root(self.source)
            candidates = [Path(p) for p in glob.glob(self.source, recursive=True) if not Path(p).is_dir()]
            found = [
                (p, p.relative_to(root).as_posix() if p.is_relative_to(root) else p.as_posix()) for p in candidates
            ]
        elif Path(self.source).exists() or Path(self.source).is_symlink():
            found = [(Path(self.source), Path(self.source).name)]
        else:
            raise CorpusError(f"corpus {self.source!r}: no such file, directory or glob match")
        if not found:
            raise CorpusError(f"corpus {self.source!r}: no corpus files (formats: {', '.join(suffixes or SUFFIXES)})")
        found.sort(key=lambda item: item[1])
        files: list[CorpusFile] = []
        total = 0
        for path, rel in found:
            if max_bytes is not None and total >= max_bytes:
                break
            listed = _check_file(path, rel)
            files.append(listed)
            total += listed.size
        self.files = files

    def __repr__(self) -> str:
        return f"Corpus({self.source!r}, {len(self.files)} files, {self.total_bytes} bytes)"

    @property
    def total_bytes(self) -> int:
        """The files' on-disk sizes added up."""
        return sum(f.size for f in self.files)

    def fingerprint(self, *, content: bool = False) -> str:
        """A sha256 (hex) that changes when the corpus's documents may have changed.

        By default it hashes each file's relative path, size and modification time (ns), in corpus order, and the
        reading settings (`text_field`): listing a corpus of terabytes costs one stat per file, where hashing the
        contents costs a full read of it every run. An edit changes the size or the mtime (a same-size rewrite
        still bumps mtime_ns); a copy that does not keep mtimes only misses the cache (a rebuild), never reuses a
        stale one. `content=True` hashes the bytes instead of the mtimes (stable across copies; one full read).
        """
        digest = hashlib.sha256(json.dumps({"text_field": self.text_field, "content": content}).encode())
        for f in self.files:
            stamp = sha256_file(f.path).sha256 if content else str(f.mtime_ns)
            digest.update(f"{f.relpath}\0{f.format}\0{f.size}\0{stamp}\n".encode())
        return digest.hexdigest()

    def chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
        """The corpus's raw records in order, grouped into chunks of about `chunk_bytes` (a larger single record,
        e.g. a big text file, makes one chunk of its own). Memory: one chunk plus one file-read buffer."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        chunk = Chunk()
        for f in self.files:
            for segment, disk_bytes, raw_bytes in _read_file(f, self.text_field, chunk_bytes):
                if chunk.segments and chunk.raw_bytes + raw_bytes > chunk_bytes:
                    yield chunk
                    chunk = Chunk()
                chunk.segments.append(segment)
                chunk.disk_bytes += disk_bytes
                chunk.raw_bytes += raw_bytes
        if chunk.segments:
            yield chunk

    def texts(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[str]:
        """Every document's text in corpus order, decoded in this process (streamed: one chunk in memory)."""
        for chunk in self.chunks(chunk_bytes):
            yield from decode_chunk(chunk, self.text_field)


def decode_chunk(chunk: Chunk, text_field: str = "text") -> list[str]:
    """The documents of a chunk, in order. CorpusError `path:line: ...` for invalid UTF-8, a JSONL line that is
    not a JSON object, lacks `text_field` or holds a non-string there, or a null parquet value."""
    texts: list[str] = []
    for seg in chunk.segments:
        if seg.format == "text":
            texts.append(_decode_text(seg.path, seg.records[0]))
        elif seg.format == "parquet":
            for i, value in enumerate(seg.records):
                if not isinstance(value, str):
                    raise _at(seg.path, seg.first_line + i, f"column {text_field!r} is null (row {seg.first_line + i})")
                texts.append(value)
        else:
            for i, raw in enumerate(seg.records):
                if raw.isspace() or not raw:
                    continue
                texts.append(_json_text(seg.path, seg.first_line + i, raw, text_field))
    return texts


def _decode_text(path: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise _at(path, line, f"not UTF-8 (byte {e.start}: {e.reason})") from None


def _json_text(path: str, line: int, raw: bytes, text_field: str) -> str:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _at(path, line, f"not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise _at(path, line, f"not a JSON object (a {type(record).__name__})")
    if text_field not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise _at(path, line, f"no field {text_field!r} (its fields: {keys}); set the text field's name")
    text = record[text_field]
    if not isinstance(text, str):
        raise _at(path, line, f"field {text_field!r} is a {type(text).__name__}, not a string")
    return text


def _search(root: Path, suffixes: tuple[str, ...], skip: frozenset[str]) -> list[tuple[Path, str]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        for name in filenames:
            if name.endswith(suffixes) and not name.startswith("."):
                path = Path(dirpath) / name
                found.append((path, path.relative_to(root).as_posix()))
    return found


def _glob_root(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard (the root that relative paths are taken from)."""
    parts = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def _check_file(path: Path, rel: str) -> CorpusFile:
    fmt = file_format(path)
    try:
        with open(path, "rb"):  # a permission error or a dangling link shows here, before any tokenization
            pass
        st = path.stat()
    except OSError as e:
        raise _at(path, None, f"cannot read ({e.strerror or e})") from None
    if st.st_size == 0 and not str(path).endswith(".py"):  # an empty .py is a package marker: an empty document
        raise _at(path, None, "empty file")
    return CorpusFile(path, rel, fmt, st.st_size, st.st_mtime_ns)


def _read_file(f: CorpusFile, text_field: str, chunk_bytes: int) -> Iterator[tuple[Segment, int, int]]:
    """(segment, disk bytes, raw bytes) pieces of one file, each at most about `chunk_bytes` of raw records."""
    path = str(f.path)
    try:
        if f.format == "text":
            raw = f.path.read_bytes()
            if len(raw) != f.size:
                raise _at(path, None, f"changed while reading ({f.size} bytes listed, {len(raw)} read)")
            yield Segment(path, "text", 1, [raw]), f.size, len(raw)
        elif f.format == "parquet":
            yield from _read_parquet(f, text_field, chunk_bytes)
        else:
            yield from _read_jsonl(f, chunk_bytes)
    except OSError as e:
        raise _at(path, None, f"cannot read ({e.strerror or e})") from None


def _read_jsonl(f: CorpusFile, chunk_bytes: int) -> Iterator[tuple[Segment, int, int]]:
    path = str(f.path)
    with open(f.path, "rb") as disk:
        stream = gzip.GzipFile(fileobj=disk, mode="rb") if f.format == "jsonl.gz" else disk
        records: list[bytes] = []
        first, line, size, disk_seen, nonblank = 1, 0, 0, 0, 0
        try:
            for raw in stream:
                line += 1
                records.append(raw)
                size += len(raw)
                nonblank += not raw.isspace()
                if size >= chunk_bytes:
                    pos = disk.tell()
                    yield Segment(path, f.format, first, records), pos - disk_seen, size
                    records, first, size, disk_seen = [], line + 1, 0, pos
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # a truncated or corrupt .gz
            raise _at(path, line + 1, f"corrupt gzip stream ({e})") from None
        if not nonblank:
            raise _at(path, None, "no records (only blank lines)")
        if records or f.size > disk_seen:
            yield Segment(path, f.format, first, records), f.size - disk_seen, size


def _read_parquet(f: CorpusFile, text_field: str, chunk_bytes: int) -> Iterator[tuple[Segment, int, int]]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise _at(f.path, None, "reading .parquet needs pyarrow (pip install pyarrow)") from None
    path = str(f.path)
    try:
        pf = pq.ParquetFile(f.path)
    except (pyarrow.ArrowException, OSError) as e:
        raise _at(path, None, f"not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise _at(path, None, f"no column {text_field!r} (its columns: {', '.join(schema.names)})")
    kind = schema.field(text_field).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise _at(path, None, f"column {text_field!r} is {kind}, not a string column")
    num_rows = pf.metadata.num_rows
    if num_rows == 0:
        raise _at(path, None, "no records (0 rows)")

    def disk_at(rows: int) -> int:  # the file's bytes, shared out by rows (for progress only)
        return f.size * rows // num_rows

    records, size, done = [], 0, 0  # done: rows already yielded
    try:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                records.append(value)
                size += len(value) if value else 0
                if size >= chunk_bytes:
                    end = done + len(records)
                    yield Segment(path, "parquet", done + 1, records), disk_at(end) - disk_at(done), size
                    records, size, done = [], 0, end
    except (pyarrow.ArrowException, OSError) as e:
        raise _at(path, done + len(records) + 1, f"corrupt parquet data ({e})") from None
    if records:
        yield Segment(path, "parquet", done + 1, records), f.size - disk_at(done), size
