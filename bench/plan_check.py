"""The planner against reality: its memory and step-time estimates for several layouts of a small config, next to
the peak memory and step time that examples/deepseek_v3/train.py measures for the same layouts on this CPU.

For every row, short runs of train.py (the one launcher, `mtdeepep.utils.testing.run_processes`, as
bench/train_layouts.py does; gloo) give, from their metrics.jsonl:
- measured peak MiB: `max_peak_memory_mib` of the last step (the largest rank's resident-set high-water mark, the
  whole process, after the optimizer states exist);
- measured step s: the fastest and the median `step_s` of the steps after the first, over `--rounds` runs of
  every row taken in turn (the machine is shared: the fastest step is the least disturbed one, and interleaving the
  rows spreads a busy spell over all of them).
Every rank runs ONE intra-op thread, as the 'cpu' device spec assumes (moe/trainer/plan/devices.py): on this machine,
shared with other work, one process with two threads was measured 7x slower per step than two single-threaded
ranks doing the same work (32.9 vs 4.5 s), an effect of the other work, not of the layout.

The estimates are `moe.trainer.plan.search.estimate` of the same layout on the 'cpu' device spec, calibrated first
(`moe.trainer.plan.calibrate`; and the process baseline `runtime_gib` from a 2-rank run of a ~0.6M-parameter model,
whose state and activations are negligible) unless --no-calibrate. Printed: the error of the memory estimate per layout,
and the step-time order (measured vs estimated, with Spearman's rank correlation). `--measured OLD.json` estimates
again for the runs of an earlier check (with the spec calibrated then), without running anything.

    .venv/bin/python bench/plan_check.py                      # ~8 minutes on 2 idle cores
    .venv/bin/python bench/plan_check.py --rows 1,dp2,tp2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import tomli_w
import tomllib
from _common import RESULTS_DIR, num_cores, print_table, save_run, short_run
from train_layouts import bench_config, train_rank

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.plan.devices import CPU, DeviceSpec
from moe.trainer.plan.search import estimate
from moe.trainer.plan.space import Candidate, Workload
from moe.trainer.train.metrics import read_metrics
from mtdeepep.utils.testing import run_processes

REPO = Path(__file__).resolve().parents[1]

# name -> (processes, train.py flags, the planner's candidate fields besides world)
ROWS: dict[str, tuple[int, list[str], dict]] = {
    "1": (1, [], {}),
    "1-sel+": (
        1,
        [
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "core_attn",
            "mla_up_proj",
            "layernorm",
            "moe_act",
        ],
        {"recompute": "selective+"},
    ),  # fmt: skip
    "1-full": (
        1,
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
        {"recompute": "full"},
    ),  # fmt: skip
    "dp2": (2, [], {}),
    "dp2-zero1": (2, ["--use-distributed-optimizer"], {"zero1": True}),
    "ep2": (2, ["--ep", "2"], {"ep": 2}),
    "tp2": (2, ["--tp", "2"], {"tp": 2}),
    "pp2-1f1b": (2, ["--pp", "2", "--pp-schedule", "1f1b"], {"pp": 2, "schedule": "1f1b"}),
    "pp2-dualpipev": (2, ["--pp", "2", "--pp-schedule", "dualpipev"], {"pp": 2, "schedule": "dualpipev", "vpp": 2}),
    "ep2-dp4-zero1": (4, ["--ep", "2", "--use-distributed-optimizer"], {"ep": 2, "zero1": True}),
    # Expert tensor parallelism (issue 25): each expert's FFN over 2 ranks, the dispatch over the ep x etp ranks.
    "etp2": (2, ["--etp", "2"], {"etp": 2}),
    "ep2-etp2": (4, ["--ep", "2", "--etp", "2"], {"ep": 2, "etp": 2}),
}
DEFAULT_ROWS = "1,1-full,dp2,dp2-zero1,ep2,etp2,tp2,pp2-1f1b,pp2-dualpipev"


def candidate(name: str) -> Candidate:
    processes, _, fields = ROWS[name]
    base = {"tp": 1, "pp": 1, "ep": 1}
    return Candidate(world=processes, **{**base, **fields})


def run_train(processes: int, flags: list[str], config: Path, run_dir: Path, timeout: float) -> list[dict]:
    """One train.py job; its metrics records."""
    argv = ["--config", str(config), "--out", str(run_dir), "--seed", "0", *flags]
    run_processes(train_rank, processes, (argv, 1), timeout_s=timeout)  # ONE intra-op thread: see the docstring
    return read_metrics(run_dir / "metrics.jsonl")


def measure_row(name: str, config: Path, run_dir: Path, timeout: float) -> dict:
    processes, flags, _ = ROWS[name]
    start = time.perf_counter()
    records = run_train(processes, flags, config, run_dir, timeout)
    return {
        "peak_mib": records[-1]["max_peak_memory_mib"],
        "optimizer_mib": records[-1]["max_optimizer_state_mib"],
        "steps_s": [r["step_s"] for r in records[1:]],  # the first step builds kernels and caches: left out
        "wall_s": time.perf_counter() - start,
    }


# A model whose state and activations are negligible (~0.6M parameters; the small config's vocabulary, so the same
# token cache serves): what its train.py ranks hold is the process baseline (Python, torch, gloo, the data, ...).
BASELINE_MODEL = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, kv_lora_rank=32,
    q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
)  # fmt: skip


def measure_runtime_baseline(args, work: Path, spec) -> tuple[float, dict]:
    """The 'runtime_gib' of the cpu spec from a 2-rank train.py run of `BASELINE_MODEL`: its measured peak minus the
    planner's estimate of everything else (state, activations, allocator share: a few MiB)."""
    doc = short_run(tomllib.loads((REPO / args.config).read_text()), global_batch=2, seq_len=args.seq_len,
                    micro_batches=1, steps=2, dtype=args.dtype, log_every=2)  # fmt: skip
    doc["model"].update(BASELINE_MODEL)
    path = work / "baseline.toml"
    path.write_text(tomli_w.dumps(doc))
    records = run_train(2, [], path, work / "baseline", args.timeout)
    model = DeepseekV3Config.from_dict(doc["model"], strict=True)
    est = estimate(Candidate(world=2, tp=1, pp=1, ep=1), model, Workload(2, 1, args.seq_len, args.dtype),
                   spec.replace(runtime_gib=0.0))  # fmt: skip
    peak = records[-1]["max_peak_memory_mib"]
    return (peak - est.memory.total / 2**20) / 1024, {
        "peak_mib": peak,
        "est_without_runtime_mib": est.memory.total / 2**20,
    }


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/deepseek_v3/configs/small.toml")
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated subset of {list(ROWS)}")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=4, help="per data-parallel rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="runs of every row, interleaved")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-calibrate", action="store_true", help="use the built-in 'cpu' spec")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per row")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "plan_check.json")
    p.add_argument("--measured", type=Path, default=None,
                   help="estimate again for the measurements of an earlier --json (no runs)")  # fmt: skip
    args = p.parse_args()
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or not args.rows:
        p.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is left out of the timings)")
    return args


def estimate_rows(measured: list[dict], model, workload: Workload, spec) -> list[dict]:
    rows = []
    for got in measured:
        name = got["row"]
        est = estimate(candidate(name), model, workload, spec)
        rows.append(
            {**got, "layout": candidate(name).name(), "est_mib": est.memory.total / 2**20, "est_step_s": est.time.step,
             "est_memory_mib": {k: v * 1024 for k, v in est.memory.gib().items()}, "est_time_s": est.time.as_dict()}
        )  # fmt: skip
    return rows


def print_report(args, rows: list[dict]) -> tuple[float, float]:
    measured = [r["step_min_s"] for r in rows]
    estimated = [r["est_step_s"] for r in rows]
    order_m = sorted(range(len(rows)), key=lambda i: measured[i])
    order_e = sorted(range(len(rows)), key=lambda i: estimated[i])
    table = []
    for i, r in enumerate(rows):
        m = r["est_memory_mib"]
        table.append([
            r["row"], f"{r['peak_mib']:.0f}", f"{r['est_mib']:.0f}",
            f"{100 * (r['est_mib'] / r['peak_mib'] - 1):+.1f}%",
            f"{m['weights'] + m['grads'] + m['optimizer']:.0f}", f"{m['activations'] + m['transient']:.0f}",
            f"{m['runtime'] + m['allocator'] + m['comm_buffers']:.0f}",
            f"{r['step_min_s']:.2f}", f"{r['step_median_s']:.2f}", f"{r['est_step_s']:.2f}",
            str(order_m.index(i) + 1), str(order_e.index(i) + 1),
        ])  # fmt: skip
    rho_min = spearman(measured, estimated)
    rho_med = spearman([r["step_median_s"] for r in rows], estimated)
    mem_err = [abs(r["est_mib"] / r["peak_mib"] - 1) for r in rows]
    # The noise floor: how well the measured rounds agree with each other on the order.
    per_round = [[min(r["rounds"][k]["steps_s"]) for r in rows] for k in range(min(len(r["rounds"]) for r in rows))]
    agreement = spearman(per_round[0], per_round[1]) if len(per_round) > 1 else float("nan")
    print(
        f"\n{args.config}, global batch {args.global_batch} x {args.seq_len}, {args.micro_batches} micro-batches "
        f"per dp rank, {args.dtype}, {args.steps} steps per row; {num_cores()} cores (shared with other work)"
    )
    print_table(
        ("row", "peak MiB", "est MiB", "mem err", "est state", "est act+trans", "est other", "step min s",
         "step med s", "est step s", "rank meas", "rank est"),
        table,
        f"memory: mean |error| {100 * statistics.mean(mem_err):.1f}%, max {100 * max(mem_err):.1f}%; est state = "
        "weights + grads + optimizer, est other = process runtime + allocator share + mtdeepep buffer.",
        f"step-time order: Spearman rho {rho_min:.2f} against the fastest measured step, {rho_med:.2f} against the "
        f"median; the measured rounds agree with each other at rho {agreement:.2f} (round 1 vs 2, fastest steps).",
    )  # fmt: skip
    return rho_min, rho_med


def merge_rounds(name: str, rounds: list[dict]) -> dict:
    """One row from its runs: the largest peak, the fastest and the median step over every round's timed steps."""
    steps = [t for r in rounds for t in r["steps_s"]]
    return {
        "row": name,
        "peak_mib": max(r["peak_mib"] for r in rounds),
        "optimizer_mib": rounds[0]["optimizer_mib"],
        "step_min_s": min(steps),
        "step_median_s": statistics.median(steps),
        "rounds": rounds,
    }


def main() -> None:
    args = parse_args()
    model = DeepseekV3Config.from_toml(REPO / args.config)
    workload = Workload(args.global_batch, args.micro_batches, args.seq_len, args.dtype)
    if args.measured is not None:  # estimate again for measurements taken before (and the spec they were taken with)
        saved = json.loads(args.measured.read_text())
        # Fields an older calibration did not measure keep the built-in 'cpu' spec's values.
        fields = {**CPU.to_dict(), **saved["spec"]}
        spec = DeviceSpec(**{**fields, "estimated": frozenset(fields["estimated"])})
        measured = [{k: v for k, v in r.items() if not k.startswith("est") and k != "layout"} for r in saved["rows"]]
        for r in measured:  # files of the first version: one run per row, its steps under "steps_s"
            r.setdefault("rounds", [{"steps_s": r.get("steps_s", [])[1:], "peak_mib": r["peak_mib"]}])
        for key in ("global_batch", "seq_len", "micro_batches", "steps", "rounds", "dtype", "config"):
            if key in saved["args"]:
                setattr(args, key, type(getattr(args, key))(saved["args"][key]))
        workload = Workload(args.global_batch, args.micro_batches, args.seq_len, args.dtype)
        model = DeepseekV3Config.from_toml(REPO / args.config)
        baseline = saved.get("runtime_baseline")
    else:
        spec = CPU
        if not args.no_calibrate:
            from moe.trainer.plan.calibrate import calibrated_cpu_spec

            spec = calibrated_cpu_spec()
        with tempfile.TemporaryDirectory(prefix="plan_check-") as tmp:
            work = Path(tmp)
            config = bench_config(args, args.dtype, work)
            baseline = None
            if not args.no_calibrate:
                runtime, baseline = measure_runtime_baseline(args, work, spec)
                sources = {
                    **spec.sources,
                    "runtime_gib": "calibrated by bench/plan_check.py: peak of a 2-rank train.py "
                    "run of a ~0.6M-parameter model minus the planner's estimate of its state and activations",
                }
                spec = spec.replace(runtime_gib=runtime, sources=sources)  # fmt: skip
            shown = ("tflops", "memory_gbps", "fresh_memory_gbps", "intra_node_gbps", "ep_intra_node_gbps",
                     "comm_latency_us", "runtime_gib")  # fmt: skip
            print("cpu spec:", json.dumps({k: spec.to_dict()[k] for k in shown}), flush=True)
            runs: dict[str, list[dict]] = {name: [] for name in args.rows}
            for round_index in range(args.rounds):  # rounds interleave the rows: a slow spell of the machine hits all
                for name in args.rows:
                    got = measure_row(name, config, work / f"{name}-{round_index}", args.timeout)
                    runs[name].append(got)
                    r = estimate_rows([merge_rounds(name, [got])], model, workload, spec)[0]
                    print(
                        f"round {round_index + 1} {name:>14}: peak {r['peak_mib']:.0f} MiB (est {r['est_mib']:.0f}), "
                        f"steps {', '.join(f'{t:.2f}' for t in got['steps_s'])} s (est {r['est_step_s']:.2f}); "
                        f"{got['wall_s']:.0f} s",
                        flush=True,
                    )
        measured = [merge_rounds(name, runs[name]) for name in args.rows]
    rows = estimate_rows(measured, model, workload, spec)
    rho_min, rho_med = print_report(args, rows)
    save_run(args.json, args, spec=spec.to_dict(), rows=rows, spearman_min=rho_min, spearman_median=rho_med,
             runtime_baseline=baseline)  # fmt: skip


if __name__ == "__main__":
    main()
