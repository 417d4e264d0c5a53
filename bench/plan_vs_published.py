"""The planner against SimuMax's published GPU runs: every DeepSeek case of SimuMax's B200 release table and its
A100-PCIe table, with the real measurement, SimuMax's prediction and ours side by side.

The cases and their settings are data (bench/data/simumax_published.toml: numbers transcribed from the public
MooreThreads/SimuMax repository, with the commit); the models are this project's config files
(examples/deepseek_v3/configs/deepseek_v2_236b.toml, 671b.toml) cut to each case's layer count, so
`plan.py --layout` prices the same case to the same figures. The tables' Llama3 rows (24 + 7 on B200, 24 on
A100-PCIe) are not priced: they need GQA attention, and this project's model has MLA only (its config refuses
num_key_value_heads != num_attention_heads). For each case the planner prices the named layout
(`moe.trainer.plan.layout.parse_layout`, `moe.trainer.plan.search.estimate`) on the built-in device spec (`b200`,
`a100-pcie`: datasheet figures and SimuMax's published micro-benchmarks, moe/trainer/plan/devices.py) for the trainer
the runs used (`moe.trainer.plan.framework.MEGATRON_ALLTOALL`: Megatron's all-to-all dispatcher, no overlapped gradient
reduction). Nothing here is fitted to the step times or memory of these runs.

- time: our step time vs the real step (B200: ms per iteration; A100-PCIe: the real TFLOP/s per GPU read off
  SimuMax's chart, turned into ms with SimuMax's own FLOP count, `simumax_flops_per_token`).
- memory: our `MemoryBreakdown.allocated` of the worst rank (tensors only, what torch.cuda.max_memory_allocated
  counts) vs the real max allocated GiB (B200 only: the A100 table gives SimuMax's error alone).
Errors are ours / real - 1. The summary gives the median and worst absolute errors, ours and SimuMax's.

    .venv/bin/python bench/plan_vs_published.py            # the table, ~1 s
    .venv/bin/python bench/plan_vs_published.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config  # noqa: E402
from moe.trainer.plan.devices import SPECS  # noqa: E402
from moe.trainer.plan.framework import MEGATRON_ALLTOALL  # noqa: E402
from moe.trainer.plan.layout import check_layout, parse_layout  # noqa: E402
from moe.trainer.plan.memory_estimate import GIB, memory_by_stage  # noqa: E402
from moe.trainer.plan.model_shape import ModelShape  # noqa: E402
from moe.trainer.plan.report import table  # noqa: E402
from moe.trainer.plan.search import estimate  # noqa: E402
from moe.trainer.plan.space import Workload  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data" / "simumax_published.toml"
TABLES = {"b200": "b200", "a100_pcie": "a100-pcie"}  # data table -> device spec
TARGET_TIME, TARGET_MEMORY, TARGET_MEDIAN = 0.15, 0.10, 0.07

# What our model does not capture, per kind of case (printed under the table with the split of each group's step
# into a per-step and a per-micro-batch part, real vs ours: `decompose`).
LACKS = {
    "time": "Megatron's non-GEMM kernels (router, permute / unpermute, capacity padding, SwiGLU, RoPE, norms) are "
    "priced as generic element-wise passes over the kept tensors at the measured memory efficiency, not as measured "
    "kernels; kernel-launch gaps and the alltoall dispatcher's host synchronisations are not modelled",
    "pp": "1F1B: the bubble is (pp - 1) x the other stage's F + B; Megatron's blocking p2p hand-offs between "
    "unequal stages (embedding + dense layer vs head) are not modelled",
    "memory": "activations are this trainer's tensors minus the fused cross entropy / norms "
    "(moe/trainer/plan/framework.py); "
    "Transformer Engine keeps fewer (e.g. no FP32 router copies, no padded value heads)",
    "a100": "the real time is read off SimuMax's chart (+-0.4%) and converted with SimuMax's FLOP count",
}


@dataclass(frozen=True)
class Row:
    """One published case with its real value, SimuMax's prediction and ours (ms, GiB; None: not published)."""

    system: str
    case: str
    layout: str
    micro_batches: int
    real_ms: float
    simumax_ms: float
    ours_ms: float
    real_gib: float | None
    simumax_gib: float | None
    ours_gib: float
    stage_gib: tuple[float, ...]
    lacks: str

    @property
    def time_err(self) -> float:
        return self.ours_ms / self.real_ms - 1

    @property
    def simumax_time_err(self) -> float:
        return self.simumax_ms / self.real_ms - 1

    @property
    def memory_err(self) -> float | None:
        return None if self.real_gib is None else self.ours_gib / self.real_gib - 1

    @property
    def simumax_memory_err(self) -> float | None:
        return None if self.real_gib is None else self.simumax_gib / self.real_gib - 1


def load_published(path: Path = DATA) -> dict:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    missing = [k for k in ("source", "models", *TABLES) if k not in data]
    if missing:
        raise ValueError(f"{path}: missing tables {missing}")
    return data


def case_config(data: dict, model: str, layers: int) -> DeepseekV3Config:
    """The `DeepseekV3Config` of a published model (its config file, `[models.NAME] config`) cut to `layers` decoder
    layers, the first `dense_layers` dense, without MTP: what plan.py prices with --num-layers, --first-k-dense and
    --mtp-depths 0."""
    m = data["models"][model]
    config = DeepseekV3Config.from_toml(REPO / m["config"])
    return dataclasses.replace(
        config, num_hidden_layers=layers, first_k_dense_replace=m["dense_layers"], num_nextn_predict_layers=0
    )


def simumax_flops_per_token(c: DeepseekV3Config, seq_len: int) -> float:
    """Training FLOPs per token as SimuMax counts them for its TFLOP/s figures (its ModelConfig.flops_per_token:
    3 x 2 x (every layer's MLA projections + o_proj, every layer's MLP as K + shared/Fm experts, the router), the
    attention core S x (Dq + Dv) x N x 6 per layer without the causal half, and the output head)."""
    H, N, L = c.hidden_size, c.num_attention_heads, c.num_hidden_layers
    dq = c.qk_nope_head_dim + c.qk_rope_head_dim
    qkv = H * c.q_lora_rank + c.q_lora_rank * N * dq + H * (c.kv_lora_rank + c.qk_rope_head_dim)
    qkv += c.kv_lora_rank * N * (c.qk_nope_head_dim + c.v_head_dim)
    attn = 6 * L * (qkv + c.v_head_dim * N * H)
    factor = c.num_experts_per_tok + c.n_shared_experts  # 1 + (K - 1) + shared / Fm (the shared FFN is n_shared x Fm)
    mlp = 6 * L * 3 * H * c.moe_intermediate_size * factor
    router = 6 * L * H * c.n_routed_experts
    sdp = 6 * L * (seq_len * dq * N + seq_len * c.v_head_dim * N)
    return attn + mlp + router + sdp + 6 * H * c.vocab_size


def _lacks(system: str, layout: str) -> str:
    notes = ["time"] + (["pp"] if "pp2" in layout else []) + (["memory"] if system == "b200" else [])
    return ", ".join(notes + (["a100"] if system == "a100-pcie" else []))


def decompose(rows: list[Row]) -> list[tuple[str, float, float, float, float]]:
    """Per group of cases that differ only in the micro-batch count: `(group, real per-step ms, ours, real
    per-micro-batch ms, ours)`, the least-squares line step = fixed + per_mb x mbc through its rows."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(f"{r.system} {r.case.split('_mbc')[0].split('_l4')[0]} {r.layout}", []).append(r)
    out = []
    for name, rs in groups.items():
        if len(rs) < 2:
            continue
        xs = [r.micro_batches for r in rs]
        lines = [statistics.linear_regression(xs, [getattr(r, k) for r in rs]) for k in ("real_ms", "ours_ms")]
        out.append((name, lines[0].intercept, lines[1].intercept, lines[0].slope, lines[1].slope))
    return out


def price(data: dict, system: str, entry: dict):
    """`(config, candidate, workload, estimate, per-stage memory)` of one published case."""
    config = case_config(data, entry["model"], entry["layers"])
    cand = parse_layout(entry["layout"])
    rows = data["source"]["micro_batch_size"]
    work = Workload(cand.dp * entry["micro_batches"] * rows, entry["micro_batches"], data["source"]["seq_len"])
    spec = SPECS[system]
    check_layout(cand, config, work, spec)
    est = estimate(cand, config, work, spec, MEGATRON_ALLTOALL)
    stages = memory_by_stage(cand, ModelShape.from_config(config), work, spec, MEGATRON_ALLTOALL)
    return config, cand, work, est, stages


def build_rows(data: dict) -> list[Row]:
    rows = []
    for key, system in TABLES.items():
        for entry in data[key]:
            config, cand, work, est, stages = price(data, system, entry)
            if "real_ms" in entry:
                real_ms, simumax_ms = entry["real_ms"], entry["simumax_ms"]
                real_gib, simumax_gib = entry["real_alloc_gib"], entry["simumax_alloc_gib"]
            else:  # TFLOP/s per GPU with SimuMax's count -> ms per step
                flops = simumax_flops_per_token(config, work.seq_len) * work.global_batch * work.seq_len / cand.world
                real_ms = flops / (entry["real_tflops"] * 1e12) * 1e3
                simumax_ms = real_ms / (1 + entry["simumax_time_err_pct"] / 100)
                real_gib = simumax_gib = None
            rows.append(Row(
                system, entry["case"], cand.name(), work.micro_batches, real_ms, simumax_ms, est.time.step * 1e3,
                real_gib, simumax_gib, est.memory.allocated / GIB, tuple(s.allocated / GIB for s in stages),
                _lacks(system, entry["layout"]),
            ))  # fmt: skip
    return rows


def summary(rows: list[Row]) -> dict[str, float]:
    """Median and worst absolute errors (fractions), ours and SimuMax's, for time and memory."""
    out = {}
    for name, get in (("time", "time_err"), ("simumax_time", "simumax_time_err"), ("memory", "memory_err"),
                      ("simumax_memory", "simumax_memory_err")):  # fmt: skip
        errs = [abs(getattr(r, get)) for r in rows if getattr(r, get) is not None]
        out[f"{name}_median"] = statistics.median(errs)
        out[f"{name}_worst"] = max(errs)
    return out


def target_met(s: dict[str, float]) -> bool:
    """Issue 41's target on a `summary`: every case within 15% on time and 10% on memory, both medians within 7%."""
    return (s["time_worst"] <= TARGET_TIME and s["memory_worst"] <= TARGET_MEMORY and s["time_median"] <= TARGET_MEDIAN
            and s["memory_median"] <= TARGET_MEDIAN)  # fmt: skip


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def render(rows: list[Row]) -> str:
    headers = ["system", "case", "mbc", "real ms", "SimuMax", "ours", "err", "SimuMax err", "real GiB", "SimuMax",
               "ours", "err", "SimuMax err", "ours per stage", "lacks"]  # fmt: skip
    body = [[r.system, r.case, str(r.micro_batches), _num(r.real_ms), _num(r.simumax_ms), _num(r.ours_ms),
             _pct(r.time_err), _pct(r.simumax_time_err), _num(r.real_gib), _num(r.simumax_gib), _num(r.ours_gib),
             _pct(r.memory_err), _pct(r.simumax_memory_err), " / ".join(f"{g:.1f}" for g in r.stage_gib), r.lacks]
            for r in rows]  # fmt: skip
    s = summary(rows)
    lines = [table(headers, body, "ll" + "r" * (len(headers) - 4) + "ll"), ""]
    lines.append(
        f"time   |err|: ours median {100 * s['time_median']:.1f}%, worst {100 * s['time_worst']:.1f}%; "
        f"SimuMax median {100 * s['simumax_time_median']:.1f}%, worst {100 * s['simumax_time_worst']:.1f}%"
    )
    lines.append(f"memory |err|: ours median {100 * s['memory_median']:.1f}%, worst {100 * s['memory_worst']:.1f}%; "
                 f"SimuMax median {100 * s['simumax_memory_median']:.1f}%, "
                 f"worst {100 * s['simumax_memory_worst']:.1f}% (B200 rows)")  # fmt: skip
    met = target_met(s)
    lines.append(f"target (every case within {TARGET_TIME:.0%} time / {TARGET_MEMORY:.0%} memory, medians within "
                 f"{TARGET_MEDIAN:.0%}): {'met' if met else 'NOT met'}")  # fmt: skip
    lines.append("\nwhere the time goes wrong: step = per-step part + per-micro-batch part x mbc (least squares, ms)")
    split = [[g, f"{a:.1f}", f"{b:.1f}", f"{c:.2f}", f"{d:.2f}"] for g, a, b, c, d in decompose(rows)]
    lines.append(table(["group", "real per-step", "ours", "real per-mb", "ours"], split))
    lines.append("\nwhat the model lacks (the 'lacks' column):")
    lines += [f"  {key}: {text}" for key, text in LACKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DATA, help="the published cases (TOML)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows and the summary here")
    args = p.parse_args(argv)
    rows = build_rows(load_published(args.data))
    print(render(rows))
    if args.json is not None:
        payload = {"rows": [dict(vars(r), time_err=r.time_err, memory_err=r.memory_err) for r in rows],
                   "summary": summary(rows)}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
