"""The planner against reality: its memory and step-time estimates for several layouts of a small config, next to
the peak memory and step time that examples/deepseek_v3/train.py measures for the same layouts on this CPU.

For every row, one short run of train.py (the one launcher, `mtdeepep.utils.testing.run_processes`, as
bench/train_layouts.py does; gloo, `max(1, cores // ranks)` threads per rank) gives, from its metrics.jsonl:
- measured peak MiB: `max_peak_memory_mib` of the last step (the largest rank's resident-set high-water mark, the
  whole process, after the optimizer states exist);
- measured step s: the fastest and the median `step_s` of the steps after the first (the machine is shared: the
  fastest step is the least disturbed one).
The estimates are `moe.plan.search.estimate` of the same layout on the 'cpu' device spec, calibrated first
(`moe.plan.calibrate`) unless --no-calibrate. Printed: the error of the memory estimate per layout, and the
step-time order (measured vs estimated, with Spearman's rank correlation). `--measured OLD.json` estimates again
for the runs of an earlier check (with the spec calibrated then), without running anything.

    .venv/bin/python bench/plan_check.py                      # ~5 minutes on 2 cores
    .venv/bin/python bench/plan_check.py --rows 1,dp2,tp2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import tomllib
from _common import RESULTS_DIR, environment, num_cores, print_table, save_results
from train_layouts import _dump_toml, train_rank

from moe.models.deepseek_v3.config import DeepseekV3Config
from moe.plan.devices import CPU, DeviceSpec
from moe.plan.search import estimate
from moe.plan.space import Candidate, Workload
from moe.train.metrics import read_metrics
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
}
DEFAULT_ROWS = "1,1-full,dp2,dp2-zero1,ep2,tp2,pp2-1f1b,pp2-dualpipev"


def candidate(name: str) -> Candidate:
    processes, _, fields = ROWS[name]
    base = {"tp": 1, "pp": 1, "ep": 1}
    return Candidate(world=processes, **{**base, **fields})


def check_config(args, out: Path) -> Path:
    """The config with this check's batch, steps and dtype (no checkpoint but the last, after the last record)."""
    doc = tomllib.loads((REPO / args.config).read_text())
    doc["training"].update(
        global_batch=args.global_batch, seq_len=args.seq_len, micro_batches=args.micro_batches, steps=args.steps,
        warmup_steps=1, dtype=args.dtype, checkpoint_every=0, log_every=args.steps,
    )  # fmt: skip
    path = out / "config.toml"
    path.write_text(_dump_toml(doc))
    return path


def measure_row(name: str, config: Path, work: Path, timeout: float) -> dict:
    processes, flags, _ = ROWS[name]
    run_dir = work / name
    start = time.perf_counter()
    run_processes(train_rank, processes, (["--config", str(config), "--out", str(run_dir), "--seed", "0", *flags],),
                  timeout_s=timeout)  # fmt: skip
    records = read_metrics(run_dir / "metrics.jsonl")
    timed = [r["step_s"] for r in records[1:]]
    return {
        "peak_mib": records[-1]["max_peak_memory_mib"],
        "optimizer_mib": records[-1]["max_optimizer_state_mib"],
        "step_min_s": min(timed),
        "step_median_s": statistics.median(timed),
        "steps_s": [r["step_s"] for r in records],
        "wall_s": time.perf_counter() - start,
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
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=4, help="per data-parallel rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-calibrate", action="store_true", help="use the built-in 'cpu' spec")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per row")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "plan_check.json")
    p.add_argument("--measured", type=Path, default=None,
                   help="estimate again for the measurements of an earlier --json (no runs)")  # fmt: skip
    args = p.parse_args()
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown or not args.rows:
        p.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
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
        "median.",
    )  # fmt: skip
    return rho_min, rho_med


def main() -> None:
    args = parse_args()
    model = DeepseekV3Config.from_toml(REPO / args.config)
    workload = Workload(args.global_batch, args.micro_batches, args.seq_len, args.dtype)
    if args.measured is not None:  # estimate again for measurements taken before (and the spec they were taken with)
        saved = json.loads(args.measured.read_text())
        spec = DeviceSpec(**{**saved["spec"], "estimated": frozenset(saved["spec"]["estimated"])})
        measured = [{k: v for k, v in r.items() if not k.startswith("est") and k != "layout"} for r in saved["rows"]]
        for key in ("global_batch", "seq_len", "micro_batches", "steps", "dtype", "config"):
            setattr(args, key, type(getattr(args, key))(saved["args"][key]))
        workload = Workload(args.global_batch, args.micro_batches, args.seq_len, args.dtype)
        model = DeepseekV3Config.from_toml(REPO / args.config)
    else:
        spec = CPU
        if not args.no_calibrate:
            from moe.plan.calibrate import calibrated_cpu_spec

            spec = calibrated_cpu_spec()
        shown = ("tflops", "memory_gbps", "intra_node_gbps", "comm_latency_us", "runtime_gib")
        print("cpu spec:", json.dumps({k: spec.to_dict()[k] for k in shown}), flush=True)
        measured = []
        with tempfile.TemporaryDirectory(prefix="plan_check-") as tmp:
            work = Path(tmp)
            config = check_config(args, work)
            for name in args.rows:
                got = {"row": name, **measure_row(name, config, work, args.timeout)}
                measured.append(got)
                r = estimate_rows([got], model, workload, spec)[0]
                print(
                    f"{name:>14}: peak {r['peak_mib']:.0f} MiB (est {r['est_mib']:.0f}), step {r['step_min_s']:.2f} s "
                    f"min / {r['step_median_s']:.2f} median (est {r['est_step_s']:.2f}); {r['wall_s']:.0f} s",
                    flush=True,
                )
    rows = estimate_rows(measured, model, workload, spec)
    rho_min, rho_med = print_report(args, rows)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "spec": spec.to_dict(), "rows": rows}
    payload.update(spearman_min=rho_min, spearman_median=rho_med, environment=environment())
    save_results(args.json, payload)


if __name__ == "__main__":
    main()
