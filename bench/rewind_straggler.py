"""What rewind snapshots, anomaly checks and slow-rank detection cost a training step (moe/trainer/train/rewind.py,
moe/trainer/train/straggler.py).

Setting: `examples/deepseek_v3/train.py` on tiny's model (tests/train's synthetic corpus), `--ranks` processes with
`--flags` (default EP2 with ZeRO-1 over the two ranks), `--steps` steps of `--global-batch` x `--seq-len` tokens.
Figures, all from the trainer's own records (metrics.jsonl):

1. In one run with everything on (NaN/Inf and spike checks, a snapshot before every step, slow-rank detection
   every `--interval` steps):
   - snapshot: the median `snapshot_s` of the steps against their median `step_s` (the snapshot is taken before the
     step, outside `step_s`), and its size per rank;
   - phase timer: `timer_events_per_step` (push/pop calls of the largest rank) x the cost of one call, measured here
     with a microbenchmark, against the median step; and the autograd marks that time the combines' backward (two
     per MoE layer and micro-batch) x their measured cost;
   - gather: the median `gather_s` of the reports, divided by `--interval`, against the median step;
   - anomaly checks: the all-reduce of the three flags per step, timed by a microbenchmark over the same ranks.
2. A/B in the same run: the phase timer is attached on odd steps and detached on even ones (all ranks alike), so
   the median `step_s` of the timed steps against that of the untimed ones is the timer's cost with the load of the
   shared machine the same for both (separate runs on a shared 2-core machine differ by tens of percent). The
   report gathers run outside `step_s` and are in (1).

Run:

    .venv/bin/python bench/rewind_straggler.py                      # EP2 + ZeRO-1, 2 processes
    .venv/bin/python bench/rewind_straggler.py --ranks 1 --flags ""
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import RESULTS_DIR, make_parser, run_ranks

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe.layer.phase_timer import PhaseTimer, mark_backward  # noqa: E402
from moe.trainer.models.deepseek_v3 import DeepseekV3Config  # noqa: E402
from moe.trainer.train.metrics import read_events, read_metrics  # noqa: E402
from mtdeepep.utils.testing import run_processes  # noqa: E402
from tests.train import train_cases as tc  # noqa: E402


def timer_call_seconds(n: int = 200_000) -> float:
    """Seconds per push or pop of a `PhaseTimer` (the median of 5 rounds of `n` push/pop pairs)."""
    timer = PhaseTimer()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            timer.push("forward")
            timer.pop("forward")
        rounds.append((time.perf_counter() - start) / (2 * n))
    return statistics.median(rounds)


def mark_pair_seconds(n: int = 2000) -> float:
    """Seconds the two autograd marks around one combine add to a forward + backward (median of 5 rounds of `n`,
    against the same graph without marks)."""
    timer = PhaseTimer()
    x = torch.randn(64, 256, requires_grad=True)

    def rounds(marked: bool) -> float:
        out = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                y = mark_backward(x, timer, "combine", enter=False) if marked else x
                z = y * 2.0
                z = mark_backward(z, timer, "combine", enter=True) if marked else z
                z.sum().backward()
            out.append((time.perf_counter() - start) / n)
        return statistics.median(out)

    return max(0.0, rounds(True) - rounds(False))


def _flags_all_reduce(rank: int, world: int, group, iterations: int) -> float:
    flags = torch.zeros(3, dtype=torch.float64)
    times = []
    for _ in range(iterations):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def flags_all_reduce_seconds(ranks: int) -> float:
    """The median time of the anomaly checks' flag all-reduce (3 float64, MAX) over `ranks` gloo ranks."""
    if ranks == 1:
        return 0.0
    return max(run_ranks(_flags_all_reduce, ranks, (200,)))


TIMED = {"odd": lambda step: step % 2 == 1, "even": lambda step: step % 2 == 0, "none": lambda step: False,
         "all": lambda step: True}  # fmt: skip


def alternating_timer_rank(proc, argv: list[str], timed: str) -> int:
    """One rank of `train.py argv` whose phase timer is attached on the steps `TIMED[timed]` selects (the A/B of the
    module docstring; 'none' and 'all' are A/A controls): `Trainer.train_step` is wrapped in this process."""
    from moe.trainer.train import trainer as trainer_module

    original = trainer_module.Trainer.train_step
    select = TIMED[timed]

    def train_step(self, step: int):
        timer = self.__dict__.setdefault("_bench_timer", self.phase_timer)
        on = timer if select(step) else None
        self.phase_timer = on
        for layer in self.moe_layers:
            layer.set_phase_timer(on)
        if self.pipeline is not None:
            self.pipeline.set_phase_timer(on)
        return original(self, step)

    trainer_module.Trainer.train_step = train_step
    return tc.torchrun_rank(proc, argv)


def run(args, config: Path, out: Path) -> list[dict]:
    argv = ["--config", str(config), "--out", str(out), "--seed", "0", *shlex.split(args.flags)]
    run_processes(alternating_timer_rank, args.ranks, (argv, args.timed), timeout_s=args.timeout)
    return read_metrics(out / "metrics.jsonl")


def main() -> None:
    p = make_parser(__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--flags", default="--ep 2 --use-distributed-optimizer", help="train.py layout flags")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--interval", type=int, default=10, help="straggler_interval")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument(
        "--timed",
        default="odd",
        choices=sorted(TIMED),
        help="steps with the phase timer attached ('none', 'all': A/A controls of the odd/even ratio)",
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "rewind_straggler.json")
    args = p.parse_args()
    os.environ.setdefault("PYTHONPATH", str(REPO))

    with tempfile.TemporaryDirectory(prefix="rewind_straggler-") as tmp:
        work = Path(tmp)
        corpus = tc.write_corpus(work / "corpus")
        base = {"steps": args.steps, "global_batch": args.global_batch, "seq_len": args.seq_len,
                "checkpoint_every": 0, "log_every": args.steps}  # fmt: skip
        on = {"check_for_spiky_loss": True, "rewind_snapshot_interval": 1, "log_straggler": True,
              "straggler_interval": args.interval}  # fmt: skip

        def config(name: str, training: dict) -> Path:
            return tc.make_config(work / f"{name}.toml", corpus, work / "cache", training={**base, **training})

        # One run with everything on (the timer on odd steps only).
        records = run(args, config("all", on), work / "all")
        events = read_events(work / "all" / "metrics.jsonl", "phase_times")
        records = records[args.warmup :]
        step_s = statistics.median(r["step_s"] for r in records)
        snap_s = statistics.median(r["snapshot_s"] for r in records)
        call_s = timer_call_seconds()
        # Calls per timed step (the reports average over every step of their interval).
        share = {"odd": 0.5, "even": 0.5, "all": 1.0, "none": 0.0}[args.timed]
        events_per_step = max(e["timer_events_per_step"] for e in events) / share if share else 0.0
        gather_s = statistics.median(e["gather_s"] for e in events)
        check_s = flags_all_reduce_seconds(args.ranks)
        model = DeepseekV3Config.from_toml(config("all", on))
        moe_layers = model.num_hidden_layers - model.first_k_dense_replace + model.num_nextn_predict_layers
        marks_per_step = moe_layers * 2  # micro_batches of tests/train's config
        mark_s = mark_pair_seconds()
    timed = statistics.median(r["step_s"] for r in records if r["step"] % 2)  # odd steps (timed with --timed odd)
    untimed = statistics.median(r["step_s"] for r in records if not r["step"] % 2)
    in_run = {
        "step_s": step_s,
        "snapshot_s": snap_s,
        "snapshot_over_step": snap_s / step_s,
        "snapshot_mib_rank0": records[-1]["snapshot_mib"],
        "timer_events_per_step": events_per_step,
        "timer_call_s": call_s,
        "timer_over_step": events_per_step * call_s / step_s,
        "mark_pairs_per_step": marks_per_step,
        "mark_pair_s": mark_s,
        "marks_over_step": marks_per_step * mark_s / step_s,
        "gather_s": gather_s,
        "gather_over_step": gather_s / args.interval / step_s,
        "flags_all_reduce_s": check_s,
        "check_over_step": check_s / step_s,
        "timed": args.timed,
        "odd_step_s": timed,
        "even_step_s": untimed,
        "odd_over_even": timed / untimed,
    }
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "in_run": in_run}
    print(f"layout: {args.ranks} ranks {args.flags!r}, {args.global_batch} x {args.seq_len} tokens per step")
    print(f"median step                 {1e3 * step_s:8.1f} ms")
    print(f"snapshot (every step)       {1e3 * snap_s:8.2f} ms  = {100 * in_run['snapshot_over_step']:.2f}% of a step "
          f"({in_run['snapshot_mib_rank0']:.1f} MiB on rank 0)")  # fmt: skip
    print(f"phase timer                 {events_per_step:8.0f} calls/step x {1e9 * call_s:.0f} ns = "
          f"{100 * in_run['timer_over_step']:.3f}% of a step")  # fmt: skip
    print(f"autograd marks              {marks_per_step:8d} pairs/step x {1e6 * mark_s:.0f} us = "
          f"{100 * in_run['marks_over_step']:.3f}% of a step")  # fmt: skip
    print(f"report gather               {1e3 * gather_s:8.2f} ms every {args.interval} steps = "
          f"{100 * in_run['gather_over_step']:.3f}% of a step")  # fmt: skip
    print(f"anomaly flags all-reduce    {1e3 * check_s:8.3f} ms/step = "
          f"{100 * in_run['check_over_step']:.3f}% of a step")  # fmt: skip
    print(f"odd / even steps (timer on the {args.timed} steps) {timed / untimed:.3f} ({1e3 * timed:.1f} / "
          f"{1e3 * untimed:.1f} ms, medians of {len(records) // 2} steps each)")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
