"""The training loop: global batches split over data-parallel ranks and micro-batches, one optimizer step each,
metrics, checkpoints and resumption.

The maths of a step do not depend on the layout (see moe/train/parallel.py and moe/train/optim.py):
1. Every rank takes its rows of the global batch (`TokenBatches.local_batch`) and splits them into micro-batches.
2. The global numbers of next-token targets (main head and each MTP depth) are summed over the data-parallel ranks
   first, so each micro-batch's loss is its share of the global-batch loss:
   `lm_loss_sum / N_lm + mtp_loss_weight / D * sum_d mtp_loss_sum_d / N_d`. The MoE layers' auxiliary losses reach
   the gradient through autograd with the scale `micro-batch sequences / global batch` (each is a mean over its
   micro-batch's sequences), so they too add up to their global-batch value.
3. Gradients are summed over the groups (`MasterAdamW.reduce_gradients`), clipped by the global norm, AdamW steps
   at the scheduled learning rate, then the router biases are updated from the expert counts summed over the
   ranks that routed other tokens (dp x tp, `ParallelState.token_group`; `moe.update_expert_bias`).
4. The reported loss is the LM cross-entropy over every target of the global batch (sums and counts reduced over
   all ranks in float64), the same value whatever the layout up to reduction order.

Randomness: torch's generator is reseeded from `(seed, step)` at the start of every step, so a resumed run draws
the same numbers as an uninterrupted one whatever the layout (the generator states are saved anyway).

Checkpoints (moe/train/flash.py): every `checkpoint_every` steps and at the last one, each rank copies its shard
of the state (its experts, its TP shard, its stages, its ZeRO-1 shards, its generators and FP8 amax histories)
into CPU memory and a background thread writes it; rank 0 commits the checkpoint once every shard is on disk. The
last checkpoint also holds the whole model as a model directory (model.safetensors + config.json). `resume` reads
the boxes this rank needs from any layout's checkpoint.

Anomalies (moe/train/rewind.py): before the optimizer step, the global loss and gradient norm are checked for
NaN/Inf and the loss for a spike; an anomalous step makes no update, `fit` restores the last in-memory snapshot and
skips the step (its batch), as a step listed in `iterations_to_skip` is skipped. Slow ranks
(moe/train/straggler.py): with `log_straggler`, every rank times its phases and every `straggler_interval` steps the
ranks much slower than their peers in a phase are reported. Both write their events into metrics.jsonl (records
with a "kind"; the step records have none).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe.balancing import load_imbalance, set_aux_loss_scale, update_expert_bias
from moe.loss import loss_share
from moe.memory import process_peak_bytes
from moe.phase_timer import PhaseTimer, phase
from moe.train import checkpoint as ckpt
from moe.train import crash_faults
from moe.train import train_state as ts
from moe.train.config import TrainingConfig
from moe.train.data import TokenBatches
from moe.train.faults import Fault, FaultPlan
from moe.train.flash import FlashCheckpointer, SaveRequest
from moe.train.metrics import LOSS_PNG, MetricsLog, plot_loss
from moe.train.optim import MasterAdamW
from moe.train.parallel import ParallelState, all_reduce_sum
from moe.train.rewind import AnomalyDetected, RewindGuard, TrainingStopped
from moe.train.schedule import lr_at
from moe.train.shard_files import CheckpointReader
from moe.train.straggler import StragglerMonitor, slow_rank_event
from moe.train.zero import DistributedAdamW, ZeroConfig

IGNORE_INDEX = -100


@dataclass
class ModelIO:
    """How the trainer saves and loads the model (the model's own format).

    full_state_dict: collective over the ranks: the whole model's state (every expert) on each rank.
    write: `write(path, state_dict)` writes a model directory at `path` (which does not exist yet); rank 0 only.
    load: `load(path)` loads a model directory into this rank's model (its experts only); every rank.
    write_config: `write_config(directory)` writes the model's config.json there (every checkpoint has one, so any
        checkpoint reads as a model directory); None: none.
    """

    full_state_dict: Callable[[], dict[str, torch.Tensor]]
    write: Callable[[Path, dict[str, torch.Tensor]], None]
    load: Callable[[Path], None]
    write_config: Callable[[Path], None] | None = None


def step_seed(seed: int, step: int) -> int:
    """The torch seed of optimizer step `step` of a run seeded `seed` (independent of the layout)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def target_counts(labels_BS: torch.Tensor, num_mtp: int) -> torch.Tensor:
    """`[1 + num_mtp] float64`: next-token targets of the main head and of each MTP depth in `labels_BS`.

    HF's shift convention: position t predicts `labels[t + 1]` (depth d: `labels[t + 1 + d]`); -100 is ignored.
    """
    valid = labels_BS != IGNORE_INDEX
    return torch.tensor([float(valid[:, 1 + d :].sum()) for d in range(1 + num_mtp)], dtype=torch.float64)


class Trainer:
    """Runs the optimizer steps of one rank.

    Args:
        model: `forward(input_ids [B, S] int64, labels=[B, S] int64)` returning an object with `lm_loss_sum`
            (0-d FP32 sum of next-token cross-entropy), `mtp_loss_sums` (list of 0-d sums, one per MTP depth) and
            `num_tokens`; `moe_layers()` listing its `moe.MoELayer`s.
        config: the [training] settings.
        parallel: this rank's groups.
        batches: the run's global batches.
        run_dir: where metrics, the plot and checkpoints go (rank 0 writes).
        seed: the run's seed (data order and per-step generator).
        model_io: model saving and loading.
        mtp_loss_weight: lambda of the MTP loss (summed over depths and divided by their number, as DeepSeek-V3).
        num_mtp: MTP depths the model predicts.
        extra_checkpoint_files: files copied into every checkpoint (e.g. the tokenizer).
        pipeline: with pipeline parallelism, the `moe.pipeline.PipelineRunner` that runs each step's micro-batches
            (built first: it prunes `model` to this rank's stages).
        faults: test hook: faults to inject (moe/train/faults.py), None for none.
        checkpoint_timeout_s: how long rank 0 waits for the other ranks' shards of one checkpoint.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainingConfig,
        parallel: ParallelState,
        batches: TokenBatches,
        run_dir: str | Path,
        *,
        seed: int,
        model_io: ModelIO,
        mtp_loss_weight: float = 0.0,
        num_mtp: int = 0,
        extra_checkpoint_files: tuple[Path, ...] = (),
        run_info: dict[str, Any] | None = None,
        pipeline=None,
        faults: FaultPlan | None = None,
        checkpoint_timeout_s: float = 600.0,
    ) -> None:
        self.model = model
        self.pipeline = pipeline
        if parallel.layout.pp > 1 and pipeline is None:
            raise ValueError(f"--pp {parallel.layout.pp} needs a PipelineRunner (moe.pipeline)")
        self.config = config
        self.parallel = parallel
        self.batches = batches
        self.run_dir = Path(run_dir)
        self.seed = seed
        self.model_io = model_io
        self.mtp_loss_weight = float(mtp_loss_weight)
        self.num_mtp = int(num_mtp)
        self.extra_checkpoint_files = tuple(Path(p) for p in extra_checkpoint_files)
        self.run_info = run_info or {}
        self.moe_layers = list(model.moe_layers())
        names = {id(m): n for n, m in model.named_modules()}
        self.moe_layer_names = [names[id(m)] for m in self.moe_layers]
        expert_params = [p for layer in self.moe_layers for p in layer.experts.parameters()]
        if parallel.layout.ep > 1 and any(layer.ep_size != parallel.layout.ep for layer in self.moe_layers):
            raise ValueError(f"the model's MoE layers are not sharded over --ep {parallel.layout.ep}")
        if config.use_distributed_optimizer:  # built before any backward: it installs the gradient hooks
            zero = ZeroConfig(bucket_size=config.ddp_bucket_size, overlap_grad_reduce=config.overlap_grad_reduce)
            self.optimizer = DistributedAdamW(model, expert_params, config, parallel, zero)
        else:
            self.optimizer = MasterAdamW(model, expert_params, config, parallel)
        self.local_rows = config.global_batch // parallel.layout.dp
        self.micro_rows = self.local_rows // config.micro_batches
        # Anomaly checks and rewind, slow-rank detection, injected faults.
        self.faults = faults
        self.guard = RewindGuard(config, model, self.optimizer, world=parallel.layout.world, rank=parallel.rank)
        self.phase_timer: PhaseTimer | None = None
        self.straggler: StragglerMonitor | None = None
        if config.log_straggler:
            self.phase_timer = PhaseTimer()
            for layer in self.moe_layers:
                layer.set_phase_timer(self.phase_timer)
            if pipeline is not None:
                pipeline.set_phase_timer(self.phase_timer)
            self.straggler = StragglerMonitor(
                self.phase_timer, world=parallel.layout.world, pp=parallel.layout.pp,
                interval=config.straggler_interval, factor=config.straggler_factor,
                min_seconds=config.straggler_min_seconds,
            )  # fmt: skip
        elif faults is not None and faults.has_delays:
            raise ValueError("injected sleep faults act on the phase timer: set [training] log_straggler = true")
        if faults is not None and pipeline is not None and faults.has_loss_faults:
            raise ValueError("injected loss faults act in the trainer's micro-batch loop, which pipeline runs skip")
        # Flash checkpoints.
        self.checkpointer = FlashCheckpointer(self.run_dir, parallel, timeout_s=checkpoint_timeout_s)

    # -- one optimizer step

    def train_step(self, step: int) -> dict[str, Any]:
        """Optimizer step `step` (1-based); returns its metrics record (the same on every rank). Raises
        `AnomalyDetected` on every rank, before any update, when the step fails its checks (moe/train/rewind.py)."""
        cfg, par = self.config, self.parallel
        timer = self.phase_timer
        if timer is not None and self.faults is not None:
            timer.set_delays(self.faults.delays(step, par.rank))
        start = time.perf_counter()
        torch.manual_seed(step_seed(self.seed, step))
        self.model.train()
        tokens_BS = self.batches.local_batch(step, par.dp_rank, par.layout.dp)
        counts = all_reduce_sum(target_counts(tokens_BS, self.num_mtp), par.dp_group)  # global targets per head
        set_aux_loss_scale(self.model, self.micro_rows / cfg.global_batch)
        self.optimizer.zero_grad()

        num_experts = [layer.config.num_moe_experts for layer in self.moe_layers]
        if self.pipeline is not None:
            # The schedule interleaves the micro-batches' backwards: ZeRO-1 reduces every bucket after the step.
            with self.optimizer.accumulation_context(0, 2):
                sums, load_of = self.pipeline.step(tokens_BS, counts, step)
            loads = [load_of[id(layer)] for layer in self.moe_layers]
        else:
            fault = self.faults.loss_fault(step, par.rank) if self.faults is not None else None
            sums, loads = self._micro_batches(tokens_BS, counts, fault)
        with phase(timer, "grad_sync"):  # the norm's all-reduce is where ranks wait for a late one: not 'optimizer'
            self.optimizer.reduce_gradients()
            grad_norm = self.optimizer.global_grad_norm()
        # The loss sums are the same on the TP ranks of one data-parallel rank (the model's loss is its
        # data-parallel batch's), so they are summed over dp. Before the update: the checks need the global loss.
        local_finite = bool(torch.isfinite(sums).all())
        sums = all_reduce_sum(sums, par.dp_group)
        loss = float(sums[0] / counts[0])
        mtp = [float(sums[1 + d] / counts[1 + d]) for d in range(self.num_mtp)]
        mtp_loss = sum(mtp) / len(mtp) if mtp else None
        self.guard.check(step, loss, mtp_loss, grad_norm, local_finite)
        with phase(timer, "optimizer"):
            self.optimizer.clip(grad_norm)
            lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
            self.optimizer.step(lr)
        # Every rank of the stage routed other tokens (other sequences, or under sequence parallelism another part
        # of the sequence): the expert loads are summed over dp x tp.
        update_expert_bias(self.model, par.token_group)
        self.guard.accepted(step, loss)
        if loads:  # a pipeline rank may hold no MoE layer
            loads = all_reduce_sum(torch.cat(loads), par.token_group).split(num_experts)
        elapsed = time.perf_counter() - start
        # The largest rank's figures: its memory high-water mark so far and its optimizer-state bytes.
        per_rank = torch.tensor([process_peak_bytes(), self.optimizer.state_bytes_per_rank()], dtype=torch.float64)
        if self.parallel.layout.world > 1:
            dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
        imbalance = {n: load_imbalance(c) for n, c in zip(self.moe_layer_names, loads)}
        if par.pp_group is not None:  # every stage's MoE layers in the record
            stages: list[dict] = [{} for _ in range(par.layout.pp)]
            dist.all_gather_object(stages, imbalance, group=par.pp_group)
            imbalance = {k: v for part in stages for k, v in part.items()}
        return {
            "step": step,
            "loss": loss,
            "mtp_loss": mtp_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": cfg.global_batch * cfg.seq_len / elapsed,
            "step_s": elapsed,
            "max_peak_memory_mib": float(per_rank[0]) / 2**20,
            "max_optimizer_state_mib": float(per_rank[1]) / 2**20,
            "expert_load_max_over_mean": imbalance,
        }

    def _micro_batches(
        self, tokens_BS: torch.Tensor, counts: torch.Tensor, fault: Fault | None = None
    ) -> tuple[torch.Tensor, list]:
        """Forward and backward of each micro-batch in turn (no pipeline): `(loss sums [1 + D] float64, tokens per
        expert of each MoE layer)`. `fault` (test hook) corrupts the first micro-batch's LM loss sum."""
        cfg, timer = self.config, self.phase_timer
        sums = torch.zeros(1 + self.num_mtp, dtype=torch.float64)
        loads = [torch.zeros(layer.config.num_moe_experts, dtype=torch.float64) for layer in self.moe_layers]
        for index, mb_BS in enumerate(tokens_BS.split(self.micro_rows)):
            # ZeRO-1: no gradient communication before the last micro-batch's backward (then it overlaps it).
            with self.optimizer.accumulation_context(index, cfg.micro_batches):
                with phase(timer, "forward"):
                    out = self.model(mb_BS, labels=mb_BS)
                    if fault is not None and index == 0:
                        out.lm_loss_sum = fault.apply(out.lm_loss_sum)
                    loss, mb_sums = loss_share(out, counts, self.mtp_loss_weight, self.num_mtp)
                with phase(timer, "backward"):
                    loss.backward()
            sums += mb_sums
            for load, layer in zip(loads, self.moe_layers):
                load += layer.metrics.tokens_per_expert.double()
        return sums, loads

    # -- checkpoints

    def save(self, step: int) -> Path:
        """Checkpoint `RUN_DIR/checkpoints/step_<step>/` (collective): blocks for the copy of this rank's state into
        CPU memory (and for the previous checkpoint's write, if it is still going), then writes in the background.
        The run's last step also exports the whole model (gathered, rank 0 writes it). Returns the directory."""
        request = SaveRequest()
        export = None
        if step == self.config.steps and self.model_io is not None:
            export = {k: v.detach().clone() for k, v in self._merge_stages(self.model_io.full_state_dict()).items()}
        if self.parallel.is_main:
            request = SaveRequest(
                trainer_state=self.trainer_state(step),
                write_config=self.model_io.write_config if self.model_io is not None else None,
                extra_files=self.extra_checkpoint_files,
                export=export,
                write_model_dir=self.model_io.write if self.model_io is not None else None,
            )
        entries = ts.model_entries(self.model, self.parallel) + ts.optimizer_entries(self.optimizer, self.parallel)
        tensors, info = ts.rank_state(self.model)
        return self.checkpointer.save(step, entries, tensors, info, request)

    def close_checkpoints(self, ok: bool = True) -> None:
        """Finish the last checkpoint before the process exits (`FlashCheckpointer.close`): collective and raising
        when `ok`; on an exception path (`ok=False`) local and silent."""
        self.checkpointer.close(ok)

    def _before_step(self, step: int) -> None:
        """A background write's error surfaces at the next step; the tests' crash injection
        (moe/train/crash_faults.py)."""
        self.checkpointer.raise_if_failed()
        fault = self.checkpointer.fault
        if fault is not None and (fault.kind, fault.rank, fault.step) == ("kill_at_step", self.parallel.rank, step):
            self.checkpointer.wait()
            crash_faults.kill_self(f"rank {self.parallel.rank} before step {step}")

    def _merge_stages(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With pipeline parallelism, every pipeline rank's part of a state dict in one (collective over the
        pipeline group; disjoint keys: each rank holds other layers)."""
        group = self.parallel.pp_group
        if group is None:
            return state
        parts: list[dict] = [{} for _ in range(self.parallel.layout.pp)]
        dist.all_gather_object(parts, {k: v.detach().clone() for k, v in state.items()}, group=group)
        return {k: v for part in parts for k, v in part.items()}

    def trainer_state(self, step: int) -> dict[str, Any]:
        cfg = self.config
        return {
            "step": step,
            "seed": self.seed,
            "data": {
                "next_step": step + 1,
                "consumed_sequences": step * cfg.global_batch,
                "epoch": (step * cfg.global_batch) // self.batches.num_train,
                "global_batch": cfg.global_batch,
                "seq_len": cfg.seq_len,
                "num_train_windows": self.batches.num_train,
            },
            "schedule": {
                "lr": cfg.lr,
                "min_lr": cfg.min_lr,
                "warmup_steps": cfg.warmup_steps,
                "total_steps": cfg.steps,
                "last_lr": lr_at(
                    step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps
                ),  # fmt: skip
            },
            "optimizer": {"kind": type(self.optimizer).__name__, "steps": self.optimizer.steps},
            "rng": {
                "policy": "torch.manual_seed(step_seed(seed, step)) at the start of every step; the generator "
                "states of every rank are in its rank_*/state.safetensors"
            },  # fmt: skip
            "layout": self.parallel.layout.to_dict(),
            **self.run_info,
        }

    def find_checkpoint(self) -> Path:
        """The checkpoint to resume from (collective): rank 0 takes the newest complete one, the sha256 of every
        file verified (newer incomplete ones skipped with a warning), and every rank takes rank 0's choice.
        ValueError on every rank when none passes (rank 0's reasons in the message)."""
        box: list = [None, ""]
        if self.parallel.is_main:
            path, skipped = ckpt.find_resumable(self.run_dir, verify_checksums=True)
            box = [None if path is None else str(path), ckpt.no_resumable_reason(self.run_dir, skipped)]
        if self.parallel.layout.world > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise ValueError(f"--resume: {box[1]}")
        return Path(box[0])

    def resume(self, path: Path) -> int:
        """Load a checkpoint of this run, saved in any layout (model, optimizer, rank-local state); returns its
        step."""
        state = ckpt.read_trainer_state(path)
        for key, mine in (("seed", self.seed),):
            if state[key] != mine:
                raise ValueError(f"{path} was trained with {key}={state[key]}, this run has {mine}")
        data = dict(state["data"], num_train_windows=state["data"].get("num_train_windows", self.batches.num_train))
        for key, mine in (("global_batch", self.config.global_batch), ("seq_len", self.config.seq_len),
                          ("num_train_windows", self.batches.num_train)):  # fmt: skip
            if data[key] != mine:
                raise ValueError(
                    f"{path} was trained with {key}={data[key]}, this run has {mine}: the data position would not "
                    "carry over"
                )
        cfg, sched = self.config, state["schedule"]
        mine = {"lr": cfg.lr, "min_lr": cfg.min_lr, "warmup_steps": cfg.warmup_steps, "total_steps": cfg.steps}
        changed = {k: (sched[k], v) for k, v in mine.items() if sched[k] != v}
        if changed and self.parallel.is_main:
            print(f"note: the learning-rate schedule changed since {path.name} (checkpoint, now): {changed}")
        steps = int(state["optimizer"]["steps"])
        with CheckpointReader(path) as reader:
            ts.load_entries(reader, ts.model_entries(self.model, self.parallel))
            ts.load_entries(reader, ts.optimizer_entries(self.optimizer, self.parallel, create=steps > 0))
            self.optimizer.set_steps(steps)
            same = reader.manifest["layout"] == self.parallel.layout.to_dict()
            note = ts.load_rank_state(reader, self.model, self.parallel, same_layout=same)
        if self.parallel.is_main:
            layout = "the same layout" if same else f"layout {reader.manifest['layout']} resharded"
            print(f"resumed from {path} (step {state['step']}, {layout}; {note})")
        return int(state["step"])

    # -- the loop

    def fit(self, start_step: int = 0) -> list[dict[str, Any]]:
        """Steps `start_step + 1 .. config.steps`, with metrics, progress bar, checkpoints (every
        `checkpoint_every` steps and at the last) and the loss plot; returns the records of the steps run.

        Steps in `iterations_to_skip` make no update (a "skip" event). An anomalous step (`AnomalyDetected`) is
        rewound: the snapshot is restored, the steps between it and the anomaly run again (their records and
        checkpoints are not written twice) and the step is skipped (a "rewind" event); an anomaly that cannot be
        rewound raises `TrainingStopped` after a "stop" event. With `log_straggler`, "phase_times" and
        "slow_rank" events every `straggler_interval` steps.
        """
        cfg = self.config
        main = self.parallel.is_main
        log = MetricsLog(self.run_dir, resume_step=start_step) if main else None
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, disable=not main, unit="step", dynamic_ncols=True)

        def event(record: dict[str, Any], line: str | None = None) -> None:
            if main:
                log.write(record)
                if line:
                    bar.write(line)

        records: dict[int, dict[str, Any]] = {}
        configured_skips = set(cfg.iterations_to_skip)
        done, saved, step = start_step, set(), start_step + 1  # done: the last step past on the first pass
        ok = False
        try:
            while step <= cfg.steps:
                self._before_step(step)
                fresh = step > done
                if step in configured_skips or step in self.guard.skipped:
                    if fresh and step in configured_skips:
                        line = f"step {step:>5} skipped (iterations_to_skip): no update, its batch is not used"
                        event({"kind": "skip", "step": step, "reason": "iterations_to_skip"}, line)
                else:
                    snapshot_s = self.guard.maybe_snapshot(step)
                    try:
                        record = self.train_step(step)
                    except AnomalyDetected as anomaly:
                        if self.straggler is not None:
                            self.straggler.step_done(step)
                        try:
                            rewind = self.guard.rewind(anomaly)
                        except TrainingStopped as stop:
                            event({"kind": "stop", "step": stop.step, "reason": stop.reason, "message": str(stop)},
                                  f"stopped: {stop}")  # fmt: skip
                            raise
                        e = rewind.event
                        event(e, f"step {step:>5} rewound ({e['reason']}): {e['message']}; restored the state after "
                                 f"step {e['restored_to_step']}, step {step} is skipped")  # fmt: skip
                        step = rewind.resume_step
                        continue
                    if snapshot_s is not None:  # taken before the step, outside its step_s
                        record["snapshot_s"] = snapshot_s
                        record["snapshot_mib"] = self.guard.snapshot.nbytes / 2**20
                    records[step] = record
                    if fresh:
                        event(record)
                        if main:
                            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                            if step % cfg.log_every == 0 or step == cfg.steps:
                                bar.write(_log_line(record))
                    if self.straggler is not None:
                        self._report_stragglers(step, event)
                if fresh:
                    bar.update(1)
                if ((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps) and (
                    step not in saved
                ):
                    self.save(step)
                    saved.add(step)
                done = max(done, step)
                step += 1
            ok = True
        finally:
            bar.close()
            if log is not None:
                log.close()
            self.close_checkpoints(ok)  # the last checkpoint is complete (or its error raised) before we return
        if main and records:
            plot_loss(log.path, self.run_dir / LOSS_PNG, title=self.run_info.get("title", ""))
        return [records[s] for s in sorted(records)]

    def _report_stragglers(self, step: int, event: Callable[..., None]) -> None:
        """Count the step; every `straggler_interval` steps gather the phase times and report the slow ranks."""
        self.straggler.step_done(step)
        if not self.straggler.due(step):
            return
        times, findings = self.straggler.report(step)
        event(times)
        for finding in findings:
            event(slow_rank_event(step, times["first_step"], finding),
                  f"steps {times['first_step']}-{step}: {finding.describe()}")  # fmt: skip


def _log_line(r: dict[str, Any]) -> str:
    mtp = "" if r["mtp_loss"] is None else f" mtp {r['mtp_loss']:.4f}"
    imb = r["expert_load_max_over_mean"]
    worst = f" load max/mean <= {max(imb.values()):.2f}" if imb else ""
    return (
        f"step {r['step']:>5} loss {r['loss']:.4f}{mtp} lr {r['lr']:.2e} grad_norm {r['grad_norm']:.3f} "
        f"{r['tokens_per_s']:.0f} tok/s{worst}"
    )
