"""The trainer core: run configuration, parallel layout, data, optimizer, checkpoints, metrics and the loop.

- `config`: the `[training]` table (`TrainingConfig`, `DataConfig`).
- `parallel`: `Layout` (checked before any process group) and `ParallelState` (the groups, built once).
- `data`: corpus, tokenizer, cached token file, `TokenBatches` (layout-independent global batches).
- `schedule`: warm-up + cosine learning rate.
- `optim`: `MasterAdamW` (FP32 master weights, gradient reduction over the layout, global-norm clipping).
- `checkpoint`: the checkpoints of a run directory: the `latest` pointer, completeness, which one a resume takes.
- `flash`: asynchronous sharded checkpoints (copy to CPU memory, background writer, rank 0's atomic commit).
- `shard_files`: their files: streamed safetensors with sha256, the manifest, the resharding reader.
- `sharded`: the geometry: a rank's part of a global tensor as boxes (experts, TP shards, ZeRO-1 ranges).
- `train_state`: what a checkpoint holds of a rank (model, optimizer, RNG, FP8 amax histories), and loading it.
- `crash_faults`: crash injection for the checkpoint tests (a rank SIGKILLs itself).
- `metrics`: metrics.jsonl (step records and events) and the loss plot.
- `rewind`: NaN/Inf and loss-spike checks, the in-memory snapshot, rewind and skip.
- `straggler`: slow-rank reports from the per-rank phase times (`moe.phase_timer`).
- `faults`: injected faults (the test hook of rewind and slow-rank detection).
- `trainer`: `Trainer` (the step, the loop, save and resume).
"""

from moe.train.config import DataConfig, TrainingConfig
from moe.train.parallel import Layout, ParallelState

__all__ = ["DataConfig", "Layout", "ParallelState", "TrainingConfig"]
