"""Text output of the planner: the ranked layouts with their memory and time breakdowns, the rejection summary,
and the device-spec table with the source of every figure."""

from __future__ import annotations

from moe.trainer.plan.devices import DeviceSpec, source_rows
from moe.trainer.plan.memory_estimate import GIB
from moe.trainer.plan.model_shape import ModelShape
from moe.trainer.plan.search import Estimate, PlanResult
from moe.trainer.plan.space import REASONS, Workload


def table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A plain-text table; `align` holds one 'l' or 'r' per column (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _g(x: float) -> str:
    return f"{x / GIB:.2f}"


def _s(x: float) -> str:
    return f"{x:.3g}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def ranked_table(result: PlanResult, top: int, shape: ModelShape, work: Workload, spec: DeviceSpec) -> str:
    """The `top` fastest layouts: memory (GiB, the worst rank) and time (seconds per step, the bottleneck rank).
    An 'etp' column (the expert tensor-parallel size) follows the layout when a shown layout has etp > 1."""
    shown = result.ranked[:top]
    with_etp = any(e.candidate.etp > 1 for e in shown)
    headers = ["#", "layout", *(["etp"] if with_etp else []), "mem", "wts", "grads", "optim", "act", "(mb)", "trans",
               "other", "step s", "compute", "recomp", "tp", "ep", "pp", "dp", "opt", "bubble", "tok/s",
               "MFU"]  # fmt: skip
    rows = []
    for i, e in enumerate(shown, start=1):
        m, t = e.memory, e.time
        name = e.candidate.name()
        rows.append([
            str(i), name, *([str(e.candidate.etp)] if with_etp else []), _g(m.total), _g(m.weights), _g(m.grads),
            _g(m.optimizer), _g(m.activations), f"{m.inflight:g}", _g(m.transient),
            _g(m.comm_buffers + m.runtime + m.allocator), _s(t.step), _s(t.compute), _s(t.recompute), _s(t.tp_comm),
            _s(t.ep_comm), _s(t.pp_comm), _s(t.dp_comm), _s(t.optimizer), _s(t.bubble),
            f"{e.tokens_per_s(work):.4g}", f"{100 * e.mfu(shape, work, spec):.1f}%",
        ])  # fmt: skip
    return table(headers, rows, "rl" + "r" * (len(headers) - 2))


def legend() -> str:
    return (
        "mem: peak GiB of the worst rank = wts (weights) + grads + optim (AdamW moments and FP32 masters, sharded by "
        "ZeRO-1) + act (activations of the micro-batch chunks in flight, (mb) of them) + trans (backward working set "
        "or gradient-reduction buffer) + other (mtdeepep buffer, process runtime, allocator share).\n"
        "step s: seconds per optimizer step on the bottleneck rank = compute (forward + backward, incl. recomp) + "
        "exposed communication (tp: sequence-parallel collectives, ep: dispatch + combine over the ep x etp ranks, "
        "pp: p2p, dp: gradient "
        "reduction / ZeRO-1 all-gather) + opt (AdamW) + bubble (DualPipe table's bubble of the schedule).\n"
        "MFU: model FLOPs (6 x activated parameters + attention, no recompute) per second over the devices' peak."
    )


def rejection_table(result: PlanResult) -> str:
    rows = [[f"{n:,}", REASONS[k], result.examples.get(k, "")] for k, n in result.rejected.most_common()]
    return table(["choices", "reason", "example"], rows, "rll")


def flags_line(e: Estimate, config_path: str) -> str:
    nproc = e.candidate.world
    flags = " ".join(e.candidate.train_flags())
    return f"torchrun --nproc-per-node {nproc} examples/deepseek_v3/train.py --config {config_path} --out RUN {flags}"


def spec_table(spec: DeviceSpec) -> str:
    rows = [list(r) for r in source_rows(spec)]
    return f"{spec.name}: {spec.title}\n" + table(["figure", "value", "source"], rows, "lrl")
