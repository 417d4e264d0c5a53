"""Anomalies and rewind: a step whose loss or gradients are NaN/Inf, or whose loss is a spike, makes no update;
the last good state is restored from an in-memory snapshot, the step's batch is skipped, and training continues.

Detection (every rank, before the optimizer step, so the offending update is never applied):
- non-finite: the global LM or MTP loss, or the global gradient norm, is NaN/Inf
  (`check_for_nan_in_loss_and_grad`); the ranks whose own loss sums were already non-finite are named.
- spike (`check_for_spiky_loss`): once `spiky_loss_min_steps` accepted losses are in the window of the last
  `spiky_loss_window` ones, a loss with `(loss - mean) / std > spiky_loss_zscore` (sample std over the window,
  floored at 1e-3 x |mean| so that a flat window does not turn noise into spikes). Only upward: a falling loss is
  good news.
The loss and the norm are already reduced (the same on every rank); one all-reduce (MAX) of the flags over the world
makes the decision common anyway, so no rank rewinds alone.

Rewind: the snapshot holds the state entering step `s0` (taken before steps `1 + k * rewind_snapshot_interval`,
and before the first step run): model parameters and buffers (router biases and their counts included), the
optimizer (AdamW moments and step counts, FP32 masters, ZeRO-1's shards: the storages of every tensor they live
in), the FP8 delayed-scaling amax histories, and the spike window. After an anomaly at step k the state is
restored, steps `s0 .. k-1` are run again with their own batches (none when the snapshot is taken every step), and
step k is skipped.

Skipping, step counter and schedule: a skipped step makes no update and consumes its batch, as a step in
`iterations_to_skip` does (so does Megatron's: the iteration counter moves on, the data iterator too). Step k+1
then takes batch k+1 and the learning rate of step k+1 (the schedule is a function of the step number; Megatron's
scheduler, advanced by updates only, would lag one step behind). The data position therefore stays "batch = step"
(a checkpoint's `next_step` needs no correction), the run makes `steps - skipped` updates, and AdamW's own step
count (its bias correction) counts the updates made. Because every step reseeds torch from `(seed, step)`, a
rewound run's losses after step k equal, bit for bit on CPU, those of a run with `iterations_to_skip = [k]` from the
start.

Cost: detection precedes the update, so at an anomaly the parameters and the optimizer are still those the snapshot
of the same step holds; what the failed step changed is what its forward and backward write (router counts, amax
histories). The snapshot copies everything all the same, which also covers code that writes parameters in place,
at the price of a copy of the parameters and optimizer state per snapshot (bench/rewind_straggler.py); snapshots
every N steps trade that copy for up to N - 1 steps run again after an anomaly.

Retries: `rewind_max_retries` anomalous steps in a row are rewound and skipped; the next one (or any anomaly
without snapshots: `rewind_snapshot_interval = 0`) stops the run with `TrainingStopped`, naming the step and the
reason. A step beyond the last anomaly that passes its checks resets the count.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from moe.trainer.train.checkpoint.train_state import TrainState
    from moe.trainer.train.training_config import RewindConfig


REASONS = ("nan_loss", "nan_grad_norm", "loss_spike")


class AnomalyDetected(FloatingPointError):
    """A step's checks failed (raised by `Trainer.train_step` on every rank, before the optimizer step)."""

    def __init__(self, step: int, reason: str, detail: dict[str, Any]) -> None:
        self.step, self.reason, self.detail = step, reason, detail
        super().__init__(f"step {step}: {describe(reason, detail)}")


class TrainingStopped(RuntimeError):
    """The run stopped on an anomaly it could not rewind (no snapshot, or too many in a row)."""

    def __init__(self, step: int, reason: str, message: str) -> None:
        self.step, self.reason = step, reason
        super().__init__(message)


def describe(reason: str, detail: dict[str, Any]) -> str:
    ranks = detail.get("ranks_with_nonfinite_loss") or []
    where = f" (non-finite loss first on ranks {ranks})" if ranks else ""
    if reason == "nan_loss":
        return f"the loss is {detail['loss']} (mtp {detail.get('mtp_loss')}){where}"
    if reason == "nan_grad_norm":
        return f"the gradient norm is {detail['grad_norm']}{where}"
    return (
        f"loss spike: {detail['loss']:.4f} is {detail['zscore']:.1f} standard deviations above the mean "
        f"{detail['mean']:.4f} (std {detail['std']:.4f}) of the last {detail['window']} steps"
    )


# ---------------------------------------------------------------------------------------------------------------
# Loss spikes


class SpikeDetector:
    """z-score of a step's loss over the window of the last accepted losses (see the module docstring)."""

    def __init__(self, window: int, zscore: float, min_steps: int) -> None:
        if not 2 <= min_steps <= window:
            raise ValueError(f"need 2 <= min_steps <= window, got min_steps={min_steps}, window={window}")
        self.zscore = float(zscore)
        self.min_steps = int(min_steps)
        self.losses: deque[float] = deque(maxlen=int(window))

    def figures(self, loss: float) -> dict[str, Any] | None:
        """`{loss, zscore, mean, std, window}` of `loss` against the window; None before `min_steps` losses or for
        a non-finite loss (the other check's)."""
        if len(self.losses) < self.min_steps or not math.isfinite(loss):
            return None
        mean = statistics.fmean(self.losses)
        std = max(statistics.stdev(self.losses), 1e-3 * abs(mean), 1e-12)
        return {"loss": loss, "zscore": (loss - mean) / std, "mean": mean, "std": std, "window": len(self.losses)}

    def check(self, loss: float) -> dict[str, Any] | None:
        """The figures of `loss` if it is a spike, else None."""
        figures = self.figures(loss)
        return figures if figures is not None and figures["zscore"] > self.zscore else None

    def add(self, loss: float) -> None:
        self.losses.append(float(loss))


# ---------------------------------------------------------------------------------------------------------------
# The snapshot


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole storage `t` lives in (its views' bytes, padding included)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)


class StateSnapshot:
    """An in-memory copy of the training state of one rank (see the module docstring).

    Tensor state is copied storage by storage (every storage that a parameter, buffer, optimizer parameter or
    optimizer state tensor lives in, once however many views it has: ZeRO-1's parameters are views into bucket
    buffers, its AdamW states views into shard buffers), into buffers allocated at the first `take` and reused.
    Restoring copies the bytes back into the same storages, so every view (the model's parameters, the optimizer's
    slices) sees the old values without being replaced.

    Args:
        state: the rank's state list (moe/trainer/train/checkpoint/train_state.py: the model, under pipeline parallelism
            its stages; the optimizer, `MasterAdamW` or `DistributedAdamW`; the FP8 amax histories); the components
            name the tensors (`snapshot_tensors`) and the host-side state (`host_state`) that are copied.
    """

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.step: int | None = None  # the state entering this step
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage ptr -> (live bytes, copy)
        self._host: list = []
        self.extra: Any = None

    @torch.no_grad()
    def take(self, step: int, extra: Any = None) -> float:
        """Copy the state entering `step`; returns the seconds it took. `extra` (e.g. the spike window) is kept
        as given and handed back by `restore`."""
        start = time.perf_counter()
        live: dict[int, torch.Tensor] = {}
        for t in self.state.snapshot_tensors():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in live and t.untyped_storage().nbytes():
                live[ptr] = _storage_bytes(t)
        copies = {}
        for ptr, data in live.items():
            old = self._copies.get(ptr)
            copy = old[1] if old is not None and old[1].numel() == data.numel() else torch.empty_like(data)
            copy.copy_(data)
            copies[ptr] = (data, copy)
        self._copies = copies
        self._host = self.state.host_state()
        self.extra = extra
        self.step = step
        return time.perf_counter() - start

    @torch.no_grad()
    def restore(self) -> Any:
        """Put the snapshot's state back (every storage, the optimizer's bookkeeping, the amax histories); returns
        the `extra` given to `take`."""
        if self.step is None:
            raise RuntimeError("no snapshot to restore")
        for data, copy in self._copies.values():
            data.copy_(copy)
        self.state.load_host_state(self._host)
        return self.extra

    @property
    def nbytes(self) -> int:
        return sum(copy.numel() for _, copy in self._copies.values())


# ---------------------------------------------------------------------------------------------------------------
# The guard: checks, decisions, counts


@dataclass
class Rewind:
    """What `RewindGuard.rewind` did: restored the state entering `resume_step`, to run from there."""

    resume_step: int
    event: dict[str, Any]


class RewindGuard:
    """The trainer's anomaly checks and rewinds (see the module docstring).

    Args:
        config: the [rewind] settings (`RewindConfig`: check_for_*, spiky_loss_*, rewind_*).
        state: what the snapshot copies (the state list, `TrainState`).
        world: ranks that must agree (the flags are all-reduced over the default group when > 1).
        rank: this rank's global rank (named in the event when its own loss was non-finite).
    """

    def __init__(self, config: RewindConfig, state: TrainState, *, world: int, rank: int) -> None:
        self.config = config
        self.world, self.rank = world, rank
        self.spikes = (
            SpikeDetector(config.spiky_loss_window, config.spiky_loss_zscore, config.spiky_loss_min_steps)
            if config.check_for_spiky_loss
            else None
        )
        self.interval = config.rewind_snapshot_interval
        self.snapshot = StateSnapshot(state) if self.interval > 0 else None
        self.skipped: set[int] = set()  # steps rewound and skipped
        self.in_a_row = 0  # anomalies since the last step that passed beyond the last anomaly
        self.last_anomaly = 0

    @property
    def checks(self) -> bool:
        return self.config.check_for_nan_in_loss_and_grad or self.spikes is not None

    # -- snapshots

    def maybe_snapshot(self, step: int) -> float | None:
        """Take the snapshot of the state entering `step` when one is due (before the first step run, then every
        `rewind_snapshot_interval` steps); returns its seconds, or None."""
        snap = self.snapshot
        if snap is None or snap.step == step:
            return None
        if snap.step is not None and (step - 1) % self.interval:
            return None
        window = list(self.spikes.losses) if self.spikes is not None else None
        return snap.take(step, window)

    # -- checks

    def check(self, step: int, loss: float, mtp_loss: float | None, grad_norm: float, local_finite: bool) -> None:
        """Raise `AnomalyDetected` (on every rank alike) when step `step`'s figures fail the checks; the loss and
        the norm are the global ones, `local_finite` whether this rank's own loss sums were finite."""
        if not self.checks:
            return
        nonfinite = self.config.check_for_nan_in_loss_and_grad and not (
            math.isfinite(loss) and (mtp_loss is None or math.isfinite(mtp_loss)) and math.isfinite(grad_norm)
        )
        spike = None if (nonfinite or self.spikes is None) else self.spikes.check(loss)
        flags = torch.tensor([float(nonfinite), float(spike is not None), float(not local_finite)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if not flags.any():
            return
        detail: dict[str, Any] = {"loss": loss, "mtp_loss": mtp_loss, "grad_norm": grad_norm}
        if flags[2]:  # which ranks' own sums were non-finite (rare: gather them only now)
            mine = torch.tensor([float(not local_finite)], dtype=torch.float64)
            parts = [torch.empty_like(mine) for _ in range(self.world)]
            if self.world > 1:
                dist.all_gather(parts, mine)
            else:
                parts = [mine]
            detail["ranks_with_nonfinite_loss"] = [r for r, p in enumerate(parts) if p.item()]
        if flags[0] or flags[2]:
            finite_loss = math.isfinite(loss) and (mtp_loss is None or math.isfinite(mtp_loss))
            reason = "nan_grad_norm" if finite_loss else "nan_loss"
        else:
            # Every rank has the same losses, so the same window; should one differ, any rank's flag rules.
            reason = "loss_spike"
            detail.update(spike or self.spikes.figures(loss) or {"zscore": math.nan, "mean": math.nan,
                                                                  "std": math.nan, "window": 0})  # fmt: skip
        raise AnomalyDetected(step, reason, detail)

    def accepted(self, step: int, loss: float) -> None:
        """A step passed its checks and was applied."""
        if self.spikes is not None:
            self.spikes.add(loss)
        if step > self.last_anomaly:
            self.in_a_row = 0

    # -- rewind

    def rewind(self, anomaly: AnomalyDetected) -> Rewind:
        """Restore the snapshot and skip the anomalous step, or raise `TrainingStopped`."""
        step = anomaly.step
        self.in_a_row += 1
        self.last_anomaly = max(self.last_anomaly, step)
        if self.snapshot is None or self.snapshot.step is None:
            raise TrainingStopped(
                step, anomaly.reason,
                f"step {step}: {describe(anomaly.reason, anomaly.detail)}; no in-memory snapshot to rewind to "
                "(rewind_snapshot_interval = 0): stopping",
            )  # fmt: skip
        if self.in_a_row > self.config.rewind_max_retries:
            raise TrainingStopped(
                step, anomaly.reason,
                f"step {step}: {describe(anomaly.reason, anomaly.detail)}; {self.in_a_row} anomalous steps in a "
                f"row (skipped before: {sorted(s for s in self.skipped if s > step - self.in_a_row)}), more than "
                f"rewind_max_retries = {self.config.rewind_max_retries}: stopping",
            )  # fmt: skip
        start = time.perf_counter()
        window = self.snapshot.restore()
        if self.spikes is not None:
            self.spikes.losses.clear()
            self.spikes.losses.extend(window)
        restore_s = time.perf_counter() - start
        self.skipped.add(step)
        resume = self.snapshot.step
        event = {
            "kind": "rewind",
            "step": step,
            "reason": anomaly.reason,
            "message": str(anomaly),
            "detail": {k: _json_number(v) for k, v in anomaly.detail.items()},
            "restored_to_step": resume - 1,  # the state after this step's update
            "replayed_steps": [s for s in range(resume, step) if s not in self.skipped],
            "skipped_step": step,
            "retry": self.in_a_row,
            "restore_s": restore_s,
            "snapshot_mib": self.snapshot.nbytes / 2**20,
        }
        return Rewind(resume, event)


def _json_number(v: Any) -> Any:
    """JSON has no NaN/Inf: non-finite floats become their names ("nan", "inf", "-inf")."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
