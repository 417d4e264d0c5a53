"""Helpers of the indexed-data training tests: small Megatron indexed datasets of packed documents (ending in the
end-of-text id), written with the project's byte tokenizer, and a JSONL corpus of the same documents."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from moe.trainer.data.indexed import IndexedDatasetWriter
from moe.trainer.data.tokenizer import TextTokenizer, train_tokenizer
from tests.train.train_cases import WORDS


def byte_tokenizer(vocab_size: int = 512) -> TextTokenizer:
    """The byte-level tokenizer without merges ("bytes"): end-of-text id 0, no corpus needed."""
    return train_tokenizer((), vocab_size, "bytes")


def documents(num: int, seed: int) -> list[str]:
    """`num` short Python-looking documents (20-90 bytes: several per window of 32 tokens), deterministic."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))[:90] for _ in range(num)]


def write_dataset(prefix: Path, texts: list[str], tok: TextTokenizer) -> Path:
    """`prefix.bin` / `.idx`: one document per text, its bytes then the end-of-text id (Megatron's --append-eod)."""
    with IndexedDatasetWriter(prefix, np.uint16, overwrite=True) as writer:
        for text in texts:
            ids, _ = tok.encode_documents([text], np.uint16)
            writer.add_document(ids)
    return prefix


def write_blend(root: Path) -> tuple[list, Path]:
    """Two datasets (`a`: ~16 windows of 32 tokens, `b`: ~12) and the tokenizer directory; returns
    `(data_path [0.7, a, 0.3, b], tokenizer_dir)`. 8 steps of 8 sequences take `a` about 3 times over, so a
    resume at step 4 starts in the middle of an epoch."""
    root.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer()
    tok.save(root / "tokenizer")
    a = write_dataset(root / "a_text_document", documents(12, seed=1), tok)
    b = write_dataset(root / "b_text_document", documents(9, seed=2), tok)
    return [0.7, str(a), 0.3, str(b)], root / "tokenizer"


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return path
