"""The tokenization pipeline (`moe.trainer.data.tokenize`): exact tokens against the tokenizer run directly, files that
do not depend on the number of workers, shards cut at document ends, bad input from a worker aborting the build."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe.trainer.data.corpus import Corpus, CorpusError
from moe.trainer.data.indexed import IndexedDataset
from moe.trainer.data.tokenize import cache_key, load_tokenized, tokenize_corpus
from moe.trainer.data.tokenizer import load_tokenizer, train_tokenizer
from tests.data.corpus_cases import hf_tokenizer, write_jsonl, write_mixed_corpus


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    docs = write_mixed_corpus(root)
    for i in range(3):  # more records than one chunk holds, so that workers share the work
        write_jsonl(root / "more" / f"p{i}.jsonl", [f"record {i}-{j} " + "data token " * (j % 17) for j in range(300)])
    corpus = Corpus(root)
    docs = list(corpus.texts())
    tokenizer = train_tokenizer(docs, 600)
    return corpus, docs, tokenizer


def _documents(out) -> list[list[int]]:
    return [ds.document(d).tolist() for ds in out.datasets() for d in range(ds.num_documents)]


def test_tokens_equal_the_tokenizer_run_directly(mixed, tmp_path):
    corpus, docs, tok = mixed
    out = tokenize_corpus(corpus, tok, tmp_path / "out", workers=0, chunk_bytes=4096)
    expected = [[*tok.tokenizer.encode(d, add_special_tokens=False).ids, tok.eos_id] for d in docs]
    assert _documents(out) == expected
    assert out.manifest["num_documents"] == len(docs) and out.num_tokens == sum(map(len, expected))
    assert out.manifest["dtype"] == "uint16" and out.eos_id == tok.eos_id
    assert load_tokenizer(out.directory).fingerprint() == tok.fingerprint()  # saved with the data
    assert load_tokenized(out.directory).manifest == out.manifest


@pytest.mark.slow  # slow: spawns worker pools of 1 and 2 processes
def test_files_do_not_depend_on_the_number_of_workers(mixed, tmp_path):
    corpus, _, tok = mixed
    outs = [
        tokenize_corpus(corpus, tok, tmp_path / f"w{w}", workers=w, chunk_bytes=2048, shard_tokens=3000)
        for w in (0, 1, 2)
    ]
    assert len(outs[0].prefixes) > 2
    for out in outs[1:]:
        assert [p.name for p in out.prefixes] == [p.name for p in outs[0].prefixes]
        for mine, base in zip(out.prefixes, outs[0].prefixes):
            for suffix in (".bin", ".idx"):
                assert (mine.parent / (mine.name + suffix)).read_bytes() == (
                    base.parent / (base.name + suffix)
                ).read_bytes()


def test_shards_end_at_documents_and_add_up(mixed, tmp_path):
    corpus, docs, tok = mixed
    whole = tokenize_corpus(corpus, tok, tmp_path / "one", workers=0)
    cut = tokenize_corpus(corpus, tok, tmp_path / "cut", workers=0, shard_tokens=1000, dtype=np.int32)
    assert len(whole.prefixes) == 1 and len(cut.prefixes) > 3
    assert _documents(cut) == _documents(whole)
    for shard, ds in zip(cut.manifest["shards"], cut.datasets()):
        assert ds.num_documents == shard["documents"] and len(ds.tokens) == shard["tokens"]
        assert ds.tokens.dtype == np.int32
    assert all(s["tokens"] >= 1000 for s in cut.manifest["shards"][:-1])
    with pytest.raises(FileExistsError):
        tokenize_corpus(corpus, tok, tmp_path / "one", workers=0)


@pytest.mark.parametrize("workers", [0, 1])
def test_bad_record_in_a_worker_aborts_without_output(tmp_path, workers):
    good = [f"doc {i} " * 20 for i in range(400)]
    write_jsonl(tmp_path / "in" / "a.jsonl", good)
    write_jsonl(tmp_path / "in" / "b.jsonl", [*good[:250], {"txt": "oops"}, *good[:10]])
    tok = train_tokenizer(good, 300)
    with pytest.raises(CorpusError, match=r"b\.jsonl:251: no field 'text'"):
        tokenize_corpus(Corpus(tmp_path / "in"), tok, tmp_path / "out", workers=workers, chunk_bytes=1000)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]  # no temporary directory left either


def test_progress_bar_and_cache_key(mixed, tmp_path, capsys):
    corpus, _, tok = mixed
    tokenize_corpus(corpus, tok, tmp_path / "out", workers=0, progress=True)
    assert "tokenize" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    key = cache_key(manifest["corpus_fingerprint"], manifest["tokenizer_fingerprint"], dtype="uint16")
    assert key == cache_key(corpus.fingerprint(), tok.fingerprint(), dtype="uint16")
    assert key != cache_key(corpus.fingerprint(), tok.fingerprint(), dtype="int32")


def test_indexed_output_opens_with_the_reader(mixed, tmp_path):
    corpus, docs, tok = mixed
    out = tokenize_corpus(corpus, tok, tmp_path / "out", workers=0)
    ds = IndexedDataset(out.prefixes[0])
    assert ds.num_documents == len(docs)
    assert ds.document(len(docs) - 1).tolist()[-1] == tok.eos_id


def test_hugging_face_tokenizer_through_the_pipeline(mixed, tmp_path):
    corpus, docs, _ = mixed
    hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json", eos_token="</s>")
    out = tokenize_corpus(corpus, tok, tmp_path / "out", workers=0, chunk_bytes=1000)
    expected = [[*tok.tokenizer.encode(d, add_special_tokens=False).ids, 1] for d in docs]
    assert _documents(out) == expected  # no <s> (id 0) from its post-processor, </s> after each document
    assert out.manifest["eos_token"] == "</s>" and load_tokenizer(out.directory).eos_token == "</s>"
