"""Tokenizers of a corpus (`moe.trainer.data.tokenizer`): trained ones equal the trainer's, Hugging Face ones load from
a tokenizer.json file or a directory with their end-of-text token, the vocabulary check, saving with a run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moe.trainer.data import token_file as train_data
from moe.trainer.data.corpus import Corpus
from moe.trainer.data.tokenizer import (
    TokenizerError,
    load_tokenizer,
    resolve_tokenizer,
    tokenizer_key,
    train_tokenizer,
)
from moe.trainer.models.deepseek_v3.model_tokens import END_OF_TEXT
from moe.trainer.train.training_config import DataConfig
from tests.data.corpus_cases import SAMPLE, hf_tokenizer


def _reference_tokenizer(texts: list[str], vocab_size: int, kind: str):
    """The byte-level BPE the trainer has always built, spelled out with `tokenizers` (the reference)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size if kind == "bpe" else 257, min_frequency=2,
                                  special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


@pytest.mark.parametrize("kind", ["bpe", "bytes"])
def test_trained_tokenizer_equals_the_trainers_and_streams(kind):
    """Streamed from the corpus reader, the trained tokenizer equals the reference trained on the whole list (and
    the trainer's `moe.trainer.data.token_file.train_tokenizer` is the same)."""
    cfg = DataConfig(max_bytes=200_000, tokenizer=kind)
    texts, _ = train_data._read_corpus(cfg)
    ours = train_tokenizer(iter(Corpus("python-stdlib", max_bytes=200_000).texts()), 1024, kind)
    assert ours.tokenizer.to_str() == _reference_tokenizer(texts, 1024, kind).to_str()
    assert train_data.train_tokenizer(texts, 1024, kind).to_str() == ours.tokenizer.to_str()
    assert (ours.eos_token, ours.eos_id) == (END_OF_TEXT, 0)
    assert ours.vocab_size <= 1024


def test_max_bytes_caps_the_training_stream():
    texts = [f"word{i} " * 50 for i in range(100)]
    capped = train_tokenizer(texts, 600, max_bytes=len(texts[0]) * 10)
    assert capped.tokenizer.to_str() == train_tokenizer(texts[:10], 600).tokenizer.to_str()
    assert capped.tokenizer.to_str() != train_tokenizer(texts, 600).tokenizer.to_str()
    with pytest.raises(TokenizerError, match="vocab_size >= 257"):
        train_tokenizer(texts, 200)


def test_tokenizer_json_file_needs_an_eos_token(tmp_path):
    hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="no end-of-text token.*name one with eos_token"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="'<eos>' is not in its vocabulary"):
        load_tokenizer(tmp_path / "tokenizer.json", eos_token="<eos>")
    tok = load_tokenizer(tmp_path / "tokenizer.json", eos_token="</s>")
    assert (tok.eos_token, tok.eos_id) == ("</s>", 1)
    tokens, lengths = tok.encode_documents(["hello world", "data"])
    first = tok.tokenizer.encode("hello world", add_special_tokens=False).ids
    second = tok.tokenizer.encode("data", add_special_tokens=False).ids
    assert tokens.tolist() == [*first, 1, *second, 1]
    assert lengths.tolist() == [len(first) + 1, len(second) + 1]
    assert 0 not in tokens.tolist()  # no <s> from the post-processor


def test_tokenizer_directory_takes_eos_from_its_config(tmp_path):
    hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>", "special": True}}))
    tok = load_tokenizer(tmp_path)
    assert (tok.eos_token, tok.eos_id, tok.source) == ("</s>", 1, str(tmp_path))
    assert load_tokenizer(tmp_path / "tokenizer.json").eos_token == "</s>"  # a file finds its directory's config
    assert load_tokenizer(tmp_path, eos_token="<s>").eos_id == 0  # the argument wins


def test_directory_without_tokenizer_json_goes_through_auto_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    tok = train_tokenizer(SAMPLE, 300)
    tok.tokenizer.model.save(str(tmp_path))  # vocab.json + merges.txt: GPT-2's files
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": END_OF_TEXT})
    )
    loaded = load_tokenizer(tmp_path)
    assert (loaded.eos_token, loaded.eos_id) == (END_OF_TEXT, 0)
    for text in SAMPLE[:3]:
        assert loaded.tokenizer.encode(text, add_special_tokens=False).ids == tok.tokenizer.encode(text).ids
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizer"}))
    with pytest.raises(TokenizerError, match="AutoTokenizer cannot load it"):
        load_tokenizer(tmp_path)


def test_vocabulary_larger_than_the_model_is_refused(tmp_path):
    hf = hf_tokenizer(400)
    hf.save(str(tmp_path / "tokenizer.json"))
    n = hf.get_vocab_size()
    with pytest.raises(
        TokenizerError, match=rf"ids up to {n - 1} but the model's vocab_size is {n - 1}: set vocab_size >= {n}"
    ):
        resolve_tokenizer(tmp_path / "tokenizer.json", n - 1, eos_token="</s>")
    assert resolve_tokenizer(tmp_path / "tokenizer.json", n, eos_token="</s>").vocab_size == n
    with pytest.raises(TokenizerError, match="no such file"):
        resolve_tokenizer(tmp_path / "missing.json", 400)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"broken\.json: not a tokenizers JSON file"):
        load_tokenizer(tmp_path / "broken.json")


def test_save_round_trips_tokenizer_and_eos(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    hf_tokenizer().save(str(src / "tokenizer.json"))
    tok = load_tokenizer(src / "tokenizer.json", eos_token="</s>")
    path = tok.save(tmp_path / "run")
    assert path == tmp_path / "run" / "tokenizer.json"
    again = load_tokenizer(tmp_path / "run")  # the saved tokenizer_config.json names </s>
    assert again.fingerprint() == tok.fingerprint()
    ours = train_tokenizer(SAMPLE, 300)
    ours.save(tmp_path / "ours")
    assert not (tmp_path / "ours" / "tokenizer_config.json").exists()  # found by name: <|endoftext|>
    assert load_tokenizer(tmp_path / "ours").fingerprint() == ours.fingerprint()


def test_tokenizer_key_is_known_before_training(tmp_path):
    assert tokenizer_key("bpe", 1024) == tokenizer_key("bpe", 1024)
    assert len({tokenizer_key("bpe", 1024), tokenizer_key("bpe", 2048), tokenizer_key("bytes", 1024)}) == 3
    assert tokenizer_key("bpe", 1024, max_bytes=10) != tokenizer_key("bpe", 1024)
    hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    key = tokenizer_key(tmp_path / "tokenizer.json", 400, eos_token="</s>")
    assert key == load_tokenizer(tmp_path / "tokenizer.json", eos_token="</s>").fingerprint()
    assert key != tokenizer_key(tmp_path / "tokenizer.json", 400, eos_token="<s>")


def test_encode_documents_dtype_and_lengths():
    tok = train_tokenizer(SAMPLE, 500)
    tokens, lengths = tok.encode_documents(["", "a b", "ccc"], np.uint16)
    assert tokens.dtype == np.uint16 and lengths.dtype == np.int64
    assert tokens[0] == tok.eos_id and lengths[0] == 1  # an empty document is its end-of-text token
    assert lengths.sum() == tokens.size and tokens[np.cumsum(lengths) - 1].tolist() == [tok.eos_id] * 3
