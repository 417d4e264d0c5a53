"""Per-step metrics: `metrics.jsonl` (one JSON object per optimizer step, and the run's events) and the loss-curve
PNG.

A step record has no "kind" key; an event has one, and the step it happened at: "skip" (a step of
`iterations_to_skip`), "rewind" and "stop" (moe/trainer/train/rewind.py), "phase_times" and "slow_rank"
(moe/trainer/train/straggler.py). `read_metrics` returns the step records, `read_events` the events.

A step record's "mfu" (model FLOPs utilisation, `mfu`) is None when the run has no peak rate for its device; the
progress bar, the log lines, `loss_table` and the plot's title show it when it is there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moe.trainer.train.loggers import MetricLogger, scalars

METRICS = "metrics.jsonl"
LOSS_PNG = "loss.png"


def mfu(model_flops_per_token: float, tokens_per_s: float, peak_flops_per_rank: float, ranks: int) -> float:
    """Model FLOPs utilisation: the model FLOPs a second of training does (`model_flops_per_token` x `tokens_per_s`,
    the whole run's tokens) over the peak FLOP/s of the `ranks` ranks that share the work (`peak_flops_per_rank`:
    one rank's device, or one process on a CPU; moe/trainer/plan/peak.py)."""
    if not (peak_flops_per_rank > 0 and ranks > 0):
        raise ValueError(f"need a positive peak and rank count, got {peak_flops_per_rank} x {ranks}")
    return model_flops_per_token * tokens_per_s / (peak_flops_per_rank * ranks)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


class MetricsLog:
    """Appends one JSON line per step to `RUN_DIR/metrics.jsonl`, flushed at once (a crash loses nothing written).

    resume_step: keep the records of steps `<= resume_step` and drop later ones (steps after the checkpoint a run
        resumes from are trained again); None starts a new file.
    """

    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / METRICS
        kept = [r for r in _read_all(self.path) if r["step"] <= resume_step] if resume_step is not None else []
        with self.path.open("w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        """Append a step record or an event."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RunReport:
    """What a rank reports while it trains: on the main rank metrics.jsonl, the progress bar and its lines, and the
    same numbers to the run's loggers (TensorBoard, W&B: moe/trainer/train/loggers.py); on the others nothing. Tracks
    the last step reported (`done`): steps run again after a rewind are not reported twice.

    Args:
        run_dir: the run directory.
        total_steps: the run's last step.
        start_step: the step resumed from (0: a new run); later records of metrics.jsonl are dropped.
        log_every: a progress line every `log_every` steps (and at the last).
        main: whether this rank reports.
        loggers: where the main rank also writes every record and event (`moe.trainer.train.loggers.scalars` of it);
            closed with the report.
    """

    def __init__(self, run_dir: str | Path, *, total_steps: int, start_step: int, log_every: int, main: bool,
                 loggers: list[MetricLogger] | None = None) -> None:  # fmt: skip
        from tqdm.auto import tqdm

        self.main, self.total, self.log_every = main, total_steps, log_every
        self.loggers = list(loggers or ()) if main else []
        self.done = start_step
        self.log = MetricsLog(run_dir, resume_step=start_step) if main else None
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not main, unit="step", dynamic_ncols=True)

    def fresh(self, step: int) -> bool:
        """Whether `step` runs for the first time (not again after a rewind)."""
        return step > self.done

    def event(self, record: dict[str, Any], line: str | None = None) -> None:
        """Write an event (and print `line` above the bar)."""
        if self.main:
            self.log.write(record)
            for logger in self.loggers:
                logger.log(record["step"], scalars(record))
            if line:
                self.bar.write(line)

    def record(self, record: dict[str, Any]) -> None:
        """Write a step record, the first time the step runs."""
        step = record["step"]
        if not self.fresh(step):
            return
        self.event(record)
        if self.main:
            postfix = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}"}
            if record.get("mfu") is not None:
                postfix["mfu"] = _percent(record["mfu"])
            self.bar.set_postfix(postfix)
            if step % self.log_every == 0 or step == self.total:
                self.bar.write(_log_line(record))

    def advance(self, step: int) -> None:
        """Step `step` is over (run or skipped)."""
        if self.fresh(step):
            self.bar.update(1)
        self.done = max(self.done, step)

    def close(self) -> None:
        self.bar.close()
        if self.log is not None:
            self.log.close()
        for logger in self.loggers:
            logger.close()

    def plot(self, png_path: str | Path, title: str = "") -> None:
        """The loss plot of metrics.jsonl (main rank)."""
        if self.main:
            plot_loss(self.log.path, png_path, title=title)


def _log_line(r: dict[str, Any]) -> str:
    mtp = "" if r["mtp_loss"] is None else f" mtp {r['mtp_loss']:.4f}"
    imb = r["expert_load_max_over_mean"]
    worst = f" load max/mean <= {max(imb.values()):.2f}" if imb else ""
    mfu_text = "" if r.get("mfu") is None else f" mfu {_percent(r['mfu'])}"
    return (
        f"step {r['step']:>5} loss {r['loss']:.4f}{mtp} lr {r['lr']:.2e} grad_norm {r['grad_norm']:.3f} "
        f"{r['tokens_per_s']:.0f} tok/s{mfu_text}{worst}"
    )


def _read_all(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl (an empty list when it does not exist); events are left out."""
    return [r for r in _read_all(path) if "kind" not in r]


def read_events(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of a metrics.jsonl (those of `kind` only, when given), in the order they were written."""
    return [r for r in _read_all(path) if "kind" in r and (kind is None or r["kind"] == kind)]


def median_mfu(records: list[dict[str, Any]]) -> float | None:
    """The median MFU of the step records that carry one (None when none does): the median, because the first step
    and the checkpoint steps are slower than the rest."""
    values = sorted(r["mfu"] for r in records if r.get("mfu") is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def plot_title(records: list[dict[str, Any]], title: str = "") -> str:
    """The loss plot's title: `title` (or "training loss"), and the run's median MFU when the records carry it."""
    title = title or "training loss"
    value = median_mfu(records)
    return title if value is None else f"{title}\nMFU {_percent(value)} (median over {len(records)} steps)"


def plot_loss(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Draw the LM loss (and the MTP loss, when present) against the step into `png_path` (matplotlib, Agg); the
    title is `plot_title`'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path} holds no steps to plot")
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(steps, [r["loss"] for r in records], label="LM loss (global batch)", color="tab:blue")
    mtp = [r.get("mtp_loss") for r in records]
    if any(v is not None and math.isfinite(v) for v in mtp):
        ax.plot(steps, [math.nan if v is None else v for v in mtp], label="MTP loss", color="tab:orange", alpha=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(plot_title(records, title))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def loss_table(records: list[dict[str, Any]], first: int = 5, last: int = 5) -> str:
    """A small text table of the first and last steps (step, loss, mtp_loss, grad_norm, tokens/s, and MFU when the
    records carry it), then the median MFU of all the steps."""
    rows = records if len(records) <= first + last else records[:first] + [None] + records[-last:]
    with_mfu = median_mfu(records) is not None
    lines = [f"{'step':>6} {'loss':>8} {'mtp_loss':>9} {'grad_norm':>9} {'tokens/s':>9}" + (f" {'mfu':>6}" * with_mfu)]
    for r in rows:
        if r is None:
            lines.append(f"{'...':>6}")
            continue
        mtp = r.get("mtp_loss")
        lines.append(
            f"{r['step']:>6} {r['loss']:>8.4f} {'-' if mtp is None else f'{mtp:.4f}':>9} "
            f"{r['grad_norm']:>9.3f} {r['tokens_per_s']:>9.0f}" + (f" {_percent(r.get('mfu')):>6}" * with_mfu)
        )
    if with_mfu:
        lines.append(f"median MFU {_percent(median_mfu(records))} over {len(records)} steps")
    return "\n".join(lines)
