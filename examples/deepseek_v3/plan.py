"""Plan the parallel layout of a DeepSeek-V3 training run before running it (a SimuMax-like strategy search).

    python examples/deepseek_v3/plan.py --config examples/deepseek_v3/configs/671b.toml --devices 2048 \
        --device-spec h100 --top 10
    python examples/deepseek_v3/plan.py --config examples/deepseek_v3/configs/tiny.toml --devices 4 \
        --device-spec cpu --calibrate
    python examples/deepseek_v3/plan.py --list-devices
    python examples/deepseek_v3/plan.py --config examples/deepseek_v3/configs/671b.toml --device-spec b200 \
        --num-layers 4 --first-k-dense 1 --mtp-depths 0 --global-batch 32 --micro-batches 4 \
        --layout "tp1 pp2 ep4 dp4 1f1b zero1" --framework megatron-alltoall --json one.json

The command runs `moe.trainer.plan.cli.main` (moe/trainer/plan/cli.py: its options, checks and phases).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runs from any directory: the root holds the packages

from moe.trainer.plan import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.main())
