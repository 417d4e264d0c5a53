"""Evaluate a DeepSeek-V3 checkpoint: mean next-token cross-entropy of a token array, or of a text corpus.

Usage: examples/deepseek_v3/evaluate.py, the command line that runs `main`.

`--tokens`: a `.npy` file holding an integer `[B, S]` array of token ids (int64, or any integer dtype whose values
fit). `--text`: a corpus (a file, a directory or a glob of .txt/.md/.py/.jsonl/.jsonl.gz/.parquet, `--text-field`
for JSONL/parquet) tokenized with the checkpoint's own tokenizer (the run's, which the trainer saves into every
checkpoint), each document followed by its end-of-text id, packed and cut into windows of `--seq-len` tokens (the
tail shorter than a window dropped), as the trainer does. The last line printed is a JSON object: `"loss"` (the
mean cross-entropy in FP32 over all `B * (S - 1)` next-token positions, the main head only: MTP excluded),
`"num_tokens"` (`B * (S - 1)`), and the checkpoint and dtype used. One process; the model is built with all its experts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from moe.trainer.data.corpus import Corpus
from moe.trainer.data.tokenizer import load_tokenizer
from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_dir import read_model_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a model directory (e.g. RUN_DIR/checkpoints/step_N)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", help=".npy file with an integer [B, S] array of token ids")
    source.add_argument("--text", help="a corpus file, directory or glob, tokenized with the checkpoint's tokenizer")
    p.add_argument("--text-field", default="text", help="the JSONL key / parquet column of --text's documents")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window of --text")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameters and activations")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    return p.parse_args(argv)


def load_token_array(path: str | Path, vocab_size: int) -> torch.Tensor:
    """`[B, S] int64` token ids from a .npy file; ValueError for a missing file, a wrong shape or dtype, or ids
    outside `[0, vocab_size)`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokens {path}: no such file")
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.ndim != 2 or array.shape[1] < 2 or array.shape[0] < 1:
        raise ValueError(f"--tokens {path}: expected a [B, S] array with S >= 2, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"--tokens {path}: expected integer token ids, got dtype {array.dtype}")
    tokens = torch.from_numpy(np.array(array, dtype=np.int64))  # a writable copy
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"--tokens {path}: ids span [{low}, {high}], outside the vocabulary [0, {vocab_size})")
    return tokens


def text_windows(checkpoint: str | Path, source: str, *, text_field: str, seq_len: int,
                 vocab_size: int) -> torch.Tensor:  # fmt: skip
    """`[B, seq_len] int64`: the documents of `source` encoded by the checkpoint's tokenizer, each followed by its
    end-of-text id, packed and cut into windows. ValueError (CorpusError / TokenizerError name the file and line)
    for a checkpoint without a tokenizer, bad input, or fewer tokens than one window."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    if not (Path(checkpoint) / "tokenizer.json").is_file():
        raise ValueError(f"--checkpoint {checkpoint}: has no tokenizer.json (the run's tokenizer); use --tokens")
    tok = load_tokenizer(checkpoint)
    tok.check_vocab(vocab_size)
    parts = [tok.encode_documents(texts, np.int64)[0] for texts in _batches(Corpus(source, text_field=text_field))]
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    rows = stream.size // seq_len
    if rows == 0:
        raise ValueError(f"--text {source}: {stream.size} tokens, fewer than one window of --seq-len {seq_len}")
    return torch.from_numpy(stream[: rows * seq_len].reshape(rows, seq_len).copy())


def _batches(corpus, size: int = 256):
    batch = []
    for text in corpus.texts():
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens_BS: torch.Tensor, batch_size: int) -> dict[str, float | int]:
    """Mean next-token cross-entropy of `tokens_BS` (the model's FP32 loss sums, accumulated in float64)."""
    model.eval()
    total, count = 0.0, 0
    for chunk in tokens_BS.split(batch_size):
        out = model(chunk, labels=chunk)
        total += float(out.lm_loss_sum.double())
        count += int(out.num_tokens)
    expected = tokens_BS.size(0) * (tokens_BS.size(1) - 1)
    if count != expected:
        raise RuntimeError(f"the model counted {count} targets, expected B * (S - 1) = {expected}")
    return {"loss": total / count, "num_tokens": count}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        if not (Path(args.checkpoint) / "config.json").is_file():
            raise ValueError(f"--checkpoint {args.checkpoint}: not a model directory (no config.json)")
        first, second = read_model_dir(args.checkpoint)
        state_dict, config = (first, second) if isinstance(first, dict) else (second, first)
        if args.tokens is not None:
            tokens = load_token_array(args.tokens, config.vocab_size)
        else:
            tokens = text_windows(args.checkpoint, args.text, text_field=args.text_field, seq_len=args.seq_len,
                                  vocab_size=config.vocab_size)  # fmt: skip
    except ValueError as exc:
        print(f"evaluate.py: error: {exc}", file=sys.stderr)
        return 2
    model = DeepseekV3ForCausalLM(config, dtype=DTYPES[args.dtype])
    model.load_full_state_dict(state_dict)
    result = evaluate(model, tokens, args.batch_size)
    print(json.dumps({**result, "checkpoint": str(args.checkpoint), "dtype": args.dtype, "shape": list(tokens.shape)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
