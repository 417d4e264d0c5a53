"""Where a run's metrics go besides metrics.jsonl: TensorBoard and Weights & Biases, on the main rank.

The `[metrics]` table of the config tree, with Megatron's option names (the command-line aliases are Megatron's
flags) and torchtitan's as alternatives:

```toml
[metrics]
tensorboard_dir = "runs/x/tb"   # Megatron's --tensorboard-dir: TensorBoard event files go here
# enable_tensorboard = true     # torchtitan's: the same, into RUN_DIR/<save_tb_folder>
# save_tb_folder = "tb"
wandb_project = "dsv3"          # Megatron's --wandb-project: log to Weights & Biases (the `wandb` package)
wandb_exp_name = "tiny-ep4"     # --wandb-exp-name (default: the run directory's name)
wandb_save_dir = "/scratch/wb"  # --wandb-save-dir (default: RUN_DIR/wandb, as Megatron's <save>/wandb)
# enable_wandb = true           # torchtitan's: W&B with project $WANDB_PROJECT, else "mtdeepep"
```

What is logged (`scalars`): every number of every metrics.jsonl step record under its own key ("loss", "lr",
"grad_norm", "tokens_per_s", "mfu", "step_s", "data_s", ...), the per-layer dictionaries one scalar per MoE layer
("expert_load_max_over_mean/model.layers.1.mlp", "expert_load_min_over_mean/...", "expert_load_cv/..."), None
(no MTP, no MFU) left out; every event as "events/<kind>" = 1 at its step ("skip", "rewind", "stop", "slow_rank",
"phase_times"). The resolved config goes in once per launch: TensorBoard's text "config", W&B's run config.

Resume: TensorBoard continues the same run in the same directory. The writer of a resumed launch starts with
`purge_step` = the first step it trains, so TensorBoard drops what an earlier launch wrote for the steps trained
again (after a crash past the last checkpoint), as metrics.jsonl does. W&B starts a new run of the same name per
launch.

Asking for TensorBoard without `tensorboard`, or W&B without `wandb`, is an error before anything runs
(`MetricsConfig.check`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DEFAULT_WANDB_PROJECT = "mtdeepep"


@dataclass(kw_only=True)
class MetricsConfig:
    """The `[metrics]` table (see the module docstring for each key)."""

    tensorboard_dir: str | None = None
    enable_tensorboard: bool = False
    save_tb_folder: str = "tb"
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    enable_wandb: bool = False

    def __post_init__(self) -> None:
        for name in ("tensorboard_dir", "wandb_project", "wandb_exp_name", "wandb_save_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"[metrics] {name} must be a non-empty string, got {value!r}")
        for name in ("enable_tensorboard", "enable_wandb"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"[metrics] {name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.save_tb_folder, str) or not self.save_tb_folder:
            raise ValueError(f"[metrics] save_tb_folder must be a non-empty string, got {self.save_tb_folder!r}")
        if not self.wandb and (self.wandb_exp_name is not None or self.wandb_save_dir is not None):
            raise ValueError("[metrics] wandb_exp_name / wandb_save_dir need wandb_project (--wandb-project) or "
                             "enable_wandb")  # fmt: skip

    @property
    def tensorboard(self) -> bool:
        return self.tensorboard_dir is not None or self.enable_tensorboard

    @property
    def wandb(self) -> bool:
        return self.wandb_project is not None or self.enable_wandb

    def check(self) -> None:
        """ValueError when a logger is asked for and its package is not importable (before any process group)."""
        if self.tensorboard and not _importable("tensorboard"):
            raise ValueError("TensorBoard logging (--tensorboard-dir / [metrics] enable_tensorboard) needs the "
                             "tensorboard package: pip install tensorboard")  # fmt: skip
        if self.wandb and not _importable("wandb"):
            raise ValueError("Weights & Biases logging (--wandb-project / [metrics] enable_wandb) needs the wandb "
                             "package, which is not installed: pip install wandb (set WANDB_MODE=offline without "
                             "network access)")  # fmt: skip

    def tensorboard_path(self, run_dir: str | Path) -> Path:
        return Path(self.tensorboard_dir) if self.tensorboard_dir is not None else Path(run_dir) / self.save_tb_folder


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module hidden or half-imported
        return False


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl step record or event, as the loggers write them (module docstring): a step
    record's numeric fields (dictionaries flattened to "key/sub", None and "step" left out), or "events/<kind>" = 1
    for an event."""
    if "kind" in record:
        return {f"events/{record['kind']}": 1.0}
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or value is None or isinstance(value, bool):
            continue
        if isinstance(value, dict):
            out.update({f"{key}/{sub}": float(v) for sub, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    return out


class MetricLogger(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """Scalars into TensorBoard event files (`torch.utils.tensorboard.SummaryWriter`).

    log_dir: the event files' directory (created). start_step: the step the launch resumes from (0: a new run);
    later steps of earlier launches are purged. config_toml: the resolved config, written as text "config".
    """

    def __init__(self, log_dir: str | Path, start_step: int, config_toml: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(str(self.log_dir), purge_step=start_step + 1 if start_step > 0 else None)
        self.writer.add_text("config", f"```toml\n{config_toml}\n```", global_step=start_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """The same scalars through `wandb.log` (online, or offline with WANDB_MODE=offline; then `wandb sync` uploads).

    project, name, save_dir: `wandb.init`'s. config: the resolved config tree (the run's config in W&B).
    """

    def __init__(self, project: str, name: str, save_dir: str | Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(f"--wandb-project {project}: cannot import wandb ({exc}): pip install wandb") from None
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=str(save_dir), config=config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


LoggerFactory = Callable[[int], list[MetricLogger]]


def open_loggers(
    config: MetricsConfig, run_dir: str | Path, start_step: int, *, tables: dict[str, Any], config_toml: str
) -> list[MetricLogger]:
    """The loggers `config` asks for (main rank only), opened for a launch that resumes from `start_step` (0: a new
    run). tables / config_toml: the resolved config tree and its TOML."""
    loggers: list[MetricLogger] = []
    try:
        if config.tensorboard:
            loggers.append(TensorBoardLogger(config.tensorboard_path(run_dir), start_step, config_toml))
        if config.wandb:
            project = config.wandb_project or os.environ.get("WANDB_PROJECT") or DEFAULT_WANDB_PROJECT
            name = config.wandb_exp_name or Path(run_dir).resolve().name
            save_dir = config.wandb_save_dir or Path(run_dir) / "wandb"
            loggers.append(WandbLogger(project, name, save_dir, tables))
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    return loggers
