"""Evaluate a DeepSeek-V3 checkpoint: mean next-token cross-entropy of a token array.

    python examples/deepseek_v3/evaluate.py --checkpoint RUN_DIR/checkpoints/step_N --tokens RUN_DIR/val_tokens.npy

`--tokens`: a `.npy` file holding an integer `[B, S]` array of token ids (int64, or any integer dtype whose values
fit). The last line printed is a JSON object: `"loss"` (the mean cross-entropy in FP32 over all `B * (S - 1)`
next-token positions, the main head only: MTP excluded), `"num_tokens"` (`B * (S - 1)`), and the checkpoint and
dtype used. One process; the model is built with all its experts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a model directory (e.g. RUN_DIR/checkpoints/step_N)")
    p.add_argument("--tokens", required=True, help=".npy file with an integer [B, S] array of token ids")
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
    from moe.models.deepseek_v3 import DeepseekV3ForCausalLM
    from moe.models.deepseek_v3.model_dir import read_model_dir

    try:
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        if not (Path(args.checkpoint) / "config.json").is_file():
            raise ValueError(f"--checkpoint {args.checkpoint}: not a model directory (no config.json)")
        first, second = read_model_dir(args.checkpoint)
        state_dict, config = (first, second) if isinstance(first, dict) else (second, first)
        tokens = load_token_array(args.tokens, config.vocab_size)
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
