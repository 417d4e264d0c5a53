"""Optimizer state through the public checkpoint path, for the optimizer tests: gathered (every rank's boxes written
as one checkpoint by `ShardWriter`, read back whole) and loaded into any layout (resharded by the reader)."""

from __future__ import annotations

from pathlib import Path

import torch

from moe.trainer.io.shard_files import CheckpointReader, read_full_section
from moe.trainer.train.checkpoint.train_state import load_entries, optimizer_entries
from moe.trainer.train.checkpoint.writer import SaveRequest, ShardWriter
from moe.trainer.train.parallel_state import ParallelState


def save_state(opt, parallel: ParallelState, run_dir: str | Path) -> Path:
    """Checkpoint the optimizer's tensors and step count into `run_dir` (collective: every rank, the same new
    directory); returns the checkpoint."""
    writer = ShardWriter(run_dir, parallel, timeout_s=60)
    request = SaveRequest(trainer_state={"step": opt.steps, "optimizer": {"steps": opt.steps}})
    path = writer.save(opt.steps, optimizer_entries(opt, parallel), {}, {}, request)
    writer.close()  # every rank returns once rank 0 committed it
    return path


def gathered_state(opt, parallel: ParallelState, run_dir: str | Path) -> dict[str, torch.Tensor]:
    """The optimizer's layout-independent state (collective, see `save_state`): `<param>.exp_avg / .exp_avg_sq /
    .master` whole (every expert, every shard), and "steps"."""
    state = read_full_section(save_state(opt, parallel, run_dir), "optimizer")
    state["steps"] = torch.tensor(opt.steps)
    return state


def load_state(opt, parallel: ParallelState, path: str | Path, steps: int) -> None:
    """Load a checkpoint of `save_state`, written in any layout, into `opt` (this rank's part)."""
    with CheckpointReader(path) as reader:
        load_entries(reader, optimizer_entries(opt, parallel, create=steps > 0))
    opt.set_steps(steps)
