"""The trainer's one checkpoint object: `Checkpointer.save(step, last_step=...)` decides whether the step is due,
gathers the state list's parts and hands them to the asynchronous writer (which commits the manifest and purges);
`find_resumable` and `load` take a run back from any layout's checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe.trainer.io.shard_files import CheckpointReader
from moe.trainer.train.checkpoint import run_dir as ckpt
from moe.trainer.train.checkpoint.train_state import LoadSource, TrainState
from moe.trainer.train.checkpoint.writer import SaveRequest, ShardWriter
from moe.trainer.train.faults import FaultPlan
from moe.trainer.train.parallel_state import ParallelState


class NoResumableCheckpoint(ValueError):
    """No checkpoint of the run directory verifies whole (raised on every rank alike)."""


@dataclass
class ModelIO:
    """How the trainer saves and loads the model (the model's own format).

    full_state_dict: collective over the ranks: the whole model's state (every expert) on each rank (the state
        list's model component gathers it for the export, `TrainState.of_trainer`).
    write: `write(path, state_dict)` writes a model directory at `path` (which does not exist yet); rank 0 only.
    load: `load(path)` loads a model directory into this rank's model (its experts only); every rank.
    write_config: `write_config(directory)` writes the model's config.json there (every checkpoint has one, so any
        checkpoint reads as a model directory); None: none.
    """

    full_state_dict: Callable[[], dict[str, torch.Tensor]]
    write: Callable[[Path, dict[str, torch.Tensor]], None]
    load: Callable[[Path], None]
    write_config: Callable[[Path], None] | None = None


class Checkpointer:
    """Checkpoints of one rank's training state (`RUN_DIR/checkpoints/step_N/`, moe/trainer/train/checkpoint/writer.py).

    Args:
        run_dir: the run directory.
        parallel: this rank's groups.
        state: the state list (`TrainState`) saved and loaded.
        every: a checkpoint every `every` steps (0: only the last step's).
        model_io: the model's own format: every checkpoint holds its config.json; the last step's also the whole
            model as a model directory (the state list's `export_model`, rank 0 writes it). None: neither.
        extra_files: copied into every checkpoint (e.g. the tokenizer).
        keep_last: keep only the newest `keep_last` checkpoints (0: keep all).
        faults: injected faults (the writer's "checkpoint_write" hook point).
        timeout_s: how long rank 0 waits for the other ranks' shards of one checkpoint.
    """

    def __init__(self, run_dir: str | Path, parallel: ParallelState, state: TrainState, *, every: int = 0,
                 model_io: ModelIO | None = None, extra_files: tuple[Path, ...] = (), keep_last: int = 0,
                 faults: FaultPlan | None = None, timeout_s: float = 600.0) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.parallel = parallel
        self.state = state
        self.every = int(every)
        self.model_io = model_io
        self.extra_files = tuple(Path(p) for p in extra_files)
        self.writer = ShardWriter(self.run_dir, parallel, timeout_s=timeout_s, keep_last=keep_last, faults=faults)
        self._saved: set[int] = set()  # steps replayed after a rewind are not saved twice

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether `save(step, last_step=last_step)` writes a checkpoint."""
        return bool((self.every and step % self.every == 0) or last_step) and step not in self._saved

    def save(self, step: int, *, last_step: bool = False) -> Path | None:
        """Checkpoint the state after step `step` when it is due (collective: every rank calls it at every step):
        blocks for the copy of this rank's state into CPU memory (and for the previous checkpoint's write, if it is
        still going), then writes in the background. `last_step` exports the whole model too. Returns the
        checkpoint's directory, or None when none was due."""
        if not self.due(step, last_step):
            return None
        part = self.state.state_dict()
        export = self.state.export_model() if last_step and self.model_io is not None else None
        request = SaveRequest()
        if self.parallel.is_main:
            io = self.model_io
            request = SaveRequest(
                trainer_state=part.trainer,
                write_config=io.write_config if io is not None else None,
                extra_files=self.extra_files,
                export=export,
                write_model_dir=io.write if io is not None else None,
            )
        self._saved.add(step)
        return self.writer.save(step, part.entries, part.tensors, part.info, request)

    # -- the writer's job

    def raise_if_failed(self) -> None:
        """Raise a finished background write's error (once): the training loop calls it before every step."""
        self.writer.raise_if_failed()

    def wait(self) -> None:
        """Wait for the pending background write; raises its error."""
        self.writer.wait()

    def close(self, ok: bool = True) -> None:
        """Finish the last checkpoint before the process exits (`ShardWriter.close`): collective and raising when
        `ok`; on an exception path (`ok=False`) local and silent."""
        self.writer.close(ok)

    @property
    def stats(self):
        """The `SaveStats` of every checkpoint taken."""
        return self.writer.stats

    # -- resuming

    def find_resumable(self) -> Path:
        """The checkpoint to resume from (collective): rank 0 takes the newest complete one, the sha256 of every
        file verified (newer incomplete ones skipped with a warning), and every rank takes rank 0's choice.
        `NoResumableCheckpoint` on every rank when none passes (rank 0's reasons in the message)."""
        box: list = [None, ""]
        if self.parallel.is_main:
            path, skipped = ckpt.find_resumable(self.run_dir, verify_checksums=True)
            box = [None if path is None else str(path), ckpt.no_resumable_reason(self.run_dir, skipped)]
        if self.parallel.layout.world > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise NoResumableCheckpoint(f"--resume: {box[1]}")
        return Path(box[0])

    def load(self, path: Path) -> int:
        """Load a checkpoint of this run, saved in any layout, into every component of the state list (the counters
        checked first: the seed and the data position must carry over); returns its step."""
        path = Path(path)
        trainer_state = ckpt.read_trainer_state(path)
        with CheckpointReader(path) as reader:
            same = reader.manifest["layout"] == self.parallel.layout.to_dict()
            notes = self.state.load_state_dict(LoadSource(path, trainer_state, reader, same))
        if self.parallel.is_main:
            layout = "the same layout" if same else f"layout {reader.manifest['layout']} resharded"
            print(f"resumed from {path} (step {trainer_state['step']}, {layout}; {'; '.join(notes)})")
        return int(trainer_state["step"])
