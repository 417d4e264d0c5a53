"""FP8 training convergence: the `tiny` DeepSeek-V3 config trained the same steps, seed and data in FP32, in FP8
(each recipe), and in FP32 from initial weights perturbed by a BF16-sized relative noise (the run-to-run noise floor
of this measurement: a difference smaller than it says nothing about the recipe).

Each run: `moe.trainer.train`'s own `Trainer.train_step` (micro-batches, MTP loss, clipping, warm-up + cosine schedule,
aux-loss-free bias updates, `MasterAdamW`), one process and one thread, the python-stdlib corpus with tiny's BPE
vocabulary, `--batch` sequences of `--seq-len` tokens per step (smaller than tiny.toml's 32 x 128: FP8 GEMMs are
emulated on CPU, about 2x the FP32 step). Reported: the mean training loss of the last 20 steps, the held-out loss
after the last step (32 fixed validation sequences) and each relative to FP32.

    .venv/bin/python bench/fp8_convergence.py                       # 200 steps, ~10 minutes on 2 cores
    .venv/bin/python bench/fp8_convergence.py --steps 50 --runs fp32,blockwise
    .venv/bin/python bench/fp8_convergence.py --one blockwise --json r.json   # one run alone (the tests run the
                                                                                # three in parallel processes)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import RESULTS_DIR, environment, make_parser, print_table, save_results

from moe.trainer import run as assembly
from moe.trainer.data.token_file import TokenBatches, prepare_tokens
from moe.trainer.train.job_config import job_from_args
from moe.trainer.train.parallel_state import ParallelState

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "deepseek_v3" / "configs" / "tiny.toml"
RUNS = ("fp32", "fp32-perturbed", "delayed", "blockwise")
PERTURBATION = 2.0**-8  # relative, Gaussian, once on every matrix at initialisation: one BF16 rounding's size


def train(run: str, args: argparse.Namespace, workdir: Path) -> dict:
    # tiny's model and trainer as train.py builds them (moe/trainer/run.py; the recipe's FP8 conversion there).
    recipe = run if run in ("delayed", "blockwise") else None
    job = job_from_args(TINY, [
        "--steps", str(args.steps), "--global-batch-size", str(args.batch), "--micro-batches", "1",
        "--seq-length", str(args.seq_len), "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
        "--lr-warmup-iters", "10", "--optimizer.betas", "[0.9, 0.95]", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--corpus", "python-stdlib", "--tokenizer", "bpe", "--data.val_sequences", "32",
        *(["--data-cache", args.data_cache] if args.data_cache else []), "--fp8", recipe or "none",
    ])  # fmt: skip
    config = job.training
    tokens = prepare_tokens(job.data, job.model.vocab_size)
    batches = TokenBatches(tokens.tokens, seq_len=config.seq_len, global_batch=config.global_batch,
                           val_sequences=job.data.val_sequences, seed=args.seed)  # fmt: skip
    parallel = ParallelState.single()
    model, _ = assembly.build_model(job, parallel, None, seed=args.seed)
    if run == "fp32-perturbed":
        gen = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(1 + PERTURBATION * torch.randn(p.shape, generator=gen))
    trainer = assembly.build_trainer(job, model, parallel, batches, workdir / run, seed=args.seed)
    start = time.perf_counter()
    losses = [trainer.train_step(step)["loss"] for step in range(1, args.steps + 1)]
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val = batches.val_tokens()
        val_loss = float(model(val, labels=val).loss)
    return {"run": run, "losses": losses, "tail20": sum(losses[-20:]) / len(losses[-20:]), "val_loss": val_loss,
            "seconds": seconds}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {RUNS} (fp32 first)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data-cache", default=None, help="token cache directory (default: the trainer's)")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "fp8_convergence.json")
    parser.add_argument("--one", choices=RUNS, default=None, help="train this run only; its result to --json")
    args = parser.parse_args()
    if args.one is not None:
        return args
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not args.runs or args.runs[0] != "fp32" or any(r not in RUNS for r in args.runs):
        parser.error(f"--runs: a subset of {RUNS} starting with fp32")
    return args


def main() -> None:
    import tempfile

    args = parse_args()
    torch.set_num_threads(1)
    if args.one is not None:
        with tempfile.TemporaryDirectory(prefix="fp8_convergence-") as tmp:
            result = train(args.one, args, Path(tmp))
        save_results(args.json, {"args": json.loads(json.dumps(vars(args), default=str)), "results": [result]})
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="fp8_convergence-") as tmp:
        for run in args.runs:
            results.append(train(run, args, Path(tmp)))
            r = results[-1]
            print(f"{run}: last-20 {r['tail20']:.4f} held-out {r['val_loss']:.4f} ({r['seconds']:.0f} s)", flush=True)
    ref = results[0]
    rows = [
        [r["run"], f"{r['tail20']:.4f}", f"{100 * (r['tail20'] / ref['tail20'] - 1):+.1f}%", f"{r['val_loss']:.4f}",
         f"{100 * (r['val_loss'] / ref['val_loss'] - 1):+.1f}%", f"{r['seconds']:.0f}"]
        for r in results
    ]  # fmt: skip
    print(f"\ntiny, {args.steps} steps of {args.batch} x {args.seq_len} tokens, lr {args.lr}, seed {args.seed}")
    print_table(
        ("run", "last-20 loss", "vs fp32", "held-out loss", "vs fp32", "seconds"),
        rows,
        "fp32-perturbed: the noise floor (initial weights times 1 + N(0, 2^-8)); FP8 GEMMs emulated exactly on CPU.",
    )
    save_results(args.json, {"args": json.loads(json.dumps(vars(args), default=str)), "results": results,
                             "environment": environment()})  # fmt: skip


if __name__ == "__main__":
    main()
