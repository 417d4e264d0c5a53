"""metrics.jsonl (resume keeps the steps up to the checkpoint) and the loss plot."""

from __future__ import annotations

from moe.train.metrics import MetricsLog, loss_table, plot_loss, read_metrics


def _record(step, loss):
    return {"step": step, "loss": loss, "mtp_loss": loss + 0.1, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0}


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
