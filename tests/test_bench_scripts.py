"""The benchmark scripts run as `python bench/NAME.py`, which puts `bench/` first on `sys.path`: a script named like a
standard-library module (`tokenize`, `profile`, `trace`, ...) would shadow it for every other script (torch's import
reads `tokenize` through `linecache`, so they would all fail at `import torch`)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_script_shadows_the_standard_library():
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "decode" in names and "low_latency" in names  # the scan sees the scripts
    assert [n for n in names if n in sys.stdlib_module_names] == []


def test_short_run_puts_each_key_in_its_table():
    """bench/_common.py's short run (bench/train_layouts.py's and bench/plan_check.py's) of a config in the
    trainer's tables and of one in the old flat layout: train.py's config tree reads both (a key in [training] and
    in its table is refused)."""
    import tomllib

    from moe.trainer.train.training_config import TrainerConfig

    sys.path.insert(0, str(BENCH))
    from _common import short_run

    small = tomllib.loads((BENCH.parent / "examples" / "deepseek_v3" / "configs" / "small.toml").read_text())
    assert small["optimizer"]["warmup_steps"] > 1 and small["checkpoint"]["checkpoint_every"] > 0
    flat = {name: table for name, table in small.items() if name not in ("optimizer", "checkpoint")}
    flat["training"] = {**small["training"], **small["optimizer"], **small["checkpoint"]}  # the old layout
    for doc in (small, flat):
        config = TrainerConfig.from_tables(short_run(doc, global_batch=2, micro_batches=1, steps=2, dtype="bfloat16"))
        assert (config.training.global_batch, config.training.steps, config.training.dtype) == (2, 2, "bfloat16")
        assert (config.optimizer.warmup_steps, config.checkpoint.checkpoint_every) == (1, 0)
        assert config.optimizer.lr == small["optimizer"]["lr"]
