"""Train DeepSeek-V3 (MLA, DeepSeekMoE with aux-loss-free balancing, MTP) on mtdeepep.

    python examples/deepseek_v3/train.py --config examples/deepseek_v3/configs/tiny.toml --out runs/tiny
    torchrun --nproc-per-node 4 examples/deepseek_v3/train.py --config ... --out runs/tiny-ep4 --ep 4
    torchrun --nproc-per-node 4 examples/deepseek_v3/train.py --config ... --out runs/tiny-tp2-ep2 --tp 2 --ep 2 \
        --use-distributed-optimizer
    torchrun --nproc-per-node 4 examples/deepseek_v3/train.py --config ... --out runs/tiny-pp2-ep2 --pp 2 --ep 2 \
        --pp-schedule dualpipev --overlap-moe-expert-parallel-comm --pipeline-timeline

The command runs `moe.trainer.run.main` (moe/trainer/run.py: its options, checks and phases).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from any directory: the root holds the packages

from moe.trainer import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run.main())
