"""Corpus listing, reading and its bad inputs (`moe.trainer.data.corpus`): every format, directory / glob / file
sources, the order, the stdlib rule of the trainer, the fingerprint, and `path:line:` errors."""

from __future__ import annotations

import gzip
import os
import shutil

import pytest

from moe.trainer.data import token_file as train_data
from moe.trainer.data.corpus import Corpus, CorpusError, decode_chunk
from moe.trainer.train.training_config import DataConfig
from tests.data.corpus_cases import write_jsonl, write_mixed_corpus


def test_directory_reads_every_format_in_relative_path_order(tmp_path):
    expected = write_mixed_corpus(tmp_path)
    corpus = Corpus(tmp_path)
    rels = [f.relpath for f in corpus.files]
    assert rels == sorted(rels)
    assert rels == [
        "a.txt",
        "b/empty.py",
        "b/mod.py",
        "b/notes.md",
        "data/part-0.jsonl",
        "data/part-1.jsonl.gz",
        "tests/case.txt",
    ]
    assert list(corpus.texts()) == expected
    # Tiny chunks split files and records across chunks: same documents.
    assert list(corpus.texts(chunk_bytes=7)) == expected
    assert corpus.total_bytes == sum(f.size for f in corpus.files)
    assert sum(c.disk_bytes for c in corpus.chunks(chunk_bytes=50)) == corpus.total_bytes


def test_glob_and_single_file_sources(tmp_path):
    write_mixed_corpus(tmp_path)
    jsonl = Corpus(str(tmp_path / "data" / "*.jsonl*"))
    assert [f.relpath for f in jsonl.files] == ["part-0.jsonl", "part-1.jsonl.gz"]
    assert len(list(jsonl.texts())) == 7 + 9
    deep = Corpus(str(tmp_path / "**" / "*.txt"))
    # A glob takes what it matches (no skip list), as glob does: not the hidden directory, but __pycache__.
    assert [f.relpath for f in deep.files] == ["__pycache__/x.txt", "a.txt", "tests/case.txt"]
    one = Corpus(tmp_path / "b" / "notes.md")
    assert list(one.texts()) == [(tmp_path / "b" / "notes.md").read_text()]
    with pytest.raises(CorpusError, match=r"image\.png: not a corpus format"):
        Corpus(str(tmp_path / "*.png"))
    with pytest.raises(CorpusError, match="no such file"):
        Corpus(tmp_path / "missing")
    with pytest.raises(CorpusError, match="no corpus files"):
        Corpus(str(tmp_path / "*.nothing"))


def test_text_field_and_max_bytes(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["one", "two"], field="content")
    assert list(Corpus(tmp_path, text_field="content").texts()) == ["one", "two"]
    with pytest.raises(CorpusError, match=r"c\.jsonl:1: no field 'text' \(its fields: 'content'\)"):
        list(Corpus(tmp_path).texts())
    for i in range(5):
        (tmp_path / f"f{i}.txt").write_text("x" * 100)
    capped = Corpus(str(tmp_path / "*.txt"), max_bytes=250)
    assert [f.relpath for f in capped.files] == ["f0.txt", "f1.txt", "f2.txt"]  # today's rule: the last file whole


def test_stdlib_source_keeps_the_trainers_files_and_texts():
    cfg = DataConfig(max_bytes=300_000)
    corpus = Corpus("python-stdlib", max_bytes=300_000)
    assert [f.path for f in corpus.files] == train_data.corpus_files(cfg)
    texts, _ = train_data._read_corpus(cfg)
    assert list(corpus.texts()) == texts
    assert len(Corpus("python-stdlib").files) == len(train_data.corpus_files(DataConfig()))


def test_fingerprint_follows_changes_and_content_mode_survives_a_copy(tmp_path):
    write_mixed_corpus(tmp_path / "a")
    first = Corpus(tmp_path / "a").fingerprint()
    assert Corpus(tmp_path / "a").fingerprint() == first
    assert Corpus(tmp_path / "a", text_field="body").fingerprint() != first
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # new mtimes, same bytes
    os.utime(tmp_path / "b" / "a.txt", ns=(1, 1))
    assert Corpus(tmp_path / "b").fingerprint() != first
    content = Corpus(tmp_path / "a").fingerprint(content=True)
    assert Corpus(tmp_path / "b").fingerprint(content=True) == content
    path = tmp_path / "b" / "a.txt"
    path.write_text(path.read_text().replace("e", "E", 1))  # same size, different bytes
    assert Corpus(tmp_path / "b").fingerprint(content=True) != content


@pytest.mark.parametrize(
    "lines, error",
    [
        (['{"text": "a"}', '{"text": "b"', '{"text": "c"}'], r"bad\.jsonl:2: not valid JSON"),
        (['{"text": "a"}', "", '{"body": "b"}'], r"bad\.jsonl:3: no field 'text' \(its fields: 'body'\)"),
        (['{"text": "a"}', '{"text": 7}'], r"bad\.jsonl:2: field 'text' is a int, not a string"),
        (['{"text": "a"}', '{"text": null}'], r"bad\.jsonl:2: field 'text' is a NoneType, not a string"),
        (['["text", "a"]'], r"bad\.jsonl:1: not a JSON object \(a list\)"),
        (["", "  "], r"bad\.jsonl: no records"),
    ],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, lines, error):
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=error):
        list(Corpus(tmp_path).texts())


def test_invalid_utf8_names_the_line(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"fine\nbad \xff byte\n")
    with pytest.raises(CorpusError, match=r"x\.txt:2: not UTF-8"):
        list(Corpus(tmp_path).texts())
    (tmp_path / "x.txt").unlink()
    (tmp_path / "y.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(CorpusError, match=r"y\.jsonl:2: not valid JSON"):
        list(Corpus(tmp_path).texts())


def test_empty_and_unreadable_files_fail_when_listed(tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(CorpusError, match=r"empty\.jsonl: empty file"):
        Corpus(tmp_path)
    (tmp_path / "empty.jsonl").unlink()
    (tmp_path / "empty.md").write_bytes(b"")
    with pytest.raises(CorpusError, match=r"empty\.md: empty file"):
        Corpus(tmp_path)
    (tmp_path / "empty.md").unlink()
    os.symlink(tmp_path / "nowhere.txt", tmp_path / "dangling.txt")
    with pytest.raises(CorpusError, match=r"dangling\.txt: cannot read"):
        Corpus(tmp_path)
    os.unlink(tmp_path / "dangling.txt")
    if os.geteuid() != 0:  # root reads a mode-000 file
        (tmp_path / "locked.txt").write_text("secret")
        os.chmod(tmp_path / "locked.txt", 0)
        with pytest.raises(CorpusError, match=r"locked\.txt: cannot read"):
            Corpus(tmp_path)


def test_truncated_gzip_is_an_error_not_a_shorter_corpus(tmp_path):
    data = gzip.compress(("\n".join(f'{{"text": "record {i}"}}' for i in range(2000)) + "\n").encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusError, match=r"cut\.jsonl\.gz:\d+: corrupt gzip stream"):
        list(Corpus(tmp_path).texts())
    (tmp_path / "cut.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(CorpusError, match=r"cut\.jsonl\.gz:1: corrupt gzip stream"):
        list(Corpus(tmp_path).texts())


def test_decode_chunk_runs_anywhere_on_the_parents_raw_chunks(tmp_path):
    expected = write_mixed_corpus(tmp_path)
    corpus = Corpus(tmp_path)
    assert [t for c in corpus.chunks(64) for t in decode_chunk(c, "text")] == expected


def test_parquet_rows_and_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [f"row {i} " + "x" * i for i in range(3000)]
    pq.write_table(pa.table({"text": rows, "n": list(range(3000))}), tmp_path / "t.parquet")
    assert list(Corpus(tmp_path).texts(chunk_bytes=1000)) == rows
    with pytest.raises(CorpusError, match=r"t\.parquet: no column 'body'"):
        list(Corpus(tmp_path, text_field="body").texts())
    with pytest.raises(CorpusError, match=r"t\.parquet: column 'n' is int64, not a string column"):
        list(Corpus(tmp_path, text_field="n").texts())
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "t.parquet")
    with pytest.raises(CorpusError, match=r"t\.parquet:2: column 'text' is null"):
        list(Corpus(tmp_path).texts())
    (tmp_path / "t.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(CorpusError, match=r"t\.parquet: not a readable parquet file"):
        list(Corpus(tmp_path).texts())
