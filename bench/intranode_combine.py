"""The intranode combine against a memory copy of the same bytes, measured iteration by iteration in one run.

Setting of `intranode.py` (4096 tokens per rank, hidden 7168, top-8 of 256, random routing, bf16, one intra-op
thread per rank on 2 cores): each iteration times, after a gloo barrier, `combine(recv_x, handle)` on every rank
(the slowest rank's time counts), then, after another barrier, `intranode.py`'s `memcpy-all`: every rank at once
copies the same number of bytes as its combine counts (the bytes of `recv_x` it received) with one thread between
two pre-faulted tensors (the slowest rank's time counts). The ratio memcpy time / combine time of each iteration
pairs two measurements taken a few milliseconds apart and needing every rank's core alike, so that load from other
processes of the machine moves both; the report gives the median ratio and its spread (quartiles) over the
iterations, and the minor page faults per combine call.

Run: `.venv/bin/python bench/intranode_combine.py [--num-ranks 2] [--iters 40]`; `--json PATH` writes the samples.
`tests/test_bench_combine.py` runs a short version and guards the ratio loosely.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from _common import make_parser, run_ranks
from intranode import BenchConfig, deepep_dispatch, make_inputs

import mtdeepep as deep_ep


@dataclass(frozen=True)
class CombineRatio:
    """Per iteration: the slowest rank's combine seconds and memcpy-all seconds, the ratio memcpy / combine (1.0: the
    combine takes as long as copying its bytes once), and rank 0's recv bytes."""

    combine_s: list[float]
    memcpy_s: list[float]
    recv_bytes: int
    faults_per_call: float

    @property
    def ratios(self) -> list[float]:
        return [copy / combine for copy, combine in zip(self.memcpy_s, self.combine_s, strict=True)]

    def summary(self) -> dict[str, float]:
        ratios = sorted(self.ratios)
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        return {
            "median_ratio": median,
            "q1_ratio": q1,
            "q3_ratio": q3,
            "combine_ms": statistics.median(self.combine_s) * 1e3,
            "memcpy_ms": statistics.median(self.memcpy_s) * 1e3,
            "recv_mb": self.recv_bytes / 1e6,
            "faults_per_call": self.faults_per_call,
        }


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def combine_ratio_rank(rank: int, num_ranks: int, group, cfg: BenchConfig) -> CombineRatio | None:
    """One rank of the measurement; rank 0 returns the samples."""
    buffer = deep_ep.Buffer(group, num_nvl_bytes=cfg.nvl_bytes, explicitly_destroy=True)
    try:
        inputs = make_inputs(cfg, rank)
        recv_x, _, _, _, handle, _ = deepep_dispatch(buffer, inputs.x_TH, inputs, cfg.experts)
        recv_bytes = recv_x.numel() * recv_x.element_size()
        src = torch.ones(recv_bytes, dtype=torch.uint8)
        dst = torch.zeros(recv_bytes, dtype=torch.uint8)
        threads = torch.get_num_threads()
        combine_s, memcpy_s, faults = [], [], 0
        for iteration in range(cfg.warmup + cfg.iters):
            dist.barrier(group=group)
            faults_before, start = _minor_faults(), time.perf_counter()
            combined = buffer.combine(recv_x, handle)[0]
            elapsed = torch.tensor([time.perf_counter() - start])
            faults_taken = _minor_faults() - faults_before
            del combined
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            torch.set_num_threads(1)
            dist.barrier(group=group)
            start = time.perf_counter()
            dst.copy_(src)
            copy_elapsed = torch.tensor([time.perf_counter() - start])
            torch.set_num_threads(threads)
            dist.all_reduce(copy_elapsed, op=dist.ReduceOp.MAX, group=group)
            if iteration >= cfg.warmup:
                combine_s.append(float(elapsed))
                memcpy_s.append(float(copy_elapsed))
                faults += faults_taken
        return CombineRatio(combine_s, memcpy_s, recv_bytes, faults / cfg.iters) if rank == 0 else None
    finally:
        buffer.destroy()


def measure(num_ranks: int = 2, iters: int = 40, warmup: int = 3, num_tokens: int = 4096) -> CombineRatio:
    cfg = BenchConfig(tokens=num_tokens, iters=iters, warmup=warmup)
    return run_ranks(combine_ratio_rank, num_ranks, (cfg,))[0]


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None, help="write the samples and the summary here")
    args = parser.parse_args()
    start = time.monotonic()
    result = measure(args.num_ranks, args.iters, num_tokens=args.num_tokens)
    summary = result.summary()
    head = f"{args.num_ranks} ranks, {args.num_tokens} tokens, {args.iters} iterations"
    print(
        f"{head} ({time.monotonic() - start:.0f} s): combine {summary['combine_ms']:.1f} ms, memcpy-all of its "
        f"{summary['recv_mb']:.0f} MB {summary['memcpy_ms']:.1f} ms; memcpy/combine median "
        f"{summary['median_ratio']:.1%} (quartiles {summary['q1_ratio']:.1%} - {summary['q3_ratio']:.1%}); "
        f"{summary['faults_per_call']:.1f} minor faults per combine call"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "combine_s": result.combine_s,
                                         "memcpy_s": result.memcpy_s}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
