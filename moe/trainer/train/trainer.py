"""The training loop: global batches split over data-parallel ranks and micro-batches, one optimizer step each,
metrics, checkpoints and resumption.

The maths of a step do not depend on the layout (see moe/trainer/train/parallel_state.py and
moe/trainer/train/optim.py): 1. Every rank takes its rows of the global batch (`DataSource.local_batch`,
   moe/trainer/data/source.py) and splits them into micro-batches. With `eod_mask_loss` the labels drop the target
   after every end-of-text token; with
   `reset_position_ids` / `reset_attention_mask` the model gets each position's document
   (moe/trainer/models/deepseek_v3/documents.py): positions restart and attention stays inside every document.
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

Checkpoints (moe/trainer/train/checkpoint/): `Checkpointer.save(step, last_step=...)` takes one every `checkpoint_every`
steps and at the last one: each rank copies its shard of the state list (`TrainState`: its experts, its TP shard,
its stages, its ZeRO-1 shards, its generators and FP8 amax histories, the counters) into CPU memory and a background
thread writes it; rank 0 commits the checkpoint once every shard is on disk. The last checkpoint also holds the
whole model as a model directory (model.safetensors + config.json). `Checkpointer.load` reads the boxes this rank
needs from any layout's checkpoint.

Anomalies (moe/trainer/train/rewind.py): before the optimizer step, the global loss and gradient norm are checked for
NaN/Inf and the loss for a spike; an anomalous step makes no update, `fit` restores the last in-memory snapshot and
skips the step (its batch), as a step listed in `iterations_to_skip` is skipped. Injected faults (the tests' hook,
moe/trainer/train/faults.py) act at named hook points of the components, not in the loop. Slow ranks
(moe/trainer/train/straggler.py): with `log_straggler`, every rank times its phases and every `straggler_interval` steps
the ranks much slower than their peers in a phase are reported. Both write their events into metrics.jsonl (records
with a "kind"; the step records have none).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe.layer.balancing import load_spread, set_aux_loss_scale, update_expert_bias
from moe.layer.loss import loss_share
from moe.layer.peak_memory import process_peak_bytes
from moe.layer.phase_timer import PhaseTimer, phase
from moe.trainer.data.source import DataSource, eod_masked_labels
from moe.trainer.models.deepseek_v3 import documents
from moe.trainer.train.checkpoint import Checkpointer, ModelIO, TrainState
from moe.trainer.train.faults import FaultPlan
from moe.trainer.train.loggers import LoggerFactory
from moe.trainer.train.metrics import LOSS_PNG, RunReport, mfu
from moe.trainer.train.optim import MasterAdamW
from moe.trainer.train.parallel_state import ParallelState, all_reduce_sum
from moe.trainer.train.profiling import StepProfiler
from moe.trainer.train.rewind import AnomalyDetected, RewindGuard, TrainingStopped
from moe.trainer.train.schedule import lr_at
from moe.trainer.train.straggler import StragglerMonitor, slow_rank_event
from moe.trainer.train.training_config import TrainerConfig
from moe.trainer.train.zero import DistributedAdamW, ZeroConfig


def step_seed(seed: int, step: int) -> int:
    """The torch seed of optimizer step `step` of a run seeded `seed` (independent of the layout)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def target_counts(labels_BS: torch.Tensor, num_mtp: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`[1 + num_mtp] float64`: next-token targets of the main head and of each MTP depth in `labels_BS`.

    HF's shift convention: position t predicts `labels[t + 1]` (depth d: `labels[t + 1 + d]`); -100 is ignored.
    With packed `document_ids [B, S]`, the MTP depths also drop the targets whose input spans two documents. The
    model's own count (`documents.target_counts`), so the normalisers always equal what the forward keeps.
    """
    return documents.target_counts(labels_BS, document_ids, num_mtp)


class Trainer:
    """Runs the optimizer steps of one rank.

    Args:
        model: `forward(input_ids [B, S] int64, labels=[B, S] int64)` returning an object with `lm_loss_sum`
            (0-d FP32 sum of next-token cross-entropy), `mtp_loss_sums` (list of 0-d sums, one per MTP depth) and
            `num_tokens`; `moe_layers()` listing its `moe.MoELayer`s.
        config: the components' configs (`TrainerConfig`: [training], [optimizer], [zero], [checkpoint],
            [rewind], [straggler], [data]), each handed to its component alone.
        parallel: this rank's groups.
        batches: the run's global batches (a `DataSource`); with `[data] eod_mask_loss` it must know its
            `eod_id`.
        run_dir: where metrics, the plot and checkpoints go (rank 0 writes).
        seed: the run's seed (data order and per-step generator).
        model_io: model saving and loading.
        mtp_loss_weight: lambda of the MTP loss (summed over depths and divided by their number, as DeepSeek-V3).
        num_mtp: MTP depths the model predicts.
        extra_checkpoint_files: files copied into every checkpoint (e.g. the tokenizer).
        pipeline: with pipeline parallelism, the `moe.trainer.pipeline.PipelineRunner` that runs each step's
            micro-batches (built first: it prunes `model` to this rank's stages).
        faults: test hook: faults to inject (moe/trainer/train/faults.py), None for none.
        run_info: keys added to every checkpoint's trainer_state.json ("title": the loss plot's title).
        checkpoint_timeout_s: how long rank 0 waits for the other ranks' shards of one checkpoint.
        model_flops_per_token: the model's training FLOPs per token of the global batch (forward + backward; the
            caller counts them from the model's config, e.g. moe/trainer/models/deepseek_v3/flops.py), and
        peak_flops_per_rank: one rank's peak FLOP/s (moe/trainer/plan/peak.py, the same figure on every rank): with
            both, every step record carries its MFU over the layout's ranks (`moe.trainer.train.metrics.mfu`), else
            "mfu" None.
        loggers: on the main rank, opens the run's TensorBoard / W&B loggers for a launch resuming from a step
            (`moe.trainer.train.loggers.open_loggers`); None: metrics.jsonl only.
        profiler: this rank's `torch.profiler` over the chosen steps (moe/trainer/train/profiling.py); None: none.
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainerConfig,
        parallel: ParallelState,
        batches: DataSource,
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
        model_flops_per_token: float | None = None,
        peak_flops_per_rank: float | None = None,
        loggers: LoggerFactory | None = None,
        profiler: StepProfiler | None = None,
    ) -> None:
        self.model = model
        self.loggers, self.profiler = loggers, profiler
        self.pipeline = pipeline
        if parallel.layout.pp > 1 and pipeline is None:
            raise ValueError(f"--pp {parallel.layout.pp} needs a PipelineRunner (moe.trainer.pipeline)")
        self.config = config
        self.parallel = parallel
        self.batches = batches
        data = config.data
        flags = [n for n in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask") if getattr(data, n)]
        if flags and batches.eod_id is None:
            raise ValueError(f"[data] {', '.join(flags)}: the data's end-of-text id is not known")
        self.eod_mask_id = batches.eod_id if data.eod_mask_loss else None
        self.reset_position_ids, self.reset_attention_mask = data.reset_position_ids, data.reset_attention_mask
        self.run_dir = Path(run_dir)
        self.seed = seed
        self.mtp_loss_weight = float(mtp_loss_weight)
        self.num_mtp = int(num_mtp)
        self.run_info = run_info or {}
        if (model_flops_per_token is None) != (peak_flops_per_rank is None):
            raise ValueError("MFU needs both model_flops_per_token and peak_flops_per_rank (or neither)")
        for name, value in (("model_flops_per_token", model_flops_per_token),
                            ("peak_flops_per_rank", peak_flops_per_rank)):  # fmt: skip
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.model_flops_per_token, self.peak_flops_per_rank = model_flops_per_token, peak_flops_per_rank
        self.moe_layers = list(model.moe_layers())
        names = {id(m): n for n, m in model.named_modules()}
        self.moe_layer_names = [names[id(m)] for m in self.moe_layers]
        expert_params = [p for layer in self.moe_layers for p in layer.experts.parameters()]
        lay = parallel.layout
        sharded = lay.ep * lay.etp > 1
        if sharded and any((layer.ep_size, layer.etp_size) != (lay.ep, lay.etp) for layer in self.moe_layers):
            raise ValueError(f"the model's MoE layers are not sharded over --ep {lay.ep} --etp {lay.etp}")
        training = config.training
        if config.zero.use_distributed_optimizer:  # built before any backward: it installs the gradient hooks
            zero = ZeroConfig(
                bucket_size=config.zero.ddp_bucket_size, overlap_grad_reduce=config.zero.overlap_grad_reduce
            )
            # Under a pipeline the buckets follow the stages, and each stage's buckets start reducing once the
            # schedule has run its last weight-gradient action (with overlap_grad_reduce).
            stage_params = pipeline.stage_parameters() if pipeline is not None else None
            self.optimizer = DistributedAdamW(model, expert_params, config.optimizer, parallel, zero,
                                             stage_params=stage_params)  # fmt: skip
            if pipeline is not None:
                pipeline.set_weight_grads_done(self.optimizer.stage_grads_done)
        else:
            self.optimizer = MasterAdamW(model, expert_params, config.optimizer, parallel)
        self.local_rows = training.global_batch // parallel.layout.dp
        self.micro_rows = self.local_rows // training.micro_batches
        # The state list: what checkpoints save and load, and what the rewind snapshot copies.
        self.state = TrainState.of_trainer(
            model, self.optimizer, training, config.optimizer, parallel, batches, seed=seed, run_info=self.run_info,
            full_state_dict=model_io.full_state_dict if model_io is not None else None,
        )  # fmt: skip
        # Anomaly checks and rewind, slow-rank detection, injected faults.
        self.faults = faults if faults is not None else FaultPlan()
        self.guard = RewindGuard(config.rewind, self.state, world=parallel.layout.world, rank=parallel.rank)
        self.phase_timer: PhaseTimer | None = None
        self.straggler: StragglerMonitor | None = None
        if config.straggler.log_straggler:
            self.phase_timer = PhaseTimer()
            for layer in self.moe_layers:
                layer.set_phase_timer(self.phase_timer)
            if pipeline is not None:
                pipeline.set_phase_timer(self.phase_timer)
            self.straggler = StragglerMonitor(
                self.phase_timer, world=parallel.layout.world, pp=parallel.layout.pp,
                interval=config.straggler.straggler_interval, factor=config.straggler.straggler_factor,
                min_seconds=config.straggler.straggler_min_seconds,
            )  # fmt: skip
        elif self.faults.has_delays:
            raise ValueError("injected sleep faults act on the phase timer: set [straggler] log_straggler = true")
        if pipeline is not None and self.faults.has_loss_faults:
            raise ValueError("injected loss faults act in the trainer's micro-batch loop, which pipeline runs skip")
        self.checkpointer = Checkpointer(self.run_dir, parallel, self.state, every=config.checkpoint.checkpoint_every,
                                         model_io=model_io, extra_files=extra_checkpoint_files, faults=self.faults,
                                         timeout_s=checkpoint_timeout_s)  # fmt: skip

    # -- one optimizer step

    def train_step(self, step: int) -> dict[str, Any]:
        """Optimizer step `step` (1-based); returns its metrics record (the same on every rank). Raises
        `AnomalyDetected` on every rank, before any update, when the step fails its checks
        (moe/trainer/train/rewind.py)."""
        cfg, par = self.config.training, self.parallel
        timer = self.phase_timer
        self.faults.at("step_start", step=step, rank=par.rank, timer=timer)
        start = time.perf_counter()
        torch.manual_seed(step_seed(self.seed, step))
        self.model.train()
        data_start = time.perf_counter()
        tokens_BS = self.batches.local_batch(step, par.dp_rank, par.layout.dp)
        labels_BS = tokens_BS if self.eod_mask_id is None else eod_masked_labels(tokens_BS, self.eod_mask_id)
        packed = self._packed_documents(tokens_BS)
        data_s = time.perf_counter() - data_start  # the loader's share of the step (memory maps to tensors)
        counts = target_counts(labels_BS, self.num_mtp, packed.get("document_ids"))
        counts = all_reduce_sum(counts, par.dp_group)  # global targets per head
        set_aux_loss_scale(self.model, self.micro_rows / cfg.global_batch)
        self.optimizer.zero_grad()

        num_experts = [layer.config.num_moe_experts for layer in self.moe_layers]
        if self.pipeline is not None:
            # The schedule interleaves the micro-batches' backwards, so the hooks cannot tell a stage's last gradient:
            # no_sync() for the whole schedule. ZeRO-1 launches a stage's buckets when the schedule reports the
            # stage's last weight-gradient action (`stage_grads_done`), reduce_gradients the rest.
            with self.optimizer.accumulation_context(0, 2):
                labels = None if labels_BS is tokens_BS else labels_BS
                sums, load_of = self.pipeline.step(tokens_BS, counts, step, labels=labels, **packed)
            loads = [load_of[id(layer)] for layer in self.moe_layers]
        else:
            sums, loads = self._micro_batches(tokens_BS, labels_BS, counts, step, packed)
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
            opt = self.config.optimizer
            lr = lr_at(step, lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.warmup_steps, total_steps=cfg.steps)
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
        spread = {n: load_spread(c) for n, c in zip(self.moe_layer_names, loads)}
        if par.pp_group is not None:  # every stage's MoE layers in the record
            stages: list[dict] = [{} for _ in range(par.layout.pp)]
            dist.all_gather_object(stages, spread, group=par.pp_group)
            spread = {k: v for part in stages for k, v in part.items()}
        self.state.progress.step = step
        tokens_per_s = cfg.global_batch * cfg.seq_len / elapsed
        return {
            "step": step,
            "loss": loss,
            "mtp_loss": mtp_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": self._mfu(tokens_per_s),
            "step_s": elapsed,
            "data_s": data_s,
            "max_peak_memory_mib": float(per_rank[0]) / 2**20,
            "max_optimizer_state_mib": float(per_rank[1]) / 2**20,
            # Per MoE layer: the tokens-per-expert maximum and minimum over their mean, and their coefficient of
            # variation (moe.layer.balancing.load_spread).
            "expert_load_max_over_mean": {n: s["max_over_mean"] for n, s in spread.items()},
            "expert_load_min_over_mean": {n: s["min_over_mean"] for n, s in spread.items()},
            "expert_load_cv": {n: s["cv"] for n, s in spread.items()},
        }

    def _mfu(self, tokens_per_s: float) -> float | None:
        """MFU of a step at `tokens_per_s` (this rank's step time; the main rank's record is the one written) over
        every rank of the layout."""
        if self.model_flops_per_token is None:
            return None
        return mfu(self.model_flops_per_token, tokens_per_s, self.peak_flops_per_rank, self.parallel.layout.world)

    def _packed_documents(self, tokens_BS: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's packed-document keywords for `tokens_BS` (Megatron's reset_position_ids /
        reset_attention_mask): `position_ids` and / or `document_ids`, `[B, S] int64`; empty without the flags."""
        if not (self.reset_position_ids or self.reset_attention_mask):
            return {}
        doc_BS = documents.document_ids(tokens_BS, self.batches.eod_id)
        packed = {"position_ids": documents.positions_in_documents(doc_BS)} if self.reset_position_ids else {}
        if self.reset_attention_mask:
            packed["document_ids"] = doc_BS
        return packed

    def _micro_batches(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor, counts: torch.Tensor, step: int,
                       packed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:  # fmt: skip
        """Forward and backward of each micro-batch in turn (no pipeline) of step `step`: `(loss sums [1 + D]
        float64, tokens per expert of each MoE layer)`. The "loss" fault hook point (test hook) may corrupt the
        first micro-batch's LM loss sum."""
        cfg, timer = self.config.training, self.phase_timer
        sums = torch.zeros(1 + self.num_mtp, dtype=torch.float64)
        loads = [torch.zeros(layer.config.num_moe_experts, dtype=torch.float64) for layer in self.moe_layers]
        micro_packed = [dict(zip(packed, parts)) for parts in zip(*(t.split(self.micro_rows) for t in packed.values()))]
        for index, (mb_BS, mb_labels) in enumerate(zip(tokens_BS.split(self.micro_rows),
                                                       labels_BS.split(self.micro_rows))):  # fmt: skip
            # ZeRO-1: no gradient communication before the last micro-batch's backward (then it overlaps it).
            with self.optimizer.accumulation_context(index, cfg.micro_batches):
                with phase(timer, "forward"):
                    out = self.model(mb_BS, labels=mb_labels, **(micro_packed[index] if packed else {}))
                    if index == 0:
                        out.lm_loss_sum = self.faults.at("loss", step=step, rank=self.parallel.rank,
                                                         value=out.lm_loss_sum)  # fmt: skip
                    loss, mb_sums = loss_share(out, counts, self.mtp_loss_weight, self.num_mtp)
                with phase(timer, "backward"):
                    loss.backward()
            sums += mb_sums
            for load, layer in zip(loads, self.moe_layers):
                load += layer.metrics.tokens_per_expert.double()
        return sums, loads

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
        last, rank = self.config.training.steps, self.parallel.rank
        loggers = self.loggers(start_step) if self.loggers is not None and self.parallel.is_main else []
        report = RunReport(self.run_dir, total_steps=last, start_step=start_step,
                           log_every=self.config.training.log_every, main=self.parallel.is_main,
                           loggers=loggers)  # fmt: skip
        records: dict[int, dict[str, Any]] = {}
        step, ok = start_step + 1, False
        profiler = self.profiler
        try:
            while step <= last:
                self.checkpointer.raise_if_failed()  # a background write's error surfaces at the next step
                self.faults.at("before_step", step=step, rank=rank, drain=self.checkpointer.wait)
                if profiler is not None:
                    profiler.before_step(step)
                rewound_to = self._step(step, report, records)
                if profiler is not None:
                    profiler.after_step(step)
                if rewound_to is not None:  # the snapshot's state is back: run again from its step
                    step = rewound_to
                    continue
                report.advance(step)
                self.checkpointer.save(step, last_step=step == last)
                step += 1
            ok = True
        finally:
            if profiler is not None:
                profiler.close()
            report.close()
            self.checkpointer.close(ok)  # the last checkpoint is complete (or its error raised) before we return
        if records:
            report.plot(self.run_dir / LOSS_PNG, title=self.run_info.get("title", ""))
        return [records[s] for s in sorted(records)]

    def _step(self, step: int, report: RunReport, records: dict[int, dict[str, Any]]) -> int | None:
        """Step `step`: skipped (configured, or rewound before), or trained and reported (its record into
        `records`); an anomaly rewinds. Returns the step to run next after a rewind, None otherwise."""
        configured_skip = step in self.config.rewind.iterations_to_skip
        if configured_skip or step in self.guard.skipped:
            if configured_skip and report.fresh(step):
                report.event(
                    {"kind": "skip", "step": step, "reason": "iterations_to_skip"},
                    f"step {step:>5} skipped (iterations_to_skip): no update, its batch is not used",
                )
            self.state.progress.step = step
            return None
        snapshot_s = self.guard.maybe_snapshot(step)
        try:
            record = self.train_step(step)
        except AnomalyDetected as anomaly:
            return self._rewind(step, anomaly, report)
        if snapshot_s is not None:  # taken before the step, outside its step_s
            record["snapshot_s"] = snapshot_s
            record["snapshot_mib"] = self.guard.snapshot.nbytes / 2**20
        records[step] = record
        report.record(record)
        if self.straggler is not None:
            self._report_stragglers(step, report.event)
        return None

    def _rewind(self, step: int, anomaly: AnomalyDetected, report: RunReport) -> int:
        """Rewind after the anomaly of step `step` (or stop, with a "stop" event); returns the step to run next."""
        if self.straggler is not None:
            self.straggler.step_done(step)
        try:
            rewind = self.guard.rewind(anomaly)
        except TrainingStopped as stop:
            report.event({"kind": "stop", "step": stop.step, "reason": stop.reason, "message": str(stop)},
                         f"stopped: {stop}")  # fmt: skip
            raise
        e = rewind.event
        report.event(e, f"step {step:>5} rewound ({e['reason']}): {e['message']}; restored the state after "
                        f"step {e['restored_to_step']}, step {step} is skipped")  # fmt: skip
        return rewind.resume_step

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
