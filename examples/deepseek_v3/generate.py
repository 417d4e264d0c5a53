"""Generate text with a DeepSeek-V3 checkpoint: cached (MLA latent) decoding, on one process or expert-parallel.

    python examples/deepseek_v3/generate.py --checkpoint RUN_DIR/checkpoints/step_N --prompt "def " \
        --max-new-tokens 64 --greedy
    python examples/deepseek_v3/generate.py --checkpoint MODEL_DIR --prompt-ids "1,2,3" --prompt-ids "4,5" \
        --temperature 0.8 --top-p 0.95 --seed 0 --output-json out.json
    torchrun --nproc-per-node 4 examples/deepseek_v3/generate.py --checkpoint MODEL_DIR --ep 4 --dtype bfloat16 \
        --prompt-ids "1,2,3" --prompt-ids "4,5" ... [--fp8-dispatch] [--overlap --timeline /tmp/step]

The command runs `moe.trainer.models.deepseek_v3.generate_cli.main` (its options, checks and phases).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from any directory: the root holds the packages

from moe.trainer.models.deepseek_v3 import generate_cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(generate_cli.main())
