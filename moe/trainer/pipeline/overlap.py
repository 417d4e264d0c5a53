"""DualPipeV's overlapped forward-backward: one micro-batch's MoE communication hidden behind another's compute.

torch's `ScheduleDualPipeV` runs its main phase as OVERLAP_F_B actions: the FORWARD of micro-batch i on one stage of
the rank and the FULL_BACKWARD of micro-batch j on its other stage, which torch's runtime runs one after the other.
`install_overlapped_forward_backward` registers `OverlappedForwardBackward` for OVERLAP_F_B
(`_PipelineScheduleRuntime.register_custom_function`): the two sub-actions run interleaved at their MoE
communication points (`moe.layer.interleave`), DeepSeek's DualPipe overlap:

    forward  (mb i):  attention, router | dispatch ··········· | experts | combine ········· | attention ...
    backward (mb j):          head, MTP ... | combine-bwd ······· | experts bwd | dispatch-bwd ····· | ...

each side starts a dispatch / combine (or, in the backward, the cached dispatch of the combine's backward and the
combine of the dispatch's backward), then the other side computes until it starts one of its own; then the first
waits, its data having moved meanwhile. The forward starts, unless only the backward's stage communicates (the
first stage's dense layers, say): then the backward starts, so that its first communication runs under the whole
forward (hand-overs happen only where a side communicates, so a side without communication runs to its end in
one go). Each side runs the code it runs alone (a thread per
side, one baton), so losses and gradients are bit-identical to overlap off: same operations, same order, same
accumulation into `.grad` (autograd's, with ZeRO-1's post-accumulate hooks, as before), and the MoE recompute levels
run their recomputations (communication included) inside the backward side as usual.

Bookkeeping, as torch's runtime does for each sub-action (`_PipelineScheduleRuntime._step_microbatches`): the
FORWARD waits for its received activations (unless the previous stage is on this rank), runs
`stage.forward_one_chunk` (fwd_cache, output_chunks), computes the loss on the last stage (`_maybe_compute_loss`:
the schedule's internal losses) and hands its output to the next stage when that is on this rank; the
FULL_BACKWARD waits for its received gradients (unless the next stage is here), takes the loss
(`_maybe_get_loss`), counts the backward (`backward_counter`, `last_backward`), runs `stage.backward_one_chunk`
(received grads, bwd_cache, grad sending by the later SEND_B action) and hands its input gradients to the previous
stage when that is on this rank. Both waits happen before the two sides start (torch waits for the backward's after
the forward; nothing the forward does can be what that receive waits for: sends come after the action).
`return_outputs=True`, no loss kwargs: what `PipelineRunner.step` asks of `schedule.step`.

Where it runs the sub-actions one after the other instead (the action is still one 'F&B' slot):
- this rank's stages have no expert-parallel communication (EP 1, or no MoE layer): nothing to hide;
- an MoE layer's dispatcher is not mtdeepep's normal mode ('flex', `FlexDispatcher`; DeepSeek-V3's): several of
  its calls in flight on one buffer are known to queue correctly, the other dispatchers are not checked for it;
- an MoE layer draws router input jitter (`moe_input_jitter_eps`) from the global random generator: interleaved, the
  draws of two micro-batches would change order, and a checkpoint's recomputation sets the global generator's state
  while the other side runs.
The decision depends only on the model and the stages, so every rank of an EP / TP group (same pipeline rank, same
stages) decides alike and issues its collectives in the same order.

Timeline (`PipelineRunner.recorder`): one 'F&B' slot per action (stage pair, micro-batch pair) instead of an 'F' and
a 'B' slot, and a 'comm' slot for every MoE communication of either side, from its start to the end of its wait;
`records` keeps each action's interleaver events (see `FBRecord`, `summarize`, `plot_fb`).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    _Action,
    _PipelineContext,
    _wait_batch_p2p,
)

from moe.layer.dispatcher.flex import FlexDispatcher
from moe.layer.interleave import Comm, Event, Interleaver, comms_of, compute_spans
from moe.trainer.io.atomic import write_bytes
from moe.trainer.pipeline.timeline import TimelineRecorder


@dataclass
class FBRecord:
    """One OVERLAP_F_B action: the forward's and the backward's stage and micro-batch, its span (seconds of
    `time.perf_counter`), whether the two sides were interleaved, and the interleaver's events ('F' and 'B' sides)."""

    stages: tuple[int, int]
    microbatches: tuple[int, int]
    start: float
    end: float
    interleaved: bool
    events: list[Event] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def comms(self) -> list[Comm]:
        return comms_of(self.events)

    def hidden(self, comm: Comm) -> float:
        """Seconds of `comm`'s flight during which the other side computed (an upper bound of the communication
        time hidden: the data may have arrived before the other side handed back)."""
        other = "B" if comm.side == "F" else "F"
        spans = compute_spans(self.events, other)
        return sum(max(0.0, min(end, comm.done) - max(start, comm.issue)) for start, end in spans)


def sequential_reason(stage_modules) -> str | None:
    """Why this rank runs its F&B actions sequentially (see the module docstring), or None to interleave them."""
    layers = [layer for module in stage_modules for layer in module.moe_layers]
    communicating = [layer for layer in layers if layer.dispatch_group_size > 1]
    if not communicating:
        return "no expert-parallel communication in this rank's stages"
    for layer in communicating:
        if not isinstance(getattr(layer.dispatcher, "inner", layer.dispatcher), FlexDispatcher):  # ETP wraps one
            return f"MoE dispatcher {type(layer.dispatcher).__name__}: only 'flex' (FlexDispatcher) is interleaved"
        if layer.config.moe_input_jitter_eps:
            return "moe_input_jitter_eps draws from the global random generator"
    return None


class OverlappedForwardBackward:
    """The OVERLAP_F_B function of one `ScheduleDualPipeV` (see the module docstring).

    Args:
        schedule: the `ScheduleDualPipeV` (its stages, p2p receives, losses and backward counts are used as torch's
            runtime uses them).
        stage_modules: the stages' modules (`DeepseekV3Stage`), for the fallback rules.
        recorder: the runner's timeline recorder (None: no slots).
        interleave: False runs every action sequentially with the same records (a measurement baseline).
    """

    def __init__(self, schedule, stage_modules, recorder: TimelineRecorder | None = None, interleave: bool = True):
        self.schedule = schedule
        self.stages = {stage.stage_index: stage for stage in schedule._stages}
        self.recorder = recorder
        self.reason = sequential_reason(stage_modules) if interleave else "interleave=False"
        self.interleave = self.reason is None
        self.interleaver = Interleaver(("F", "B"))
        self.communicates = {
            m.stage: any(layer.dispatch_group_size > 1 for layer in m.moe_layers) for m in stage_modules
        }
        self.records: list[FBRecord] = []

    def start_step(self) -> None:
        self.records = []

    def close(self) -> None:
        self.interleaver.close()

    def __call__(self, action: _Action, ctx: _PipelineContext) -> None:
        subs = action.sub_actions
        if action.computation_type != OVERLAP_F_B or subs is None or len(subs) != 2:
            raise ValueError(f"expected an OVERLAP_F_B action with two sub-actions, got {action}")
        fwd, bwd = subs
        if fwd.computation_type != FORWARD or bwd.computation_type != FULL_BACKWARD:
            raise ValueError(f"expected (FORWARD, FULL_BACKWARD) sub-actions, got {subs}")
        schedule, stages = self.schedule, self.stages
        f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
        f_mb, b_mb = fwd.microbatch_index, bwd.microbatch_index
        for stage in (f_stage, b_stage):
            schedule._assert_unsharded(stage)
        # The received activations and gradients, as torch's runtime waits for them (see the module docstring).
        if not f_stage.is_first and fwd.stage_index - 1 not in stages:
            if (fwd.stage_index, f_mb) not in schedule.fwd_recv_ops:
                raise AssertionError(f"Computing {fwd=} before receiving input")
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, f_mb)))
        if not b_stage.is_last and bwd.stage_index + 1 not in stages:
            if (bwd.stage_index, b_mb) not in schedule.bwd_recv_ops:
                raise AssertionError(f"Attempted to run compute {bwd=} before receiving input")
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, b_mb)))

        def forward() -> None:
            output = f_stage.forward_one_chunk(f_mb, ctx.arg_mbs[f_mb], ctx.kwarg_mbs[f_mb], save_forward_output=True)
            schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_mb, None)
            if fwd.stage_index + 1 in stages:  # the V's turn: the next stage is on this rank
                stages[fwd.stage_index + 1].set_local_fwd_input(output, f_mb)

        def backward() -> None:
            loss = schedule._maybe_get_loss(b_stage, b_mb)
            schedule.backward_counter[bwd.stage_index] += 1
            last = schedule.backward_counter[bwd.stage_index] == schedule._n_microbatches
            b_stage.backward_one_chunk(b_mb, loss=loss, full_backward=True, last_backward=last)
            if bwd.stage_index - 1 in stages:
                stages[bwd.stage_index - 1].set_local_bwd_input(b_stage.get_local_bwd_output(b_mb), b_mb)

        recorder = self.recorder
        clock = recorder.clock if recorder is not None else self.interleaver.clock
        suspended = recorder is not None and recorder.suspended
        if recorder is not None:
            recorder.suspended = True  # the stages' own F and B slots: this action is one F&B slot
        try:
            start = clock()
            backward_first = self.communicates[bwd.stage_index] and not self.communicates[fwd.stage_index]
            self.interleaver.run(forward, backward, interleave=self.interleave, start=int(backward_first))
            end = clock()
        finally:
            if recorder is not None:
                recorder.suspended = suspended
        record = FBRecord((fwd.stage_index, bwd.stage_index), (f_mb, b_mb), start, end, self.interleave,
                          list(self.interleaver.events))  # fmt: skip
        self.records.append(record)
        if recorder is not None and recorder.enabled:
            recorder.add("F&B", record.stages, record.microbatches, start, end)
            for comm in record.comms():
                side = 0 if comm.side == "F" else 1
                recorder.add("comm", record.stages[side], record.microbatches[side], comm.issue, comm.done)


def install_overlapped_forward_backward(schedule, runner, interleave: bool = True) -> OverlappedForwardBackward:
    """Registers an `OverlappedForwardBackward` for `schedule`'s OVERLAP_F_B actions (a `ScheduleDualPipeV` built by
    `runner`, a `PipelineRunner`: its stage modules and recorder) and returns it."""
    fb = OverlappedForwardBackward(schedule, runner.modules, runner.recorder, interleave=interleave)
    schedule.register_custom_function(OVERLAP_F_B, fb)
    return fb


def summarize(records: list[FBRecord]) -> dict:
    """Totals over F&B actions (seconds): their time, the MoE communications' time in flight, the part of it the
    waiting side was blocked (exposed), and the part during which the other side computed (hidden, an upper bound).
    """
    comms = [(r, c) for r in records for c in r.comms()]
    return {
        "actions": len(records),
        "interleaved": sum(r.interleaved for r in records),
        "fb_s": sum(r.duration for r in records),
        "comms": len(comms),
        "comm_in_flight_s": sum(c.in_flight for _, c in comms),
        "comm_exposed_s": sum(c.exposed for _, c in comms),
        "comm_hidden_s": sum(r.hidden(c) for r, c in comms),
    }


_SIDE_COLOURS = {"F": "#f4a259", "B": "#5b8e7d"}
IN_FLIGHT_COLOUR, EXPOSED_COLOUR = "#c8c8c8", "#555555"  # a communication's flight, and the part its side waited


def plot_fb(path_png: str | os.PathLike, record: FBRecord, title: str = "") -> None:
    """Draws one F&B action: a compute lane and a communication lane per side (forward 'F', backward 'B'), each
    communication from its start to the end of its wait with the exposed part (the side blocked waiting) darker, so
    that one side's communication can be seen under the other side's compute. Written atomically (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    origin = record.start
    lanes = [("F", "compute"), ("F", "comm"), ("B", "compute"), ("B", "comm")]
    fig = Figure(figsize=(12.0, 3.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_yticks(range(len(lanes)))
    f_stage, b_stage = record.stages
    f_mb, b_mb = record.microbatches
    names = {"F": f"F mb {f_mb} s{f_stage}", "B": f"B mb {b_mb} s{b_stage}"}
    ax.set_yticklabels([f"{names[side]}\n{what}" for side, what in lanes], fontsize=8)
    ax.set_xlabel("ms from the action's start")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    for row, (side, what) in enumerate(lanes):
        colour = _SIDE_COLOURS[side]
        if what == "compute":
            for start, end in compute_spans(record.events, side):
                ax.barh(row, (end - start) * 1e3, left=(start - origin) * 1e3, height=0.6, color=colour,
                        edgecolor="black", linewidth=0.4)  # fmt: skip
            continue
        for comm in record.comms():
            if comm.side != side:
                continue
            draw_comm(ax, row, comm, origin)
            ax.text((comm.issue - origin) * 1e3, row - 0.3, comm.name.replace("_backward", "-bwd"), fontsize=6)
    s = summarize([record])
    hidden = s["comm_hidden_s"] / s["comm_in_flight_s"] if s["comm_in_flight_s"] else 0.0
    head = f"{title} — " if title else ""
    ax.set_title(f"{head}F&B {record.duration * 1e3:.2f} ms; MoE comm in flight {s['comm_in_flight_s'] * 1e3:.2f} ms, "
                 f"{hidden:.0%} of it under the other side's compute, exposed wait {s['comm_exposed_s'] * 1e3:.2f} ms",
                 fontsize=9)  # fmt: skip
    compute = {_SIDE_COLOURS["F"]: "forward compute", _SIDE_COLOURS["B"]: "backward compute"}
    save_with_legend(fig, ax, path_png, compute, "comm in flight")


def draw_comm(ax, row: float, comm: Comm, origin: float) -> None:
    """Draws `comm` on lane `row` of an axis in ms from `origin`: its flight (issue -> done) light, its exposed wait
    (resume -> done: the side blocked) dark over it."""
    ax.barh(row, comm.in_flight * 1e3, left=(comm.issue - origin) * 1e3, height=0.45, color=IN_FLIGHT_COLOUR,
            edgecolor="black", linewidth=0.4)  # fmt: skip
    ax.barh(row, comm.exposed * 1e3, left=(comm.resume - origin) * 1e3, height=0.45, color=EXPOSED_COLOUR)


def save_with_legend(fig, ax, path_png: str | os.PathLike, compute: dict[str, str], in_flight_label: str) -> None:
    """A legend right of `ax` (`compute`: colour -> label of the compute bars, then the communication's two shades),
    then `fig` written as a PNG, atomically."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=colour, label=label) for colour, label in compute.items()]
    handles += [Patch(facecolor=IN_FLIGHT_COLOUR, label=in_flight_label), Patch(facecolor=EXPOSED_COLOUR,
                                                                               label="exposed wait")]  # fmt: skip
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes(Path(path_png), buf.getvalue(), mode=0o644)
