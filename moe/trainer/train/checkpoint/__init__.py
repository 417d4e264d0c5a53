"""Training checkpoints: one `Checkpointer` (cadence, the asynchronous writer, the manifest, purging, resuming in
any layout) over one state list.

- `checkpointer`: `Checkpointer` (`save(step, last_step=...)`, `find_resumable`, `load`) and `ModelIO`.
- `state`: the state list (`TrainState`): components with `state_dict` / `load_state_dict` (counters, data
  position, schedule, model, optimizer, rank-local state), also what the rewind snapshot copies.
- `writer`: `ShardWriter`, the flash checkpoint protocol (copy to CPU memory, background writer, rank 0's atomic
  commit of the manifest).
- `run_dir`: the checkpoints of a run directory: names, the `latest` pointer, completeness, which one a resume
  takes, purging.
The file format itself is moe/trainer/io/shard_files.py (model code reads it without importing the trainer).
"""

from moe.trainer.train.checkpoint.checkpointer import Checkpointer, ModelIO, NoResumableCheckpoint
from moe.trainer.train.checkpoint.run_dir import (
    CHECKPOINTS,
    LATEST,
    TRAINER_STATE,
    checkpoint_name,
    checkpoints_dir,
    find_resumable,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    no_resumable_reason,
    purge,
    read_trainer_state,
    remove_partials,
    set_latest,
)
from moe.trainer.train.checkpoint.train_state import TrainState, check_same_data
from moe.trainer.train.checkpoint.writer import CheckpointWriteError, SaveStats

__all__ = [
    "NoResumableCheckpoint",
    "CHECKPOINTS", "LATEST", "TRAINER_STATE", "CheckpointWriteError", "Checkpointer", "ModelIO", "SaveStats",
    "TrainState", "check_same_data", "checkpoint_name", "checkpoints_dir", "find_resumable", "is_complete",
    "latest_checkpoint", "list_checkpoints", "no_resumable_reason", "purge", "read_trainer_state", "remove_partials",
    "set_latest",
]  # fmt: skip
