"""The trainer's data loader on indexed data: time per step of one data-parallel rank's batch, and its share of the
training step.

    python bench/loader.py                                  # synthetic blend, per-rank batches up to 128 x 4096
    python bench/loader.py --metrics RUN_DIR/metrics.jsonl  # the share in a finished run (data_s / step_s)

What one step's loader does (moe/trainer/train/trainer.py, `Trainer.train_step`, between `data_start` and `data_s`):
`BlendedBatches.local_batch` (this rank's rows of the global batch out of the memory-mapped `.bin` files, Megatron's
blend order), and with every Megatron flag on, `eod_masked_labels`, `documents.document_ids` and
`positions_in_documents`. Measured here on a synthetic blend of 3 datasets (uint16 tokens, documents of lognormal
lengths around 800 tokens, each ending in the end-of-text id 0), weights 0.5 / 0.3 / 0.2, for several per-rank
batch shapes; the median over `--iters` steps (each a new step: new windows, as in training; the files are in the
page cache after the first pass, as for a corpus that fits in memory). Every run's metrics.jsonl carries the same
figure per step ("data_s", next to "step_s"), which `--metrics` summarises.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from moe.trainer.data.blend import BlendedWindows
from moe.trainer.data.blended_batches import BlendedBatches
from moe.trainer.data.indexed import IndexedDatasetWriter
from moe.trainer.data.source import eod_masked_labels
from moe.trainer.models.deepseek_v3 import documents


def write_synthetic(root: Path, tokens: int, seed: int) -> list:
    """Three datasets of `tokens` tokens together (split 0.5 / 0.3 / 0.2); returns the weighted data_path."""
    rng = np.random.default_rng(seed)
    data_path = []
    for name, share in (("web", 0.5), ("code", 0.3), ("books", 0.2)):
        with IndexedDatasetWriter(root / name, np.uint16) as writer:
            left = int(tokens * share)
            while left > 0:
                n = min(left, max(2, int(rng.lognormal(np.log(800), 0.8))))
                doc = rng.integers(1, 50000, n, dtype=np.uint16)
                doc[-1] = 0
                writer.add_document(doc)
                left -= n
        data_path += [share, str(root / name)]
    return data_path


def time_loader(batches: BlendedBatches, rows: int, dp: int, iters: int, flags: bool) -> float:
    """Median seconds of one step's loader work for data-parallel rank 0 of `dp` (`rows` rows each)."""
    times = []
    for step in range(1, iters + 1):
        start = time.perf_counter()
        tokens = batches.local_batch(step, 0, dp)
        if flags:
            eod_masked_labels(tokens, 0)
            doc = documents.document_ids(tokens, 0)
            documents.positions_in_documents(doc)
        times.append(time.perf_counter() - start)
        assert tokens.shape == (rows, batches.seq_len)
    return statistics.median(times)


def metrics_share(path: Path) -> None:
    records = [r for r in map(json.loads, path.read_text().splitlines()) if "kind" not in r and "data_s" in r]
    shares = [r["data_s"] / r["step_s"] for r in records]
    loader = statistics.median(r["data_s"] for r in records)
    print(f"{path}: {len(records)} steps, loader median {1e3 * loader:.3f} ms, "
          f"step median {statistics.median(r['step_s'] for r in records):.3f} s, share median "
          f"{100 * statistics.median(shares):.3f}% (max {100 * max(shares):.3f}%)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=30_000_000, help="synthetic tokens over the 3 datasets")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--metrics", type=Path, help="a run's metrics.jsonl: print its loader share instead")
    args = p.parse_args()
    if args.metrics is not None:
        metrics_share(args.metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        data_path = write_synthetic(Path(tmp), args.tokens, seed=0)
        print(f"wrote {args.tokens / 1e6:.0f}M tokens in {time.perf_counter() - start:.1f} s")
        print(f"{'rows/rank':>9} {'seq_len':>7} {'loader ms':>10} {'+ flags ms':>10} {'step for 2% (s)':>16}")
        for rows in (8, 32, 128):
            dp = 8
            global_batch = rows * dp
            start = time.perf_counter()
            windows = BlendedWindows(data_path, seq_len=args.seq_len, num_samples=global_batch * (args.iters + 1),
                                     seed=0, held_out=0.001)  # fmt: skip
            build = time.perf_counter() - start
            batches = BlendedBatches(windows, global_batch=global_batch, val_sequences=0, eod_id=0, vocab_size=50000)
            plain = time_loader(batches, rows, dp, args.iters, flags=False)
            flagged = time_loader(batches, rows, dp, args.iters, flags=True)
            print(f"{rows:>9} {args.seq_len:>7} {1e3 * plain:>10.2f} {1e3 * flagged:>10.2f} {50 * flagged:>16.3f}"
                  f"   (blend built in {build:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
