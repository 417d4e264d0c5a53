"""Memory over many rounds: each rank's resident set (RSS), its number of memory mappings and its shared-memory
segments, after every `--every` dispatch + combine rounds, over `--rounds` rounds of random sizes (the attack of
issue 23, item 5: 520 random rounds grew rank 0 by 130-145 MB in their second half).

A round: random token count, hidden size, expert count, top-k and dtype (seeded; both ranks draw the same sizes,
their own data), `get_dispatch_layout`, `dispatch`, the received rows scaled (a toy expert), `combine`; every 7th
round also a cached dispatch, every 5th a dispatch whose outputs are held for 3 rounds before their combine (the
region's placed outputs). The rows are checked against the plain-PyTorch reference every `--check-every` rounds.

What it shows: RSS, mappings and segments at the reported rounds on every rank; the growth over the second half of
the run (MB per 1,000 rounds); and whether it stays flat (under `--flat-mb` over the second half).

    .venv/bin/python bench/memory_rounds.py                       # 2,000 rounds, report at 100, 1000, 2000
    .venv/bin/python bench/memory_rounds.py --rounds 600 --report 100,300,600

Legend: T tokens per rank, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import RESULTS_DIR, add_config_arguments, config_from_args, make_parser, print_table, save_results

import mtdeepep as deep_ep
from mtdeepep.utils import refs
from mtdeepep.utils.testing import run_ranks


@dataclass
class MemoryConfig:
    rounds: int = 2000
    report: str = "100,1000,2000"
    check_every: int = 50
    num_nvl_bytes: int = 64 << 20
    flat_mb: float = 16.0
    seed: int = 0
    trim_at_reports: bool = False


def resident_mb() -> float:
    """This process's resident set, MB (from /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def allocator_state() -> dict[str, float]:
    """glibc's view: bytes its arenas hold free (mallinfo2 fordblks), and the RSS after `malloc_trim(0)` gives that
    back: what is left is memory in use (a leak would stay), not free memory the allocator keeps."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip

    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    libc.malloc_trim(0)
    return {"arena_mb": info.arena / 1e6, "free_in_arenas_mb": info.fordblks / 1e6, "mmapped_mb": info.hblkhd / 1e6,
            "heap_in_use_mb": info.uordblks / 1e6, "python_objects": len(gc.get_objects()),
            "rss_after_trim_mb": resident_mb()}  # fmt: skip


def num_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def num_segments() -> int:
    return sum(1 for name in os.listdir("/dev/shm") if name.startswith("mtdeepep-"))


def sizes(round_index: int, seed: int) -> dict[str, Any]:
    """The round's sizes, the same on every rank."""
    rng = random.Random(seed * 100_003 + round_index)
    return {
        "num_tokens": rng.randint(16, 1024),
        "hidden": rng.choice([64, 128, 256, 1000, 2048, 4096, 7168]),
        "num_experts": rng.choice([4, 8, 16, 32]),
        "num_topk": rng.randint(1, 4),
        "dtype": rng.choice([torch.bfloat16, torch.float32]),
    }


def one_round(buffer, rank: int, world: int, round_index: int, cfg: MemoryConfig, held: list) -> None:
    s = sizes(round_index, cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + round_index * 31 + rank)
    num_tokens, hidden, num_experts, num_topk = s["num_tokens"] + rank, s["hidden"], s["num_experts"], s["num_topk"]
    x = torch.randn(num_tokens, hidden, generator=generator).to(s["dtype"])
    topk_idx = torch.rand(num_tokens, num_experts, generator=generator).topk(min(num_topk, num_experts), 1).indices
    weights = torch.rand(topk_idx.shape, generator=generator)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights,
    )  # fmt: skip
    if round_index % cfg.check_every == 0:
        everyone = [None] * world
        dist.all_gather_object(everyone, (x, topk_idx, weights))
        ref = refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], num_experts, rank)
        if not torch.equal(recv_x, ref.recv_x):
            raise AssertionError(f"round {round_index}: the dispatched rows differ from the reference")
    if round_index % 7 == 0:
        again, *_ = buffer.dispatch(x, handle=handle)
        if not torch.equal(again, recv_x):
            raise AssertionError(f"round {round_index}: the cached dispatch differs")
    if round_index % 5 == 0:
        held.append((round_index + 3, recv_x, handle))  # combined 3 rounds later
    else:
        buffer.combine(recv_x * 2, handle, topk_weights=recv_w)
    for _, rows, old_handle in [h for h in held if h[0] == round_index]:
        buffer.combine(rows, old_handle)
    held[:] = [h for h in held if h[0] != round_index]


def rank_main(rank: int, world: int, group, cfg: MemoryConfig) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    buffer = deep_ep.Buffer(group, cfg.num_nvl_bytes, explicitly_destroy=True)
    reports = sorted({int(r) for r in cfg.report.split(",")} | {cfg.rounds // 2, cfg.rounds})
    samples, held = [], []
    try:
        for i in range(1, cfg.rounds + 1):
            one_round(buffer, rank, world, i, cfg, held)
            if i in reports:
                gc.collect()
                sample = {"round": i, "rss_mb": resident_mb(), "mappings": num_mappings(), "segments": num_segments(),
                          "fds": len(os.listdir("/proc/self/fd"))}  # fmt: skip
                if cfg.trim_at_reports:
                    sample.update(allocator_state())
                samples.append(sample)
        for _, rows, old_handle in held:
            buffer.combine(rows, old_handle)
    finally:
        buffer.destroy()
    return samples


def main() -> None:
    parser = make_parser(__doc__)
    add_config_arguments(parser, MemoryConfig())
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--json", default=str(RESULTS_DIR / "memory_rounds.json"))
    args = parser.parse_args()
    cfg = config_from_args(MemoryConfig, args)
    per_rank = run_ranks(rank_main, args.num_ranks, (cfg,), timeout_s=3600)
    rows, verdicts = [], []
    for rank, samples in enumerate(per_rank):
        for sample in samples:
            rows.append([str(rank), str(sample["round"]), f"{sample['rss_mb']:.1f}", str(sample["mappings"]),
                         str(sample["segments"]), str(sample["fds"]),
                         f"{sample.get('free_in_arenas_mb', float('nan')):.1f}",
                         f"{sample.get('rss_after_trim_mb', float('nan')):.1f}"])  # fmt: skip
        half = next(s for s in samples if s["round"] == cfg.rounds // 2)
        last = samples[-1]
        # With --trim-at-reports the resident set is judged once the allocator returned the free memory it keeps.
        rss = "rss_after_trim_mb" if "rss_after_trim_mb" in last else "rss_mb"
        growth = last[rss] - half[rss]
        per_1000 = growth / max(1, last["round"] - half["round"]) * 1000
        flat = growth <= cfg.flat_mb and last["mappings"] - half["mappings"] <= 2
        verdicts.append({"rank": rank, "measure": rss, "second_half_rss_mb": growth, "mb_per_1000_rounds": per_1000,
                         "mappings_second_half": last["mappings"] - half["mappings"], "flat": flat})  # fmt: skip
    print_table(["rank", "round", "RSS MB", "mappings", "segments", "fds", "free in arenas MB", "RSS after trim"], rows,
                f"{cfg.rounds} random dispatch + combine rounds, {args.num_ranks} ranks")  # fmt: skip
    for v in verdicts:
        verdict = "flat" if v["flat"] else "GROWS"
        print(f"rank {v['rank']}: second half {v['second_half_rss_mb']:+.1f} MB of {v['measure']} "
              f"({v['mb_per_1000_rounds']:+.1f} MB per 1,000 rounds), mappings {v['mappings_second_half']:+d}: "
              f"{verdict}")  # fmt: skip
    save_results(args.json, {"config": cfg.__dict__, "per_rank": per_rank, "verdicts": verdicts})


if __name__ == "__main__":
    main()
