"""The trainer's tables (moe/trainer/train/training_config.py) and the learning-rate schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from moe.trainer.train.schedule import lr_at
from moe.trainer.train.training_config import TrainerConfig, TrainingConfig

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "configs"
BASE = {"steps": 10, "global_batch": 8, "seq_len": 16, "lr": 1e-3}


@pytest.mark.parametrize("name", ["tiny", "small", "671b"])
def test_shipped_configs_parse(name):
    cfg = TrainerConfig.from_toml(CONFIGS / f"{name}.toml")
    assert cfg.training.global_batch % cfg.training.micro_batches == 0
    assert cfg.to_tables()["data"]["corpus"] == "python-stdlib"
    assert cfg.training == TrainingConfig.from_toml(CONFIGS / f"{name}.toml")


def test_tiny_admits_every_layout_of_four_ranks():
    cfg = TrainingConfig.from_toml(CONFIGS / "tiny.toml")
    assert cfg.micro_batches >= 4 and cfg.dtype == "float32"
    for dp in (1, 2, 4):
        assert cfg.global_batch % (dp * cfg.micro_batches) == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"global_batch": 10, "micro_batches": 4}, "not divisible by micro_batches"),
        ({"min_lr": 1.0}, "min_lr"),
        ({"dtype": "float16"}, "dtype"),
        ({"seq_len": 1}, "seq_len"),
        ({"betas": [0.9]}, "betas"),
        ({"clip_grad": -1.0}, "clip_grad"),
        ({"steps": 0}, "steps"),
        ({"data": {"tokenizer": "wordpiece"}}, "tokenizer"),
        ({"data": {"corpus_path": "x"}}, "unknown keys"),
    ],
)
def test_bad_training_tables_raise(change, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig.flat(**{**BASE, **change})


def test_unknown_and_missing_keys_name_their_table():
    with pytest.raises(ValueError, match=r"\[optimizer\] is missing \['lr'\]"):
        TrainerConfig.flat(steps=3, global_batch=2, seq_len=8)
    with pytest.raises(ValueError, match=r"\[training\]: unknown keys \['lr_warmup'\]"):
        TrainerConfig.flat(**BASE, lr_warmup=3)


def test_missing_table(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nvocab_size = 3\n")
    with pytest.raises(ValueError, match=r"no \[training\] table"):
        TrainingConfig.from_toml(path)


def test_schedule_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert [lr_at(s, **kw) for s in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])
    # Half-way through the decay the cosine is at its midpoint; at the end it is min_lr.
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    with pytest.raises(ValueError):
        lr_at(0, **kw)


def test_schedule_without_warmup_starts_at_peak():
    assert lr_at(1, lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=1000) == pytest.approx(2.0, rel=1e-4)
