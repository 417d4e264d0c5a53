"""Smoke test of `bench/train_step.py --trainer-only --ranks 4`, run as a user runs it: the trainer with EP 4 against
transformers' model under DistributedDataParallel, 4 gloo processes, one timed step per side (no warm-up, no
profiled step). Checks that both sides ran on every rank, and the first step's parity: the same initial weights and
the same global batch give the same loss and gradient norm (FP32, another order of the same sums; measured ~2e-8 and
~2e-7, the script's bound 1e-4)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "train_step.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: 4 processes import transformers and build 2 models


def test_trainer_vs_ddp_four_ranks_runs_one_step(tmp_path):
    out = tmp_path / "train_step_ranks4.json"
    argv = [sys.executable, str(BENCH), "--trainer-only", "--ranks", "4", "--trainer-iters", "1",
            "--trainer-warmup", "0", "--trainer-top", "0", "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trainer = json.loads(out.read_text())["trainer"]
    assert trainer["ranks"] == 4 and trainer["layout"]["ep"] == 4 and trainer["layout"]["world"] == 4
    for side in ("trainer", "transformers"):
        assert len(trainer["per_rank_seconds"][side]) == 4 and min(trainer["per_rank_seconds"][side]) > 0
        assert len(trainer["samples"][side]) == 1
    first = trainer["first_step"]
    assert math.isfinite(first["trainer"]["loss"]) and abs(first["trainer"]["loss"] - math.log(512)) < 1.0
    assert max(trainer["parity"].values()) < 1e-4, trainer["parity"]
