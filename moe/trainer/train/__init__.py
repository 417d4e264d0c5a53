"""The trainer core: run configuration, parallel layout, optimizer, checkpoints, metrics and the loop.

- `training_config`: the trainer's tables, one dataclass per component (`TrainingConfig`, `OptimizerConfig`,
  `DistributedOptimizerConfig`, `CheckpointConfig`, `RewindConfig`, `StragglerConfig`, `DataConfig`), bundled as
  `TrainerConfig`.
- `parallel_state`: `Layout` (checked before any process group) and `ParallelState` (the groups, built once).
- `schedule`: warm-up + cosine learning rate.
- `optim`: `MasterAdamW` (FP32 master weights, gradient reduction over the layout, global-norm clipping).
- `checkpoint`: `Checkpointer` (cadence, asynchronous sharded writes, manifest, purging, resuming in any layout)
  over the state list (`TrainState`: counters, data position, schedule, model, optimizer, RNG, FP8 amax histories);
  the file format and the atomic writes are `moe.trainer.io`.
- `metrics`: metrics.jsonl (step records and events) and the loss plot.
- `rewind`: NaN/Inf and loss-spike checks, the in-memory snapshot, rewind and skip.
- `straggler`: slow-rank reports from the per-rank phase times (`moe.layer.phase_timer`).
- `faults`: injected faults (the test hook of rewind, slow-rank detection and crash recovery), one plan.
- `trainer`: `Trainer` (the step and the loop).
"""

from moe.trainer.train.parallel_state import Layout, ParallelState
from moe.trainer.train.training_config import DataConfig, TrainerConfig, TrainingConfig

__all__ = ["DataConfig", "Layout", "ParallelState", "TrainerConfig", "TrainingConfig"]
