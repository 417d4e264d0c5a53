"""DeepSeek-V3 training steps in every parallel layout and precision of the trainer: step time, tokens/s, peak
memory per rank and optimizer-state bytes per rank, from one run of `examples/deepseek_v3/train.py` per row.

Setting: `examples/deepseek_v3/configs/small.toml`'s model and [training] table, with the batch made small enough
for a 2-core CPU (`--global-batch` sequences of `--seq-len` tokens per step, `--micro-batches` per data-parallel
rank) and `--steps` steps on the python-stdlib corpus (the data cache is built once, before the rows). Each row is a
fresh torchrun-like job (the one launcher, `mtdeepep.utils.testing.run_processes`: spawned processes, gloo on
127.0.0.1, `max(1, cores // ranks)` threads each) writing its own run directory; the figures are the trainer's own
per-step records (`metrics.jsonl`):
- step ms: the median of `step_s` over the steps after `--warmup` (the first steps build kernels and caches);
- tokens/s: global batch tokens / that median (all ranks together);
- peak MiB per rank: the largest rank's resident-set high-water mark at the last step (`max_peak_memory_mib`: the
  whole process: weights, gradients, optimizer, activations, the libraries);
- optimizer MiB per rank: the largest rank's AdamW moments + FP32 masters (`max_optimizer_state_mib`); the ZeRO-1
  rows also give it relative to the same layout without ZeRO-1 (expected about 1 / dp).

Rows (`--layouts`, `--precisions` select): layouts 1 process, DP2, DP2 ZeRO-1, EP2 x DP2, DP4 ZeRO-1 + EP2, TP2, TP2
x EP2 (4 ranks: EP spans the TP pairs), PP2 (1F1B), PP2 DualPipeV; precisions fp32, bf16 (BF16 weights/activations,
FP32 masters), fp8-delayed and fp8-blockwise (BF16 plus FP8 GEMMs; on CPU the GEMMs are an exact emulation, slower
than BF16: the FP8 rows measure the recipe's overheads, not the GEMM speed of an FP8 unit).

Run (about 10 minutes on a 2-core machine with the defaults):

    .venv/bin/python bench/train_layouts.py
    .venv/bin/python bench/train_layouts.py --layouts 1,dp2,dp2-zero1 --precisions bf16 --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tomli_w
import tomllib
import torch
from _common import RESULTS_DIR, make_parser, num_cores, print_table, save_run, short_run, threads_per_rank

from moe.trainer import run
from moe.trainer.train.metrics import read_metrics
from mtdeepep.utils.testing import run_processes

REPO = Path(__file__).resolve().parents[1]

# name -> (processes, train.py flags, the row without ZeRO-1 it is compared with)
LAYOUTS: dict[str, tuple[int, list[str], str | None]] = {
    "1": (1, [], None),
    "dp2": (2, [], None),
    "dp2-zero1": (2, ["--use-distributed-optimizer"], "dp2"),
    "ep2-dp2": (4, ["--ep", "2"], None),
    "ep2-dp4-zero1": (4, ["--ep", "2", "--use-distributed-optimizer"], "ep2-dp2"),
    "tp2": (2, ["--tp", "2"], None),
    "tp2-ep2": (4, ["--tp", "2", "--ep", "2"], None),
    # Pipeline (moe/trainer/pipeline): small's 4 layers as 2 stages of 2 (1F1B), or 4 stages of 1 in a V (DualPipeV, 4
    # micro-batches: 2P); the last stage also runs the head and the MTP module.
    "pp2": (2, ["--pp", "2"], None),
    "pp2-dualpipev": (2, ["--pp", "2", "--pp-schedule", "dualpipev", "--micro-batches", "4"], None),
}
# name -> ([training] dtype, train.py flags)
PRECISIONS: dict[str, tuple[str, list[str]]] = {
    "fp32": ("float32", []),
    "bf16": ("bfloat16", []),
    "fp8-delayed": ("bfloat16", ["--fp8", "delayed"]),
    "fp8-blockwise": ("bfloat16", ["--fp8", "blockwise"]),
}


def bench_config(args: argparse.Namespace, dtype: str, out: Path) -> Path:
    """`args.config` with the batch, steps and dtype of a benchmark's args (`global_batch`, `seq_len`,
    `micro_batches`, `steps`, optional `data_cache`): no checkpoints but the last, one line of log at the end.
    Also bench/plan_check.py's."""
    doc = short_run(
        tomllib.loads((REPO / args.config).read_text()), global_batch=args.global_batch, seq_len=args.seq_len,
        micro_batches=args.micro_batches, steps=args.steps, dtype=dtype, log_every=args.steps,
    )  # fmt: skip
    if getattr(args, "data_cache", None):
        doc.setdefault("data", {})["cache_dir"] = args.data_cache
    path = out / f"config-{dtype}.toml"
    path.write_text(tomli_w.dumps(doc))
    return path


def train_rank(proc, argv: list[str], threads: int | None = None) -> None:
    """One rank of `train.py argv` with torchrun's environment (the launcher's port for the rendezvous), on
    `threads` intra-op threads (default: the cores shared out over the ranks)."""
    os.environ.update(
        RANK=str(proc.rank), LOCAL_RANK=str(proc.rank), WORLD_SIZE=str(proc.num_processes),
        LOCAL_WORLD_SIZE=str(proc.num_processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(proc.port),
        GLOO_SOCKET_IFNAME="lo",
    )  # fmt: skip
    torch.set_num_threads(threads or threads_per_rank(proc.num_processes))
    sys.argv = ["train.py", *argv]
    code = run.main(argv)
    if code != 0:
        raise RuntimeError(f"train.py exited with {code}")


def run_row(args, layout: str, precision: str, work: Path) -> dict[str, Any]:
    processes, layout_flags, _ = LAYOUTS[layout]
    dtype, precision_flags = PRECISIONS[precision]
    config = bench_config(args, dtype, work)
    run_dir = work / f"{layout}-{precision}"
    argv = ["--config", str(config), "--out", str(run_dir), "--seed", "0", *layout_flags, *precision_flags]
    start = time.perf_counter()
    run_processes(train_rank, processes, (argv,), timeout_s=args.timeout)
    wall = time.perf_counter() - start
    records = read_metrics(run_dir / "metrics.jsonl")
    timed = [r["step_s"] for r in records[args.warmup :]]
    step_s = statistics.median(timed)
    return {
        "layout": layout,
        "precision": precision,
        "processes": processes,
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.global_batch * args.seq_len / step_s,
        "peak_mib_per_rank": records[-1]["max_peak_memory_mib"],
        "optimizer_mib_per_rank": records[-1]["max_optimizer_state_mib"],
        "losses": [r["loss"] for r in records],
        "step_ms_samples": [s * 1e3 for s in timed],
        "wall_s": wall,
    }


def parse_args() -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--config", default="examples/deepseek_v3/configs/small.toml")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {list(LAYOUTS)}")
    parser.add_argument("--precisions", default="bf16,fp8-blockwise", help=f"subset of {list(PRECISIONS)}")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=2, help="per data-parallel rank")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--data-cache", default=None, help="token cache directory (default: the config's)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per row")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "train_layouts.json")
    args = parser.parse_args()
    for name, allowed in (("layouts", LAYOUTS), ("precisions", PRECISIONS)):
        chosen = [part.strip() for part in getattr(args, name).split(",") if part.strip()]
        unknown = [c for c in chosen if c not in allowed]
        if not chosen or unknown:
            parser.error(f"--{name}: unknown {unknown}; choose from {list(allowed)}")
        setattr(args, name, chosen)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def main() -> None:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="train_layouts-") as tmp:
        work = Path(tmp)
        # The tokenizer and token cache once, in this process, before any row (every row then reuses them).
        prepare = ["--config", str(bench_config(args, "float32", work)), "--out", str(work / "prepare")]
        run_processes(train_rank, 1, (prepare + ["--prepare-data"],), timeout_s=args.timeout)
        for precision in args.precisions:
            for layout in args.layouts:
                row = run_row(args, layout, precision, work)
                rows.append(row)
                print(f"{layout:>14} {precision:>13}: {row['step_ms']:.0f} ms/step ({row['wall_s']:.0f} s)", flush=True)
    by_key = {(r["layout"], r["precision"]): r for r in rows}
    table = []
    for r in rows:
        baseline = LAYOUTS[r["layout"]][2]
        plain = by_key.get((baseline, r["precision"])) if baseline else None
        ratio = "-" if plain is None else f"{r['optimizer_mib_per_rank'] / plain['optimizer_mib_per_rank']:.2f}"
        table.append(
            [
                r["layout"], r["precision"], str(r["processes"]), f"{r['step_ms']:.0f}", f"{r['tokens_per_s']:.0f}",
                f"{r['peak_mib_per_rank']:.0f}", f"{r['optimizer_mib_per_rank']:.1f}", ratio,
            ]
        )  # fmt: skip
    print(
        f"\nDeepSeek-V3 {args.config}, global batch {args.global_batch} x {args.seq_len}, {args.micro_batches} "
        f"micro-batches per dp rank; {num_cores()} cores; median of steps {args.warmup + 1}..{args.steps}"
    )
    print_table(
        ("layout", "precision", "ranks", "step ms", "tokens/s", "peak MiB/rank", "optim MiB/rank", "vs no ZeRO"),
        table,
        "peak MiB/rank: the largest rank's resident-set high-water mark (the whole process).",
        "optim MiB/rank: AdamW moments + FP32 masters on the largest rank; 'vs no ZeRO': that over the same layout "
        "without the distributed optimizer (ZeRO-1 expects about 1/dp).",
        f"{num_cores()} cores: rows with more ranks than cores oversubscribe (ranks take turns).",
    )
    save_run(args.json, args, rows=rows)


if __name__ == "__main__":
    main()
