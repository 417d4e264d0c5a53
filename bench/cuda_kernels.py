"""Bandwidth of mtdeepep's CUDA kernels as a fraction of a device-to-device copy of the same bytes, with R ranks as
streams of ONE process on one GPU (`mtdeepep.utils.local_ranks`: each rank its own buffers and stream, peer
pointers instead of IPC), so the ranks' kernels truly run at the same time; and low-latency dispatch/combine
latency.

Why one process: rank processes sharing a GPU are time-sliced (one CUDA context at a time), so a kernel that waits
for a peer waits for the scheduler's slice and the numbers would measure that. Ranks as streams of one process run
concurrently, as ranks on their own GPUs would, except that they share one GPU's memory bandwidth and SMs: the copy
baseline below shares them the same way.

Setting (upstream DeepEP's intranode test): 4096 tokens per rank, hidden 7168, top-8 of 256 experts, R = 4 and 8
ranks, uniform routing (per token the top-8 of uniform random scores) and skewed routing (scores scaled by a factor
falling from 4 to 1/4 across the experts: the first rank's experts take most of the traffic), at several SM counts
per rank (`Config.num_sms`).

Operations and the bytes that count (summed over the ranks; what the operation must at least read and write):

- layout:        `get_dispatch_layout(topk_idx, 256)`: topk_idx read + the four outputs written.
- dispatch bf16: `dispatch(x, ..., num_worst_tokens=T * R)`: every received row read once at its source and written
  once at its receiver: 2 x rows x 2H.
- dispatch fp8:  the same with x the pair (E4M3 `[T, H]`, float32 scales `[T, H / 128]`): 2 x rows x (H + H / 32).
- combine bf16:  `combine(recv_x, handle)` of that dispatch: every received row read once and each token's sum
  written once: rows x 2H + tokens x 2H.
- fp8 cast:      the standalone 1x128 cast kernel (the one the low-latency dispatch fuses) on each rank's T tokens:
  read 2H, write H + H / 32 per token.

The copy: every rank copies, on its own stream, at the same time as the others, half of its operation's bytes from
one device tensor to another (a copy of N bytes reads N and writes N): 'of copy' = copy time / operation time, the
operation's bandwidth as a share of what plain copies of the same traffic reach here.

Timing: every rank's stream first waits for a gate (one event behind a sleep kernel long enough for the host to
enqueue all the calls), then runs `--iters` calls back to back; time per call = (last rank's end - gate) / iters.
So the host's launch overhead is not in the numbers (the calls are enqueued while the gate holds the GPU), and the
ranks start together. Normal-mode calls use `num_worst_tokens` and skip value checks (no host synchronisation).
Before timing, each operation's outputs at one iteration are checked against the references of `mtdeepep.utils.refs`
(a wrong kernel cannot post a time).

Low latency (upstream's low-latency test): 128 tokens per rank, hidden 7168, top-8, 32 experts per rank; dispatch
bf16 / fp8 and combine, one call per rank behind the gate, latency = median over `--iters` of (last end - gate).

Run on a machine with a GPU and mtdeepep's CUDA executor built (scripts/gpu_check.sh does both):

    python bench/cuda_kernels.py                        # table + bench/results/cuda_kernels.json
    python bench/cuda_kernels.py --num-ranks 4 --sms 8,16 --iters 10

Without a GPU or without the CUDA executor it prints why and exits with status 2.

Legend: T tokens per rank, H hidden, K top-k, E experts, R ranks.
"""

from __future__ import annotations

import os

# Ranks of one process wait for each other's kernels: eager module loading, set before CUDA starts
# (mtdeepep.utils.local_ranks says why).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import _common as common
import torch
from _common import (
    add_rank_counts,
    config_from_args,
    config_parser,
    environment,
    print_table,
    random_routing,
    save_results,
)

import mtdeepep as deep_ep
from mtdeepep.utils import refs
from mtdeepep.utils.fp8 import per_token_cast_to_fp8
from mtdeepep.utils.testing import cuda_executor_import_error

ROUTINGS = ("uniform", "skewed")


@dataclass(frozen=True)
class BenchConfig(common.BenchConfig):
    experts: int = 256
    ll_tokens: int = 128
    ll_experts_per_rank: int = 32
    ll_iters: int = 20


CONFIG_HELP = {
    "tokens": "tokens per rank (normal mode)",
    "iters": "timed calls per operation",
    "warmup": "untimed calls per operation",
    "ll_tokens": "tokens per rank of the low-latency rows",
    "ll_iters": "timed low-latency calls (median)",
}


# ---------------------------------------------------------------------------------------------------------------
# Timing: a gate, then every rank's calls


class Gate:
    """Holds every rank's stream behind one event until the host has enqueued all the calls: a sleep kernel on a
    gate stream, then the event. `seconds` (of GPU sleep) is adapted to the host's enqueue time."""

    CYCLES_PER_S = 1.5e9  # a low estimate of the SM clock: the sleep lasts at least as long as asked

    def __init__(self, ranks) -> None:
        self.ranks = ranks
        self.stream = torch.cuda.Stream(ranks.device)
        self.seconds = 0.005

    def time(self, call: Callable[[int], Any], iters: int) -> float:
        """Seconds per call: `call(rank)` `iters` times on every rank's stream, all behind the gate."""
        self.ranks.synchronize()
        opened = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(int(self.seconds * self.CYCLES_PER_S))
            opened.record(self.stream)
        ends = []
        host_start = time.perf_counter()
        for rank in range(self.ranks.num_ranks):
            with self.ranks.stream(rank) as stream:
                stream.wait_event(opened)
                for _ in range(iters):
                    call(rank)
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                ends.append(end)
        enqueue_s = time.perf_counter() - host_start
        self.ranks.synchronize()
        if enqueue_s > 0.8 * self.seconds:  # the gate opened before the host finished: again, with a longer gate
            self.seconds = 2 * enqueue_s + 0.002
            return self.time(call, iters)
        return max(opened.elapsed_time(end) for end in ends) / 1e3 / iters


# ---------------------------------------------------------------------------------------------------------------
# Normal mode


def normal_rows(ranks, buffers, gate: Gate, cfg: BenchConfig, routing: str, sms: list[int]) -> list[dict[str, Any]]:
    """layout, dispatch bf16/fp8, combine and the FP8 cast at each SM count: one row per (op, SMs)."""
    R, H = ranks.num_ranks, cfg.hidden
    host = [random_routing(cfg.tokens, H, cfg.experts, cfg.topk, seed=1000 * R + r,
                           skewed=routing == "skewed") for r in range(R)]  # fmt: skip
    dev = ranks.device
    x = [h[0].to(dev) for h in host]
    idx = [h[1].to(dev) for h in host]
    weights = [h[2].to(dev) for h in host]
    fp8 = [per_token_cast_to_fp8(t.float()) for t in x]
    worst = cfg.tokens * R
    rows_received = [int(refs.ref_dispatch_layout(h[1], cfg.experts, R)[2].sum()) for h in host]
    rows = sum(rows_received)  # every (token, receiving rank) pair once
    layouts: list[Any] = [None] * R
    dispatched: list[Any] = [None] * R

    def layout(r: int):
        layouts[r] = buffers[r].get_dispatch_layout(idx[r], cfg.experts)[:4]

    def dispatch(r: int, payload, config):
        per_rank, per_node, per_expert, in_rank = layouts[r]
        out = buffers[r].dispatch(
            payload, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx[r], topk_weights=weights[r], num_worst_tokens=worst,
            config=config,
        )  # fmt: skip
        dispatched[r] = out
        return out

    out: list[dict[str, Any]] = []
    with deep_ep.skip_value_checks():
        for r in range(R):
            with ranks.stream(r):
                layout(r)
        ranks.synchronize()
        check_normal(host, layouts, [dispatch_on(ranks, r, dispatch, x[r], None) for r in range(R)], cfg)
        layout_bytes = sum(cfg.tokens * cfg.topk * 8 + cfg.tokens * R + (R + cfg.experts) * 4
                           for _ in range(R))  # fmt: skip
        out.append(row(gate, ranks, "layout", routing, None, layout, layout_bytes, cfg))
        for num_sms in sms:
            config = deep_ep.Config(num_sms, 6, 256, 6, 128)
            out.append(row(gate, ranks, "dispatch bf16", routing, num_sms,
                           lambda r, config=config: dispatch(r, x[r], config), 2 * rows * 2 * H, cfg))  # fmt: skip
            fp8_bytes = 2 * rows * (H + H // 32)
            out.append(row(gate, ranks, "dispatch fp8", routing, num_sms,
                           lambda r, config=config: dispatch(r, fp8[r], config), fp8_bytes, cfg))  # fmt: skip
            for r in range(R):
                with ranks.stream(r):
                    dispatch(r, x[r], config)
            handles = [(d[0], d[4]) for d in dispatched]
            ranks.synchronize()
            out.append(row(gate, ranks, "combine bf16", routing, num_sms,
                           lambda r, h=handles, c=config: buffers[r].combine(h[r][0], h[r][1], config=c),
                           rows * 2 * H + R * cfg.tokens * 2 * H, cfg))  # fmt: skip
    out.append(row(gate, ranks, "fp8 cast", routing, None, cast_call(ranks, x, cfg),
                   R * cfg.tokens * (2 * H + H + H // 32), cfg))  # fmt: skip
    return out


def dispatch_on(ranks, r: int, dispatch, payload, config):
    with ranks.stream(r):
        return dispatch(r, payload, config)


def check_normal(host, layouts, outputs, cfg: BenchConfig) -> None:
    """The first dispatch of the first and the last rank against the reference (rows exact)."""
    torch.cuda.synchronize()
    R = len(host)
    for r in sorted({0, R - 1}):
        ref = refs.ref_dispatch([h[0] for h in host], [h[1] for h in host], [h[2] for h in host], cfg.experts, r)
        n = ref.recv_x.size(0)
        if not torch.equal(outputs[r][0][:n].cpu(), ref.recv_x):
            raise AssertionError(f"rank {r}: the dispatched rows differ from the reference: no timing")
        expected = refs.ref_dispatch_layout(host[r][1], cfg.experts, R)
        if not torch.equal(layouts[r][3].cpu(), expected[2]):
            raise AssertionError(f"rank {r}: is_token_in_rank differs from the reference: no timing")


def cast_call(ranks, x: list[torch.Tensor], cfg: BenchConfig) -> Callable[[int], None]:
    """The standalone FP8 cast kernel on rank r's tokens (checked bitwise once)."""
    from mtdeepep import _C_cuda

    H = cfg.hidden
    e4m3 = [torch.empty(t.shape, dtype=torch.uint8, device=t.device) for t in x]
    scales = [torch.empty((t.size(0), H // 128), dtype=torch.float32, device=t.device) for t in x]
    num_sms = torch.cuda.get_device_properties(ranks.device).multi_processor_count // ranks.num_ranks

    def call(r: int) -> None:
        _C_cuda.cast_to_fp8(x[r].data_ptr(), x[r].stride(0), x[r].size(0), H, False, e4m3[r].data_ptr(),
                            scales[r].data_ptr(), num_sms, torch.cuda.current_stream().cuda_stream)  # fmt: skip

    with ranks.stream(0):
        call(0)
    ranks.synchronize()
    want, want_scales = per_token_cast_to_fp8(x[0].float())
    if not (torch.equal(e4m3[0], want.view(torch.uint8)) and torch.equal(scales[0], want_scales)):
        raise AssertionError("the FP8 cast kernel differs from per_token_cast_to_fp8: no timing")
    return call


def row(gate: Gate, ranks, op: str, routing: str, num_sms, call, num_bytes: int, cfg: BenchConfig) -> dict[str, Any]:
    for _ in range(cfg.warmup):
        for r in range(ranks.num_ranks):
            with ranks.stream(r):
                call(r)
    seconds = gate.time(call, cfg.iters)
    # The copy baseline: each rank copies its share of half the traffic (a copy reads and writes), all at once.
    share = max(16, num_bytes // 2 // ranks.num_ranks)
    src = [torch.randint(0, 255, (share,), dtype=torch.uint8, device=ranks.device) for _ in range(ranks.num_ranks)]
    dst = [torch.empty_like(s) for s in src]
    copy_seconds = gate.time(lambda r: dst[r].copy_(src[r]), cfg.iters)
    print(
        f"  R={ranks.num_ranks} {op:14s} {routing:8s} SMs={num_sms or '-':>3}  {seconds * 1e6:9.1f} us  "
        f"{num_bytes / seconds / 1e9:7.0f} GB/s  {100 * copy_seconds / seconds:4.0f}% of copy",
        flush=True,
    )
    return {"num_ranks": ranks.num_ranks, "op": op, "routing": routing, "num_sms": num_sms, "bytes": num_bytes,
            "seconds": seconds, "copy_seconds": copy_seconds}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Low latency


def low_latency_rows(ranks, gate: Gate, cfg: BenchConfig) -> list[dict[str, Any]]:
    R, H, T = ranks.num_ranks, cfg.hidden, cfg.ll_tokens
    num_experts = cfg.ll_experts_per_rank * R
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, R, num_experts)
    buffers = ranks.buffers(0, hint, low_latency_mode=True)
    dev = ranks.device
    host = [random_routing(T, H, num_experts, cfg.topk, seed=77 + r) for r in range(R)]
    x, idx, weights = ([h[i].to(dev) for h in host] for i in range(3))
    selections = sum(int((h[1] >= 0).sum()) for h in host)
    out = []
    with deep_ep.skip_value_checks():
        for use_fp8 in (False, True):

            def dispatch(r: int, use_fp8=use_fp8):
                return buffers[r].low_latency_dispatch(x[r], idx[r], T, num_experts, use_fp8=use_fp8)

            samples = [gate.time(dispatch, 1) for _ in range(cfg.ll_iters)]
            row_bytes = H + H // 32 + 16 if use_fp8 else 2 * H + 16
            out.append(ll_row(R, f"ll dispatch {'fp8' if use_fp8 else 'bf16'}", samples, selections * row_bytes))
        received = []
        for r in range(R):
            with ranks.stream(r):
                received.append(buffers[r].low_latency_dispatch(x[r], idx[r], T, num_experts, use_fp8=False))
        ranks.synchronize()
        y = [recv[0].clone() for recv in received]
        handles = [recv[2] for recv in received]

        def combine(r: int):
            return buffers[r].low_latency_combine(y[r], idx[r], weights[r], handles[r])

        samples = [gate.time(combine, 1) for _ in range(cfg.ll_iters)]
        out.append(ll_row(R, "ll combine bf16", samples, selections * 2 * H))
    for buffer in buffers:
        buffer.destroy()
    return out


def ll_row(num_ranks: int, op: str, samples: list[float], num_bytes: int) -> dict[str, Any]:
    seconds = statistics.median(samples)
    print(f"  R={num_ranks} {op:16s} {seconds * 1e6:8.1f} us (median of {len(samples)})", flush=True)
    return {"num_ranks": num_ranks, "op": op, "bytes": num_bytes, "seconds": seconds, "samples": samples}


# ---------------------------------------------------------------------------------------------------------------
# Report

NORMAL_HEADERS = ["R", "op", "routing", "SMs", "MB", "us", "GB/s", "copy GB/s", "of copy"]
LL_HEADERS = ["R", "op", "us (median)", "GB/s"]


def normal_table_row(row: dict[str, Any]) -> list[str]:
    return [str(row["num_ranks"]), row["op"], row["routing"], str(row["num_sms"] or "-"), f"{row['bytes'] / 1e6:.1f}",
            f"{row['seconds'] * 1e6:.1f}", f"{row['bytes'] / row['seconds'] / 1e9:.0f}",
            f"{row['bytes'] / row['copy_seconds'] / 1e9:.0f}",
            f"{100 * row['copy_seconds'] / row['seconds']:.0f}%"]  # fmt: skip


def measured(results: dict[str, Any], what: str, ranks, section: Callable[..., list], *args) -> list:
    """The rows of one section, or none with the failure recorded (and the ranks' device state printed): one broken
    operation does not cost the others' numbers."""
    try:
        return section(*args)
    except Exception as error:  # noqa: BLE001 - reported in the table's notes and the JSON, the run goes on
        print(f"FAILED {what}: {type(error).__name__}: {error}\n{ranks.device_states()}", flush=True)
        results.setdefault("failures", []).append(f"{what}: {type(error).__name__}: {error}")
        return []


def main() -> None:
    parser = config_parser(__doc__, BenchConfig(), helps=CONFIG_HELP, results="cuda_kernels", ranks="4,8")
    add_rank_counts(parser, "8,16,32", "--sms", "SM counts per rank")
    args = parser.parse_args()
    reason = None if torch.cuda.is_available() else "no CUDA device"
    reason = reason or cuda_executor_import_error()
    if reason is not None:
        print(f"bench/cuda_kernels.py needs a GPU and mtdeepep's CUDA executor: {reason}", file=sys.stderr)
        sys.exit(2)
    from mtdeepep.utils.local_ranks import LocalRanks

    cfg = config_from_args(BenchConfig, args)
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {"config": asdict(cfg), "environment": environment(), "harness": "single process",
                               "gpu": {"name": props.name, "multiprocessors": props.multi_processor_count,
                                       "memory_bytes": props.total_memory, "cuda": torch.version.cuda},
                               "normal": [], "low_latency": []}  # fmt: skip
    for num_ranks in args.num_ranks:
        sms = [n for n in args.sms if n * num_ranks <= 4 * props.multi_processor_count]
        worst_rows = cfg.tokens * num_ranks
        nvl_bytes = worst_rows * (2 * cfg.hidden + 16 * (cfg.topk + 2) + 64) + (16 << 20)
        with LocalRanks(num_ranks, device=0, timeout_s=30) as ranks:
            gate = Gate(ranks)
            buffers = ranks.buffers(nvl_bytes)
            for routing in ROUTINGS:
                results["normal"] += measured(results, f"R={num_ranks} normal {routing}", ranks, normal_rows, ranks,
                                              buffers, gate, cfg, routing, sms)  # fmt: skip
            results["low_latency"] += measured(results, f"R={num_ranks} low latency", ranks, low_latency_rows, ranks,
                                               gate, cfg)  # fmt: skip
    print(
        f"GPU: {props.name} ({props.multi_processor_count} SMs); torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    print(f"T={cfg.tokens} H={cfg.hidden} E={cfg.experts} K={cfg.topk}; ranks as streams of one process; "
          f"{cfg.iters} calls per row after {cfg.warmup}")  # fmt: skip
    print_table(NORMAL_HEADERS, [normal_table_row(r) for r in results["normal"]],
                "bytes summed over the ranks (what the op must read + write); 'of copy' = the time of plain copies "
                "of the same bytes, all ranks at once, over the op's time")  # fmt: skip
    print()
    print(f"low latency: T={cfg.ll_tokens} H={cfg.hidden} E={cfg.ll_experts_per_rank}/rank K={cfg.topk}")
    print_table(LL_HEADERS, [[str(r["num_ranks"]), r["op"], f"{r['seconds'] * 1e6:.1f}",
                              f"{r['bytes'] / r['seconds'] / 1e9:.0f}"] for r in results["low_latency"]],
                "one call per rank behind a gate, all ranks at once: last rank's end - gate")  # fmt: skip
    for failure in results.get("failures", []):
        print(f"FAILED {failure}")
    save_results(args.json, results)
    if results.get("failures"):
        sys.exit(1)


if __name__ == "__main__":
    main()
