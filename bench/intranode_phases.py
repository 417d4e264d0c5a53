"""Where mtdeepep's intranode time goes: its pieces timed one by one, with the page faults each call takes.

Same setting and timing convention as `intranode.py` (barrier before every call, median per rank), one rank
count per run. Pieces:

- layout: `get_dispatch_layout` alone;
- dispatch {bf16,fp8}: `dispatch` with the layout given; `cached`: with the handle of an earlier dispatch;
- combine bf16: `combine(recv_x, handle)`;
- copy into fresh / warm: a 1-thread `copy_` of this rank's recv_x bytes into a tensor allocated for the call
  (what dispatch does with recv_x) or into one allocated once and reused, and a fresh `[T, H]` bf16 output
  filled once (what combine allocates). Their difference is the cost of faulting in new pages.

Run: `.venv/bin/python bench/intranode_phases.py --num-ranks 2 [--thp]`
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import make_parser, median, run_ranks
from intranode import BenchConfig, make_inputs

import mtdeepep as deep_ep


def minor_faults() -> int:
    """Minor page faults of this process so far (all its threads, the comm thread included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_with_faults(fn: Callable[[], Any], group, iters: int, warmup: int) -> tuple[float, int]:
    """(median ms, median minor faults) per call, with a barrier before each."""
    millis, faults = [], []
    for iteration in range(warmup + iters):
        dist.barrier(group=group)
        faults_before, start = minor_faults(), time.perf_counter()
        result = fn()
        elapsed, taken = time.perf_counter() - start, minor_faults() - faults_before
        del result
        if iteration >= warmup:
            millis.append(elapsed * 1e3)
            faults.append(taken)
    return median(millis), int(median(faults))


def pieces(buffer: deep_ep.Buffer, cfg: BenchConfig, rank: int) -> dict[str, Callable[[], Any]]:
    inputs = make_inputs(cfg, rank)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(inputs.topk_idx_TK, cfg.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    topk = dict(topk_idx=inputs.topk_idx_TK, topk_weights=inputs.topk_weights_TK)
    fns: dict[str, Callable[[], Any]] = {"layout": lambda: buffer.get_dispatch_layout(inputs.topk_idx_TK, cfg.experts)}
    for name, x in (("bf16", inputs.x_TH), ("fp8", inputs.x_fp8)):
        handle = buffer.dispatch(x, **layout, **topk)[4]
        fns[f"dispatch {name}"] = lambda x=x: buffer.dispatch(x, **layout, **topk)
        fns[f"dispatch {name} cached"] = lambda x=x, handle=handle: buffer.dispatch(x, handle=handle)
    recv_x, _, _, _, handle, _ = buffer.dispatch(inputs.x_TH, **layout, **topk)
    fns["combine bf16"] = lambda: buffer.combine(recv_x, handle)
    src = torch.ones(recv_x.numel() * recv_x.element_size(), dtype=torch.uint8)
    warm = torch.zeros_like(src)
    fns["copy recv bytes into fresh"] = lambda: torch.empty_like(src).copy_(src)
    fns["copy recv bytes into warm"] = lambda: warm.copy_(src)
    fns["fill fresh [T, H] bf16"] = lambda: torch.empty_like(inputs.x_TH).fill_(1)
    return fns


def phases_rank(rank: int, num_ranks: int, group, cfg: BenchConfig) -> dict[str, tuple[float, int]]:
    buffer = deep_ep.Buffer(group, num_nvl_bytes=cfg.nvl_bytes, explicitly_destroy=True)
    try:
        fns = pieces(buffer, cfg, rank)
        previous = torch.get_num_threads()
        results = {}
        for name, fn in fns.items():
            torch.set_num_threads(1 if name.startswith(("copy", "fill")) else previous)
            results[name] = time_with_faults(fn, group, cfg.iters, cfg.warmup)
        torch.set_num_threads(previous)
        return results
    finally:
        buffer.destroy()


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--thp", action="store_true", help="set THP_MEM_ALLOC_ENABLE=1 in the ranks")
    args = parser.parse_args()
    if args.thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    cfg = BenchConfig(iters=args.iters)
    per_rank = run_ranks(phases_rank, args.num_ranks, (cfg,))
    print(f"{args.num_ranks} ranks, median of {cfg.iters}{', THP_MEM_ALLOC_ENABLE=1' if args.thp else ''}")
    for name in per_rank[0]:
        cells = "  ".join(f"r{r} {res[name][0]:7.1f} ms {res[name][1]:6d} faults" for r, res in enumerate(per_rank))
        print(f"{name:28s} {cells}")


if __name__ == "__main__":
    main()
