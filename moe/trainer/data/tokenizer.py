"""The tokenizer of a corpus: trained on it ("bpe", "bytes") or loaded from local files, checked against the model's
vocabulary, and saved with a run.

- "bpe": byte-level BPE trained with Hugging Face `tokenizers` to the model's vocab_size, over a stream of the
  corpus's documents (`train_from_iterator`: the trainer keeps word counts, never the corpus), optionally only the
  first `max_bytes` of it. "bytes": the byte-level alphabet and no merges (needs no corpus). Both have
  `END_OF_TEXT` as id 0, the same tokenizer as `moe/trainer/data/token_file.py` trains.
- A path: a `tokenizer.json` file, or a Hugging Face tokenizer directory (its `tokenizer.json` through `tokenizers`;
  without one, `transformers.AutoTokenizer` with `local_files_only=True`, which must give a fast tokenizer).
  Its end-of-text token: the `eos_token` argument, else `eos_token` of `tokenizer_config.json` /
  `special_tokens_map.json` beside it, else `<|endoftext|>` if the vocabulary has it, else an error.
- Documents are encoded without the tokenizer's own special tokens (`add_special_tokens=False`: no BOS of a chat
  template) and each is followed by the end-of-text id, Megatron's convention for pretraining data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe.trainer.io.atomic import write_bytes, write_json
from moe.trainer.models.deepseek_v3.model_tokens import END_OF_TEXT, TOKENIZER_FILE

TRAINED = ("bpe", "bytes")
BYTE_ALPHABET = 256
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class TokenizerError(ValueError):
    """A tokenizer that cannot serve the corpus or the model; the message names the file or setting."""


@dataclass
class TextTokenizer:
    """A `tokenizers.Tokenizer` with the end-of-text token that separates documents.

    tokenizer: the Hugging Face `tokenizers.Tokenizer`.
    eos_token / eos_id: the end-of-text token and its id.
    source: "bpe", "bytes" or the path it was loaded from (for messages).
    """

    tokenizer: Any
    eos_token: str
    eos_id: int
    source: str

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce (its added tokens included)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def check_vocab(self, vocab_size: int) -> None:
        """TokenizerError unless every id of the tokenizer is below the model's `vocab_size`."""
        needed = self.vocab_size
        if needed > vocab_size:
            raise TokenizerError(
                f"tokenizer {self.source} has ids up to {needed - 1} but the model's vocab_size is {vocab_size}: "
                f"set vocab_size >= {needed}"
            )

    def encode_documents(self, texts: list[str], dtype: np.dtype | type = np.int32) -> tuple[np.ndarray, np.ndarray]:
        """(tokens `[T] dtype`, lengths `[len(texts)] int64`): each document's ids followed by `eos_id`, all
        concatenated; `lengths[i]` counts document i's tokens with its end-of-text token."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)  # fast: no offsets
        flat: list[int] = []
        lengths = np.empty(len(texts), dtype=np.int64)
        for i, e in enumerate(encode(texts, add_special_tokens=False)):
            ids = e.ids  # a new list per access
            flat.extend(ids)
            flat.append(self.eos_id)
            lengths[i] = len(ids) + 1
        return np.array(flat, dtype=dtype), lengths

    def fingerprint(self) -> str:
        """sha256 (hex) of the tokenizer's full JSON and its end-of-text token: equal iff it encodes the same."""
        doc = self.tokenizer.to_str() + "\0" + self.eos_token + "\0add_special_tokens=False"
        return hashlib.sha256(doc.encode()).hexdigest()

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer into `directory` as `tokenizer.json` (atomically) and return its path. When its
        end-of-text token is not `<|endoftext|>`, also a `tokenizer_config.json` naming it, so that
        `load_tokenizer(directory)` (and `transformers.AutoTokenizer`) find the same end-of-text token."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / TOKENIZER_FILE
        write_bytes(path, self.tokenizer.to_str().encode())
        if self.eos_token != END_OF_TEXT:
            write_json(
                directory / "tokenizer_config.json",
                {"eos_token": self.eos_token, "tokenizer_class": "PreTrainedTokenizerFast"},
            )
        return path


def capped(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """`texts` until their UTF-8 sizes reach `max_bytes` (the last one whole; None: all)."""
    total = 0
    for text in texts:
        if max_bytes is not None and total >= max_bytes:
            return
        total += len(text.encode("utf-8"))
        yield text


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, kind: str = "bpe", *, max_bytes: int | None = None, progress: bool = False
) -> TextTokenizer:
    """A byte-level tokenizer with `END_OF_TEXT` as id 0: BPE merges learnt from `texts` up to `vocab_size` ("bpe"),
    or none ("bytes", which reads no text). `texts` is consumed once, as a stream; `max_bytes` caps it. Every id is
    below `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind not in TRAINED:
        raise TokenizerError(f"tokenizer kind must be one of {TRAINED}, got {kind!r}")
    if vocab_size < BYTE_ALPHABET + 1:
        raise TokenizerError(f"a byte-level tokenizer needs vocab_size >= {BYTE_ALPHABET + 1}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size if kind == "bpe" else BYTE_ALPHABET + 1,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(capped(texts, max_bytes) if kind == "bpe" else iter(()), trainer)
    out = TextTokenizer(tok, END_OF_TEXT, tok.token_to_id(END_OF_TEXT), kind)
    out.check_vocab(vocab_size)  # the trainer counts the special token inside vocab_size; check anyway
    return out


def _config_eos(directory: Path) -> tuple[str, Path] | None:
    for name in CONFIG_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise TokenizerError(f"{path}: not a JSON object ({e})") from None
        if isinstance(value, dict):  # transformers' AddedToken form
            value = value.get("content")
        if value is not None:
            if not isinstance(value, str):
                raise TokenizerError(f"{path}: eos_token must be a string, got {value!r}")
            return value, path
    return None


def load_tokenizer(path: str | os.PathLike, *, eos_token: str | None = None) -> TextTokenizer:
    """The tokenizer of a `tokenizer.json` file or a Hugging Face tokenizer directory (local files only), with its
    end-of-text token (module docstring). TokenizerError names the path when it is missing, unreadable, slow-only,
    or has no end-of-text token."""
    path = Path(path)
    if path.is_dir():
        directory, file = path, path / TOKENIZER_FILE
    elif path.is_file():
        directory, file = path.parent, path
    else:
        raise TokenizerError(f"tokenizer {str(path)!r}: no such file or directory (or use 'bpe' or 'bytes')")
    found = _config_eos(directory)
    if file.is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise TokenizerError(f"{file}: not a tokenizers JSON file ({e})") from None
    else:
        tok, auto_eos = _auto_tokenizer(directory)
        if found is None and auto_eos is not None:
            found = auto_eos, directory
    if eos_token is None:
        if found is not None:
            eos_token = found[0]
        elif tok.token_to_id(END_OF_TEXT) is not None:
            eos_token = END_OF_TEXT
        else:
            raise TokenizerError(
                f"tokenizer {path}: no end-of-text token (no eos_token in {' / '.join(CONFIG_FILES)}, no "
                f"{END_OF_TEXT} in its vocabulary); name one with eos_token"
            )
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise TokenizerError(f"tokenizer {path}: its end-of-text token {eos_token!r} is not in its vocabulary")
    return TextTokenizer(tok, eos_token, eos_id, str(path))


def _auto_tokenizer(directory: Path) -> tuple[Any, str | None]:
    """`transformers.AutoTokenizer` of a directory without tokenizer.json: its fast backend and eos token."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerError(
            f"tokenizer {directory}: has no {TOKENIZER_FILE}; loading other formats needs transformers"
        ) from None
    try:
        auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError by cause; all mean "cannot load"
        raise TokenizerError(f"tokenizer {directory}: transformers.AutoTokenizer cannot load it ({e})") from None
    if not getattr(auto, "is_fast", False):
        raise TokenizerError(f"tokenizer {directory}: {type(auto).__name__} is not a fast (tokenizers) tokenizer")
    return auto.backend_tokenizer, auto.eos_token


def resolve_tokenizer(
    spec: str | os.PathLike,
    vocab_size: int,
    *,
    texts: Iterable[str] | None = None,
    eos_token: str | None = None,
    max_bytes: int | None = None,
    progress: bool = False,
) -> TextTokenizer:
    """The tokenizer a run asks for, checked against the model's `vocab_size` (TokenizerError otherwise).

    spec: "bpe" / "bytes" (trained: "bpe" on `texts`, a stream of the corpus's documents, e.g. `Corpus.texts()`,
        capped at `max_bytes`) or a path (`load_tokenizer`, with `eos_token`).
    """
    if str(spec) in TRAINED:
        if eos_token not in (None, END_OF_TEXT):
            raise TokenizerError(f"a trained tokenizer's end-of-text token is {END_OF_TEXT!r}, got {eos_token!r}")
        if str(spec) == "bpe" and texts is None:
            raise TokenizerError("a 'bpe' tokenizer is trained on the corpus: pass its texts")
        return train_tokenizer(texts or (), vocab_size, str(spec), max_bytes=max_bytes, progress=progress)
    tok = load_tokenizer(spec, eos_token=eos_token)
    tok.check_vocab(vocab_size)
    return tok


def tokenizer_key(
    spec: str | os.PathLike, vocab_size: int, *, eos_token: str | None = None, max_bytes: int | None = None
) -> str:
    """A sha256 (hex) of what decides the tokens, known before any training (a cache key's part with the corpus
    fingerprint): the settings and the `tokenizers` version for a trained tokenizer (its training is
    deterministic given the corpus), the loaded tokenizer's `fingerprint()` for a path."""
    import tokenizers

    if str(spec) in TRAINED:
        settings = {"kind": str(spec), "vocab_size": vocab_size, "tokenizers": tokenizers.__version__}
        if str(spec) == "bpe":
            settings["max_bytes"] = max_bytes
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return load_tokenizer(spec, eos_token=eos_token).fingerprint()
