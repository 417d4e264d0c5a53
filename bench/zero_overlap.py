"""How much of ZeRO-1's gradient communication the backward hides (moe/train/zero.py).

Setting: an MLP of `--depth` blocks Linear(width, width) + GELU (FP32), a batch of `--rows` rows per rank, `--ranks`
gloo ranks of this host (the one launcher, `mtdeepep.utils.testing.run_ranks`), buckets of `--bucket-size` elements
(about one layer each). Each step: backward, `finish_grad_sync()`, AdamW step. Two modes alternate step by step:
- overlap off: every bucket's reduction is launched by `finish_grad_sync()` after the backward, so the time from
  the end of the backward to the end of the sync is the whole communication time `C`;
- overlap on: each bucket is launched by the gradient hooks as soon as it is complete; what remains after the
  backward is the exposed part `X`.
Hidden fraction = 1 - median(X) / median(C). The backward times of both modes are printed too: on a CPU the
collectives' threads share the cores with the backward, so hiding communication may lengthen the backward.

    PYTHONPATH=. .venv/bin/python bench/zero_overlap.py --ranks 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from moe.train.config import TrainingConfig
from moe.train.parallel import Layout, ParallelState
from moe.train.zero import DistributedAdamW, ZeroConfig
from mtdeepep.utils.testing import run_ranks


def _worker(rank, world, group, args):
    del group
    par = ParallelState.from_process_group(Layout(world=world))
    cfg = TrainingConfig(steps=1, global_batch=world, seq_len=2, lr=1e-3, clip_grad=1.0)
    results = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.depth)])
        opt = DistributedAdamW(
            model, [], cfg, par, ZeroConfig(bucket_size=args.bucket_size, overlap_grad_reduce=overlap)
        )
        results[overlap] = (model, opt, [], [])
    x = torch.randn(args.rows, args.width, generator=torch.Generator().manual_seed(rank))
    for step in range(args.warmup + args.steps):
        for model, opt, backward_s, exposed_s in results.values():
            opt.zero_grad()
            loss = model(x).square().mean()
            dist.barrier()
            start = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            opt.finish_grad_sync()
            synced = time.perf_counter()
            opt.clip(opt.global_grad_norm())
            opt.step(lr=1e-3)
            if step >= args.warmup:
                backward_s.append(end - start)
                exposed_s.append(synced - end)
    out = {}
    for overlap, (_, opt, backward_s, exposed_s) in results.items():
        out[overlap] = (statistics.median(backward_s), statistics.median(exposed_s), len(opt.buckets))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--bucket-size", type=int, default=1_100_000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    results = run_ranks(_worker, args.ranks, (args,), timeout_s=600)
    off_b, comm, buckets = results[0][False]
    on_b, exposed, _ = results[0][True]
    params = args.depth * (args.width * args.width + args.width)
    print(f"{args.ranks} gloo ranks, {params / 1e6:.1f} M FP32 parameters in {buckets} buckets, rows {args.rows}")
    print(f"overlap off: backward {off_b * 1e3:7.1f} ms, communication after it {comm * 1e3:7.1f} ms")
    print(f"overlap on : backward {on_b * 1e3:7.1f} ms, communication after it {exposed * 1e3:7.1f} ms")
    print(f"hidden: {100 * (1 - exposed / comm):.0f}% of the communication time; step (backward + sync) "
          f"{(off_b + comm) * 1e3:.1f} -> {(on_b + exposed) * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
