"""Evaluate a DeepSeek-V3 checkpoint: mean next-token cross-entropy of a token array, or of a text corpus.

    python examples/deepseek_v3/evaluate.py --checkpoint RUN_DIR/checkpoints/step_N --tokens RUN_DIR/val_tokens.npy
    python examples/deepseek_v3/evaluate.py --checkpoint RUN_DIR/checkpoints/step_N --text held_out.jsonl --seq-len 128

The command runs `moe.trainer.train.evaluate.main` (moe/trainer/train/evaluate.py: its options, checks and phases).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from any directory: the root holds the packages

from moe.trainer.train import evaluate  # noqa: E402

if __name__ == "__main__":
    sys.exit(evaluate.main())
