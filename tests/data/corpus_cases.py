"""Small generated corpora for the tests of `moe.trainer.data` (one of every text format, whose documents are known) and
a Hugging Face style tokenizer."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SAMPLE = ["hello world, the data is here", "über größe naïve 日本語", "def f(x):\n    return x + 1\n"] * 40
WORDS = ["def", "return", "the", "data", "naïve", "über", "größe", "日本語", "token", "\n", "  ", "(", ")", ":", "="]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_mixed_corpus(root: Path, seed: int = 0) -> list[str]:
    """A directory with .txt, .md, .py, .jsonl and .jsonl.gz files, a __pycache__ and a hidden directory (both
    skipped) and a `tests/` folder (data: kept); returns the documents in corpus order."""
    rng = random.Random(seed)
    docs: dict[str, list[str]] = {}

    def whole(rel: str, body: str) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
        docs[rel] = [body]

    def records(rel: str, bodies: list[str], *, gz: bool = False, blank_at: int | None = None) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"id": i, "text": b}) for i, b in enumerate(bodies)]
        if blank_at is not None:
            lines.insert(blank_at, "")
        data = ("\n".join(lines) + "\n").encode()
        path.write_bytes(gzip.compress(data) if gz else data)
        docs[rel] = bodies

    whole("a.txt", text(rng, 40))
    whole("b/notes.md", "# title\n" + text(rng, 30))
    whole("b/mod.py", "def f():\n    return 1\n" + text(rng, 20))
    whole("b/empty.py", "")  # an empty .py is a package marker: an empty document
    whole("tests/case.txt", text(rng, 25))
    records("data/part-0.jsonl", [text(rng, rng.randint(0, 30)) for _ in range(7)], blank_at=3)
    records("data/part-1.jsonl.gz", [text(rng, rng.randint(1, 30)) for _ in range(9)], gz=True)
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.txt").write_text("skipped")
    (root / ".git").mkdir()
    (root / ".git" / "y.txt").write_text("skipped")
    (root / "image.png").write_bytes(b"\x89PNG")  # not a corpus format: a directory search leaves it out
    return [d for rel in sorted(docs) for d in docs[rel]]


def write_jsonl(path: Path, records: list, field: str = "text") -> None:
    """Records as JSONL: a str becomes {field: str}; anything else is written as its JSON (bad input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({field: r} if isinstance(r, str) else r) for r in records]
    path.write_text("\n".join(lines) + "\n")


def hf_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """A BPE tokenizer as Hugging Face models ship them: `<s>` / `</s>` specials and a post-processor that adds
    `<s>` (which pretraining data must not get)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok
