"""`PipelineRunner`: one optimizer step's micro-batches through the pipeline, on torch's schedules.

    1f1b       `torch.distributed.pipelining.Schedule1F1B`
    zbh1       `ScheduleInterleavedZeroBubble` with one stage per rank: torch's ZB1P, i.e. ZB-H1 (the backward split
               into input-gradient I and weight-gradient W actions, the W deferred into the cool-down bubbles)

Where torch falls short, ours: the I / W split itself. torch's default (`stage_backward_input`, then
`stage_backward_weight` per parameter group) walks the graph twice and cost 1.13-1.41x one fused backward on CPU,
more than the bubble it removes. Zero-bubble stages here pass torch a `dw_builder` instead: the I action is one
ordinary backward in which the GEMMs queue their weight-gradient GEMMs, the W action runs that queue (`moe.layer.wgrad`,
section "Pipeline I / W split"; the zero-bubble paper's and DualPipe's WeightGradStore).
    dualpipev  `ScheduleDualPipeV` (two stages per rank in a V, overlapped forward+backward chunks); the MoE
               layers' communication overlap inside those chunks is ours (moe/trainer/pipeline/overlap.py)

With V > 1 virtual stages per rank (Megatron's `--num-virtual-stages-per-pipeline-rank`; rank r holds stages r,
r + pp, ..., split.py), 1f1b runs `ScheduleInterleaved1F1B` and zbh1 `ScheduleInterleavedZeroBubble` over the V
stages (torch's ZB1P interleaved; the same I / W split).

Our code around them: the stage modules (stages.py), the loss share of every micro-batch (its global-batch scale,
so the schedules' own gradient scaling is off), the loss sums and expert loads brought to every pipeline rank, the
timeline of every action (timeline.py), the report of each stage's last weight-gradient action (ZeRO-1 starts
reducing that stage's gradients then: `set_weight_grads_done`), and the errors: a rank that fails or a peer that
never arrives raises with the step, the pipeline rank and its stages named (the p2p waits are bounded by the process
group's timeout).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from moe.layer import wgrad
from moe.layer.phase_timer import PhaseTimer, phase
from moe.trainer.pipeline.overlap import install_overlapped_forward_backward
from moe.trainer.pipeline.p2p import P2P_TRANSPORTS, BufferP2P
from moe.trainer.pipeline.split import StageSplit, check_schedule, stages_of_rank, stages_per_rank
from moe.trainer.pipeline.stage_modules import DeepseekV3Stage, StageLoss, keep_stages
from moe.trainer.pipeline.timeline import (
    BubbleReport,
    TimelineRecorder,
    analytic_bubble_fraction,
    bubble_fraction,
    expected_bubble_fraction,
    gather_timelines,
    plot_timeline,
    write_chrome_trace,
)

SPLIT_BACKWARD = ("zbh1", "dualpipev")  # schedules whose backward runs as separate I and W actions


def pipeline_moe_options(schedule: str) -> dict[str, bool]:
    """The `MoEConfig` fields (DeepSeek-V3's `moe_options`) of a model to be run under `schedule`. torch's split
    backward runs each graph twice (I, then W), and the MoE layers' own deferred weight gradients would hand theirs
    over in the first pass, which keeps input gradients only: the schedule's W action takes their place, so a
    split-backward schedule needs the model built with them off. Chosen at build; `PipelineRunner` checks it."""
    return {"overlap_dispatch_backward_with_experts_wgrad": False} if schedule in SPLIT_BACKWARD else {}


class TimedStage(PipelineStage):
    """torch's `PipelineStage` that records every action it runs (F, B, I, W) on a `TimelineRecorder`, and times
    them as 'forward' / 'backward' on a `PhaseTimer` (the rest of the schedule's step is 'p2p', see
    `PipelineRunner.step`).

    With `split_weight_grads` (zero-bubble schedules) its GEMMs queue their weight gradients during the backward
    (I) and the W action runs the queue: `moe.layer.wgrad.take_weight_grads` is torch's `dw_builder`.

    `weight_grads_done(stage_index)`, when set, is called once per step right after the action that completes the
    stage's last micro-batch's weight gradients: the one torch's schedules flag `last_backward` (they count the B
    and W actions of each stage; a B, or a W after its I, completes one micro-batch). It runs after the action's
    queued weight-gradient GEMMs (those left in `collecting_weight_grads` included), so every gradient of the stage
    is final then."""

    recorder: TimelineRecorder | None = None
    phase_timer: PhaseTimer | None = None
    weight_grads_done: Callable[[int], None] | None = None
    transport: BufferP2P | None = None  # None: torch.distributed's P2P (see moe/trainer/pipeline/p2p.py)

    def __init__(self, *args, split_weight_grads: bool = False, **kwargs):
        super().__init__(*args, dw_builder=wgrad.take_weight_grads if split_weight_grads else None, **kwargs)
        self.split_weight_grads = split_weight_grads

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self._slot("F", fwd_chunk_id), phase(self.phase_timer, "forward"), self._split_gemms():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        with self._slot("B" if full_backward else "I", bwd_chunk_id), phase(self.phase_timer, "backward"):
            if not self.split_weight_grads:
                super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            else:  # split_gemms: a recompute inside this backward builds its GEMMs split too.
                with self._split_gemms(), wgrad.collecting_weight_grads():
                    super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward and last_backward:  # an I action leaves the weight gradients to its W
            self._weight_grads_done()

    # The P2P seam: torch's ops of this stage, pointed at the transport when there is one.
    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._adopt(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._adopt(super().get_bwd_recv_ops(bwd_chunk_id))

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._adopt(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._adopt(super().get_bwd_send_ops(bwd_chunk_id))

    def _adopt(self, ops):
        return ops if self.transport is None else self.transport.adopt(ops)

    def _split_gemms(self):
        return wgrad.split_gemms() if self.split_weight_grads else contextlib.nullcontext()

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with self._slot("W", bwd_chunk_id), phase(self.phase_timer, "backward"):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        if last_backward:
            self._weight_grads_done()

    def _weight_grads_done(self) -> None:
        if self.weight_grads_done is not None:
            self.weight_grads_done(self.stage_index)

    def _slot(self, kind: str, microbatch: int):
        if self.recorder is None:
            return contextlib.nullcontext()
        return self.recorder.slot(kind, self.stage_index, microbatch)


def _identity_loss(output: torch.Tensor, target) -> torch.Tensor:
    """The last stage already returns the micro-batch's loss share `[1]` (see StageLoss): as a 0-d loss."""
    del target
    return output.sum()


class PipelineRunner:
    """Runs the micro-batches of one optimizer step through `schedule` (see the module docstring).

    Building it prunes `model` to this rank's stages (`keep_stages`): build it before the optimizer.

    Args:
        model: a `DeepseekV3ForCausalLM` (every rank of the pipeline group builds the whole model with the same
            seed, so each keeps the same weights the one-process model has; then the other stages' layers go).
        parallel: the run's `ParallelState` (its `pp_group` and `pp_rank`).
        schedule: '1f1b', 'zbh1' or 'dualpipev'.
        split: decoder layers per stage (`split_layers`), `pp` stages (`2 * pp` for DualPipeV, `V * pp` with
            virtual stages).
        micro_batches: micro-batches per step on each data-parallel rank.
        micro_rows, seq_len: the shape `[micro_rows, seq_len]` of a micro-batch of token ids.
        mtp_loss_weight, num_mtp: as the trainer's.
        recorder: records every action's slot (the bubble report); None records nothing.
        overlap_moe_comm: DualPipeV only: inside each overlapped forward-backward action, one micro-batch's MoE
            dispatch / combine runs while the other micro-batch computes (moe/trainer/pipeline/overlap.py; Megatron's
            `overlap_moe_expert_parallel_comm`). Same losses and gradients bit for bit. `self.overlap` holds it.
        virtual_stages: V, the stages this rank holds round-robin under 1f1b / zbh1 (interleaved; 1: one stage).
        p2p_transport: how activations and gradients move between the ranks (moe/trainer/pipeline/p2p.py): 'torch'
            (torch.distributed's P2P) or 'deepep' (`pp_send` / `pp_recv` of an `mtdeepep.ElasticBuffer` over the
            pipeline group, built here, collectively; `close()` releases it). The same bytes either way.
        p2p_timeout_s: the deepep transport's bound on every wait (None: mtdeepep's default).
    """

    def __init__(
        self,
        model: nn.Module,
        parallel,
        *,
        schedule: str,
        split: StageSplit,
        micro_batches: int,
        micro_rows: int,
        seq_len: int,
        mtp_loss_weight: float,
        num_mtp: int,
        recorder: TimelineRecorder | None = None,
        overlap_moe_comm: bool = False,
        virtual_stages: int = 1,
        p2p_transport: str = "torch",
        p2p_timeout_s: float | None = None,
    ) -> None:
        pp, pp_rank = parallel.layout.pp, parallel.pp_rank
        if p2p_transport not in P2P_TRANSPORTS:
            raise ValueError(f"p2p_transport must be one of {P2P_TRANSPORTS}, got {p2p_transport!r}")
        check_schedule(schedule, pp, micro_batches, virtual_stages)
        num_stages = pp * stages_per_rank(schedule, virtual_stages)
        if split.num_stages != num_stages:
            where = f" with {virtual_stages} virtual stages per rank" if virtual_stages > 1 else ""
            raise ValueError(
                f"the split has {split.num_stages} stages, {schedule} over pp={pp}{where} runs {num_stages}"
            )
        if model.lm_head is None and schedule != "dualpipev":
            raise ValueError(
                f"tie_word_embeddings with {schedule}: the embedding (first stage) and the output head (last stage) "
                "would sit on different pipeline ranks; untie them or use dualpipev (both on rank 0)"
            )
        if schedule in SPLIT_BACKWARD:
            deferring = [
                i for i, m in enumerate(model.moe_layers()) if m.config.overlap_dispatch_backward_with_experts_wgrad
            ]
            if deferring:
                raise ValueError(
                    f"{schedule} splits the backward into I and W actions, but MoE layers {deferring} defer their "
                    "expert weight gradients themselves; build the model with moe_options="
                    f"pipeline_moe_options({schedule!r}) (overlap_dispatch_backward_with_experts_wgrad=False)"
                )
        self.schedule_name = schedule
        self.parallel = parallel
        self.pp_group = parallel.pp_group
        self.micro_batches = micro_batches
        self.virtual_stages = virtual_stages
        self.stage_ids = stages_of_rank(schedule, pp, pp_rank, virtual_stages)
        self.num_stages = num_stages
        self.recorder = recorder
        self.overlap = None
        if overlap_moe_comm and schedule != "dualpipev":
            raise ValueError(f"overlap_moe_comm overlaps DualPipeV's forward-backward chunks; {schedule} has none")
        self.phase_timer: PhaseTimer | None = None
        self._weight_grads_done: Callable[[int], None] | None = None
        self.stages_done: list[int] = []  # the stages that reported their last weight-gradient action, this step
        self.schedule_span: tuple[float, float] | None = None  # perf_counter() around the last step's schedule
        if schedule in SPLIT_BACKWARD:
            # Every GEMM of a weight defers its weight gradient to the W action (moe.layer.wgrad): plain nn.Linear
            # modules are replaced by ones whose GEMM does (same Parameter objects, state-dict keys; FP8's kept).
            wgrad.split_wgrad_linears(model)
        keep_stages(model, split, self.stage_ids)
        self.model = model
        self.loss = StageLoss(mtp_loss_weight, num_mtp)
        self.modules = [DeepseekV3Stage(model, s, split, self.loss) for s in self.stage_ids]
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.stages = []
        for module in self.modules:
            # Static shapes: torch's runtime inference would run one more forward on the first step.
            inputs, outputs = self._example_args(module, micro_rows, seq_len, device)
            stage = TimedStage(module, module.stage, num_stages, device, input_args=inputs, output_args=outputs,
                               group=self.pp_group, split_weight_grads=schedule in SPLIT_BACKWARD)  # fmt: skip
            stage.recorder = recorder
            stage.weight_grads_done = self._stage_weight_grads_done
            self.stages.append(stage)
        self.transport = None
        if p2p_transport == "deepep" and pp > 1:
            # A slot for every tensor of a step a rank may send to one neighbour (both stage directions), so that a
            # send never waits for its receiver, as torch's isend does not; the largest is an activation.
            inputs, outputs = self._example_args(self.modules[0], micro_rows, seq_len, device)
            activations = outputs if isinstance(outputs, tuple) else inputs
            self.transport = BufferP2P(
                self.pp_group, max_tensor_bytes=max(t.numel() * t.element_size() for t in activations),
                max_inflight=2 * len(activations) * micro_batches * len(self.stage_ids), timeout_s=p2p_timeout_s,
            )  # fmt: skip
            for stage in self.stages:
                stage.transport = self.transport
        kw = dict(n_microbatches=micro_batches, loss_fn=_identity_loss, scale_grads=False)
        if schedule == "1f1b" and virtual_stages > 1:
            self.schedule = ScheduleInterleaved1F1B(self.stages, **kw)
        elif schedule == "1f1b":
            self.schedule = Schedule1F1B(self.stages[0], **kw)
        elif schedule == "zbh1":  # torch's ZB1P: ZB-H1 with one stage per rank, interleaved with more
            self.schedule = ScheduleInterleavedZeroBubble(self.stages, **kw)
        else:
            self.schedule = ScheduleDualPipeV(self.stages, **kw)
            if overlap_moe_comm:
                self.overlap = install_overlapped_forward_backward(self.schedule, self)

    def _example_args(self, module: DeepseekV3Stage, rows: int, seq_len: int, device: torch.device):
        """Example tensors of a stage's inputs and outputs (see stages.py): token ids `[b, S]` into the first stage,
        `(h [b, S_r, H], emb [b, S, H])` between stages, the loss share `[1]` FP32 out of the last."""
        model = self.model
        shards = model.sequence_shards(seq_len)
        local = seq_len if shards is None else shards.local_size
        dtype, hidden = model.config_dtype, model.config.hidden_size
        activations = (  # requires_grad: the metadata says the receiving stage sends their gradients back
            torch.empty(rows, local, hidden, dtype=dtype, device=device, requires_grad=True),
            torch.empty(rows, seq_len, hidden, dtype=dtype, device=device, requires_grad=True),
        )
        inputs = torch.empty(rows, seq_len, dtype=torch.int64, device=device) if module.is_first else activations
        outputs = torch.empty(1, dtype=torch.float32, device=device) if module.is_last else activations
        return inputs, outputs

    @property
    def p2p_transport(self) -> str:
        return "torch" if self.transport is None else "deepep"

    def close(self) -> None:
        """Releases the deepep transport's buffer (nothing with torch's). Idempotent."""
        if self.transport is not None:
            self.transport.destroy()

    def set_phase_timer(self, timer: PhaseTimer | None) -> None:
        """Time this rank's pipeline actions on `timer`: F as 'forward', B / I / W as 'backward', the rest of the
        schedule's step (sends, receives, waiting for the neighbours) as 'p2p'. The MoE layers are given the timer
        separately (`MoELayer.set_phase_timer`). None stops timing."""
        self.phase_timer = timer
        for stage in self.stages:
            stage.phase_timer = timer

    def set_weight_grads_done(self, callback: Callable[[int], None] | None) -> None:
        """Call `callback(stage index)` as soon as a stage of this rank has completed its last micro-batch's weight
        gradients in a step (see `TimedStage`; ZeRO-1's `stage_grads_done`), while the schedule goes on. Every
        stage reports once per step, in the schedule's order (the same on every rank holding the same stages).
        None: no call."""
        self._weight_grads_done = callback

    def _stage_weight_grads_done(self, stage: int) -> None:
        if stage in self.stages_done:
            raise RuntimeError(f"stage {stage} reported its last weight-gradient action twice in one step")
        self.stages_done.append(stage)
        if self._weight_grads_done is not None:
            self._weight_grads_done(stage)

    def stage_parameters(self) -> dict[int, list[nn.Parameter]]:
        """`{stage index: its parameters}` for this rank's stages (a parameter shared by two stages, a tied
        embedding, is listed under both)."""
        return {module.stage: list(module.parameters()) for module in self.modules}

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def step(
        self,
        tokens_BS: torch.Tensor,
        counts: torch.Tensor,
        step: int = 0,
        *,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """Forward and backward of every micro-batch of `tokens_BS` (this data-parallel rank's rows); gradients
        accumulate in the parameters of this rank's stages.

        `labels` (default: the tokens), `position_ids` and `document_ids` (packed documents): `[B, S]` int64 like
        `tokens_BS`, as `DeepseekV3ForCausalLM.forward` takes them (checked here, on every pipeline rank, before
        the schedule runs); `counts` must count the targets the model keeps with them (with document_ids:
        moe/trainer/models/deepseek_v3/documents.py `target_counts`).

        Returns `(sums, loads)`: `sums [1 + D] float64` the LM and MTP loss sums over the micro-batches (the same on
        every rank of the pipeline group), `loads` {id(MoE layer): tokens per expert, float64} for this rank's MoE
        layers.
        """
        if labels is not None and (labels.shape != tokens_BS.shape or labels.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"labels must be int64 of the shape of the tokens {list(tokens_BS.shape)}, "
                             f"got {list(labels.shape)} {labels.dtype}")  # fmt: skip
        self.model.check_packed_inputs(tokens_BS, position_ids, document_ids)
        self.loss.counts = counts
        self.loss.sums = []
        self.stages_done = []
        for module in self.modules:
            module.reset_step()
        if self.recorder is not None:
            self.recorder.start_step()
        if self.overlap is not None:
            self.overlap.start_step()
        args = (tokens_BS,) if self.holds_first else ()
        target = tokens_BS if self.holds_last else None
        # The optional per-token inputs travel as keyword arguments, split into micro-batches like the tokens (only
        # those given: the default step is unchanged).
        extra = {k: v for k, v in (("labels", labels), ("position_ids", position_ids),
                                   ("document_ids", document_ids)) if v is not None}  # fmt: skip
        try:
            start = time.perf_counter()
            with phase(self.phase_timer, "p2p"):
                self.schedule.step(*args, target=target, tokens=tokens_BS, **extra)
            self.schedule_span = (start, time.perf_counter())
            if self.transport is not None:
                self.transport.check_drained("the pipeline schedule's step")
        except Exception as exc:
            raise RuntimeError(
                f"step {step}: pipeline rank {self.parallel.pp_rank} (stages {self.stage_ids} of {self.num_stages}, "
                f"schedule {self.schedule_name}) failed: {exc}"
            ) from exc
        if sorted(self.stages_done) != sorted(self.stage_ids):  # a schedule that never flagged a stage's last action
            raise RuntimeError(f"step {step}: pipeline rank {self.parallel.pp_rank}: only stages {self.stages_done} "
                               f"of {self.stage_ids} reported their last weight-gradient action")  # fmt: skip
        sums = torch.zeros(1 + self.loss.num_mtp, dtype=torch.float64)
        if self.holds_last:
            if len(self.loss.sums) != self.micro_batches:
                raise RuntimeError(f"the last stage ran {len(self.loss.sums)} of {self.micro_batches} micro-batches")
            sums = torch.stack(self.loss.sums).sum(0)
        if self.pp_group is not None:
            dist.all_reduce(sums, group=self.pp_group)  # only the last stage's rank contributes
        loads = {id(layer): load for m in self.modules for layer, load in zip(m.moe_layers, m.loads)}
        return sums, loads

    def write_timeline(self, trace_path, png_path=None) -> BubbleReport:
        """The last step's timeline of every pipeline rank (collective over the pipeline group): a Chrome trace
        (Perfetto) and a PNG written by pipeline rank 0, the measured bubble returned on every rank."""
        if self.recorder is None or not self.recorder.enabled:
            raise RuntimeError("no timeline was recorded: build the runner with an enabled TimelineRecorder")
        timelines = gather_timelines(self.recorder, self.pp_group)
        report = bubble_fraction(timelines)
        if self.parallel.pp_rank == 0:
            meta = {"schedule": self.schedule_name, "pp": self.parallel.layout.pp, "micro_batches": self.micro_batches,
                    "virtual_stages": self.virtual_stages,
                    "expected_bubble_fraction": self.expected_bubble_fraction(report)}  # fmt: skip
            write_chrome_trace(trace_path, timelines, metadata=meta)
            if png_path is not None:
                plot_timeline(png_path, timelines, self.describe())
        return report

    def describe(self) -> str:
        """E.g. '1f1b, pp 2, 2 virtual stages per rank, 4 micro-batches'."""
        virtual = f", {self.virtual_stages} virtual stages per rank" if self.virtual_stages > 1 else ""
        return f"{self.schedule_name}, pp {self.parallel.layout.pp}{virtual}, {self.micro_batches} micro-batches"

    def expected_bubble_fraction(self, report: BubbleReport) -> float | None:
        """The analytic bubble share of the step to put beside `report.fraction` (the measured one).

        1F1B (interleaved or not): Megatron's `(pp-1)/(V m)` relative, i.e. `(pp-1)/(V m + pp-1)` of the step
        (`timeline.expected_bubble_fraction`, independent of the action times). ZB-H1 and DualPipeV: DualPipe's
        table from the measured mean F / B / W times, over each rank's measured compute, averaged over the ranks
        (`timeline.analytic_bubble_fraction`, with the V chunks of an interleaved ZB-H1); None where the timeline
        holds no backward slot of its own to derive B from (DualPipeV's backwards may all run inside F&B slots)."""
        pp = self.parallel.layout.pp
        if self.schedule_name == "1f1b":
            return expected_bubble_fraction(pp, self.micro_batches, self.virtual_stages)
        if not {"B", "I"} & set(report.mean_by_kind):
            return None
        units = report.unit_times()
        shares = [
            analytic_bubble_fraction(self.schedule_name, pp, self.micro_batches, units["F"], units["B"],
                                     min(units["W"] or 0.0, units["B"]), units["F_and_B"], compute=rank.busy,
                                     virtual_stages=self.virtual_stages)
            for rank in report.per_rank
        ]  # fmt: skip
        return sum(shares) / len(shares)
