"""metrics.jsonl (resume keeps the steps up to the checkpoint), the loss plot, and each step's MFU in the record, the
log line, the summary table and the plot's title."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe.trainer.data.token_file import TokenBatches
from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.flops import model_flops_per_token
from moe.trainer.plan.peak import device_peak
from moe.trainer.train.checkpoint import ModelIO
from moe.trainer.train.metrics import (
    MetricsLog,
    _log_line,
    loss_table,
    median_mfu,
    mfu,
    plot_loss,
    plot_title,
    read_metrics,
)
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.trainer import Trainer
from moe.trainer.train.training_config import TrainerConfig
from tests.train import train_cases as tc


def _record(step, loss, mfu=None):
    record = {"step": step, "loss": loss, "mtp_loss": loss + 0.1, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0}
    return record if mfu is None else {**record, "mfu": mfu}


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.write(_record(step, 5.0 - step / 10))
    log.close()
    log = MetricsLog(tmp_path, resume_step=3)
    log.write(_record(4, 1.0))
    log.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 4.9), (2, 4.8), (3, 4.7), (4, 1.0)
    ]  # fmt: skip


def test_new_run_starts_a_new_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    MetricsLog(tmp_path).close()
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_plot_and_table(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 21):
        log.write(_record(step, 6.0 / step))
    log.close()
    png = plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = loss_table(read_metrics(tmp_path / "metrics.jsonl"), first=2, last=2)
    lines = table.splitlines()
    assert len(lines) == 6 and lines[3].strip() == "..." and lines[-1].split()[:2] == ["20", "0.3000"]
    assert "mfu" not in table.lower() and plot_title(read_metrics(tmp_path / "metrics.jsonl"), "t") == "t"


def test_mfu_formula():
    # 1 MFLOP per token at 1000 tokens/s = 1 GFLOP/s, over 2 ranks of 1 GFLOP/s each
    assert mfu(1e6, 1000.0, 1e9, 2) == 0.5
    with pytest.raises(ValueError, match="positive peak"):
        mfu(1e6, 1000.0, 0.0, 2)


def test_mfu_in_log_line_table_and_title(tmp_path):
    records = [_record(step, 6.0 / step, mfu=0.1 * step) for step in range(1, 6)]  # 10% .. 50%: median 30%
    for r in records:
        r["expert_load_max_over_mean"] = {}
    assert median_mfu(records) == pytest.approx(0.3) and median_mfu(records[:4]) == pytest.approx(0.25)
    assert "100 tok/s mfu 20.0%" in _log_line(records[1])
    table = loss_table(records, first=1, last=1).splitlines()
    assert table[0].split()[-1] == "mfu" and table[1].split()[-1] == "10.0%" and table[3].split()[-1] == "50.0%"
    assert table[-1] == "median MFU 30.0% over 5 steps"
    assert plot_title(records, "tiny") == "tiny\nMFU 30.0% (median over 5 steps)"
    log = MetricsLog(tmp_path)
    for r in records:
        log.write(r)
    log.close()
    assert plot_loss(tmp_path / "metrics.jsonl", tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def _trainer(tmp_path, **mfu_args) -> Trainer:
    """tiny's model on random tokens, 2 steps of 4 sequences of 16 (one process)."""
    cfg = DeepseekV3Config.from_toml(tc.TINY)
    train_cfg = TrainerConfig.flat(steps=2, global_batch=4, micro_batches=2, seq_len=16, lr=3e-3, log_every=1)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 4000).astype(np.int64)
    batches = TokenBatches(tokens, seq_len=16, global_batch=4, val_sequences=0, seed=0)
    io = ModelIO(model.full_state_dict, lambda path, sd: path.mkdir(), lambda path: None)  # the last step's export
    tmp_path.mkdir()
    return Trainer(model, train_cfg, ParallelState.single(), batches, tmp_path, seed=0, model_io=io,
                   mtp_loss_weight=cfg.mtp_loss_weight, num_mtp=cfg.num_nextn_predict_layers, **mfu_args)  # fmt: skip


def test_trainer_records_mfu(tmp_path, capsys):
    """Each step's record carries its MFU, in (0, 1], from the caller's FLOPs per token and peak; the log line
    shows it; without the figures the records say None. One intra-op thread, as the training ranks run (two threads
    of one process wait for each other on a busy machine), for the peak and the steps alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_trainer_mfu(tmp_path, capsys)
    finally:
        torch.set_num_threads(threads)


def _check_trainer_mfu(tmp_path, capsys) -> None:
    flops = model_flops_per_token(DeepseekV3Config.from_toml(tc.TINY), 16)
    peak = device_peak("cpu", "float32").flops_per_s
    records = _trainer(tmp_path / "a", model_flops_per_token=flops, peak_flops_per_rank=peak).fit()
    for r in records:
        assert 0 < r["mfu"] <= 1
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_s"] / peak, rel=1e-12)
    assert [r["mfu"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl")] == [r["mfu"] for r in records]
    assert "mfu " in capsys.readouterr().out  # the log line of every step (log_every 1)
    assert all(r["mfu"] is None for r in _trainer(tmp_path / "b").fit())
    with pytest.raises(ValueError, match="both"):
        _trainer(tmp_path / "c", model_flops_per_token=flops)
