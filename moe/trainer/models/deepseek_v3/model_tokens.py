"""The tokens of a model directory: its end-of-text id and its tokenizer.

- `eos_token_id(dir)`: `config.json`'s `eos_token_id` (transformers' key, which `hf.py import` keeps and `export`
  writes), else the id of the project tokenizer's end-of-text token `<|endoftext|>` in the directory's
  `tokenizer.json` (the trainer copies its tokenizer into every checkpoint, moe/trainer/data/token_file.py), else None.
- `load_tokenizer(dir)`: the directory's `tokenizer.json` as a Hugging Face `tokenizers.Tokenizer` (optional
  package, imported when text is encoded or decoded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe.trainer.models.deepseek_v3.model_dir import CONFIG_FILE

# the project tokenizer's one special token (moe/trainer/data/token_file.py trains it as id 0)
END_OF_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


def config_eos_token_id(config_dict: dict[str, Any], source: str = "config.json") -> int | None:
    """The `eos_token_id` of a config.json dict: an int, a one-element list of one, or None when absent or null.
    ValueError for anything else (several end ids: generation stops on one)."""
    value = config_dict.get("eos_token_id")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}: eos_token_id must be one non-negative int, got {value!r}")
    return value


def tokenizer_eos_token_id(path: str | Path) -> int | None:
    """The id of `END_OF_TEXT` among the added tokens of the tokenizer file `path` (None if it has none). Reads the
    JSON itself: no `tokenizers` needed."""
    with open(path) as f:
        doc = json.load(f)
    for token in doc.get("added_tokens") or []:
        if token.get("content") == END_OF_TEXT:
            return int(token["id"])
    return None


def eos_token_id(model_dir: str | Path) -> int | None:
    """The end-of-text id of a model directory or checkpoint (see the module docstring for the order)."""
    model_dir = Path(model_dir)
    config_path = model_dir / CONFIG_FILE
    if config_path.is_file():
        with open(config_path) as f:
            found = config_eos_token_id(json.load(f), str(config_path))
        if found is not None:
            return found
    tokenizer_path = model_dir / TOKENIZER_FILE
    return tokenizer_eos_token_id(tokenizer_path) if tokenizer_path.is_file() else None


def load_tokenizer(model_dir: str | Path):
    """`tokenizers.Tokenizer` of `model_dir/tokenizer.json`; ValueError when the file is absent (text prompts need
    it: give token ids instead), ImportError's message when `tokenizers` is not installed."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"{model_dir} has no {TOKENIZER_FILE}: text prompts need one (give token ids instead)")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
