"""Bandwidth of mtdeepep's CUDA kernels as a fraction of a device-to-device copy of the same bytes, on one GPU
shared by 2 and 4 rank processes (data over CUDA IPC), and low-latency dispatch/combine latency.

Setting (upstream DeepEP's intranode test): 4096 tokens per rank, hidden 7168, top-8 of 256 experts, with uniform
routing (per token the top-8 of uniform random scores) and skewed routing (the scores multiplied by a factor that
falls from 4 to 1/4 across the experts, so the first rank's experts take most of the traffic), at several SM counts
(`Config.num_sms`; each rank's kernels use that many SMs, the ranks run at the same time on the one GPU).

Operations and the bytes that count (per rank, as upstream's test counts them: the bytes of the rows this rank
receives, `recv_x`, whose source rows are read once and written once):

- layout:        `get_dispatch_layout(topk_idx, 256)`; bytes: topk_idx read + the four outputs written.
- dispatch bf16: `dispatch(x, ..., num_worst_tokens=T * R)`; bytes: received rows x 2 H.
- dispatch fp8:  the same with x the pair (E4M3 `[T, H]`, float32 scales `[T, H / 128]`); bytes: rows x (H + H / 32).
- combine bf16:  `combine(recv_x, handle)` of that dispatch; bytes: the same received rows x 2 H (sent back and
  summed per token in FP32).
- ll fp8 cast:   `low_latency_dispatch(x, ..., use_fp8=True)` at 1024 tokens and 8 experts per rank: the sender's
  fused per-token E4M3 cast; bytes: per valid (token, expert) selection H + H / 32 (+ 16 header bytes, as upstream).
  Beside it, `per_token_cast_to_fp8` in plain PyTorch (the unfused alternative) as its own row.

The copy: every rank copies the same number of bytes from one device tensor to another (`Tensor.copy_`) at the same
time as the other ranks, so both sides see the same concurrency on the one GPU: fraction = copy time / kernel time
(= kernel bandwidth / copy bandwidth). GB/s counts each byte once (as upstream); the copy's GB/s the same way.

Timing, two ways, both in the table and the JSON:

- 'us': the operation is captured in a CUDA graph (normal mode with `num_worst_tokens` needs no host
  synchronisation, so it can be) and the graph replayed `--iters` times back to back between two CUDA events after a
  gloo barrier and `--warmup` replays; time per call = elapsed / iters. Where capture fails the eager call is timed
  the same way and the mode says 'eager' (then the host's launch overhead can be part of the time). Each captured
  operation is checked once against its eager result (same bytes) before timing; replays of the same inputs cannot
  show a replay that reads a peer's previous rows (tests/cuda's graph test replays new inputs for that).
- 'busy us': `--iters` eager calls under the profiler; the union of the intervals in which this rank's kernels ran,
  per call: the device time without the host's overhead (kernels waiting for a peer count their wait).

The slowest rank's row is reported.

Processes on one GPU: without NVIDIA's Multi-Process Service (MPS) the kernels of different processes do not run at
the same time (the GPU time-slices between their contexts), so a kernel that waits for a peer's writes waits for
the scheduler's slice, and the numbers measure that, not the kernel. With an MPS daemon running (scripts/gpu_check.sh
starts one with GPU_CHECK_MPS=1) the ranks' kernels share the SMs concurrently, as ranks on their own GPUs would run.
The JSON records which (`mps`); the SM counts are limited to those where R x SMs fit on the GPU.

Low latency (upstream's low-latency test): 128 tokens per rank, hidden 7168, top-8, 32 experts per rank;
dispatch bf16/fp8 and combine, eager, median over `--iters` calls timed with events after a barrier (latency).

Run on a machine with a GPU and mtdeepep's CUDA executor built (scripts/gpu_check.sh does both):

    python bench/cuda_kernels.py                        # table + bench/results/cuda_kernels.json
    python bench/cuda_kernels.py --num-ranks 2 --sms 8,24 --iters 50

Without a GPU or without the CUDA executor it prints why and exits with status 2.

Legend: T tokens per rank, H hidden, K top-k, E experts, R ranks.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    RESULTS_DIR,
    add_config_arguments,
    config_from_args,
    environment,
    make_parser,
    parse_int_list,
    print_table,
    random_routing,
    run_ranks,
    save_results,
)

import mtdeepep as deep_ep
from mtdeepep.utils.fp8 import per_token_cast_to_fp8
from mtdeepep.utils.testing import cuda_skip_reason

ROUTINGS = ("uniform", "skewed")


@dataclass
class BenchConfig:
    num_tokens: int = 4096
    hidden: int = 7168
    num_experts: int = 256
    num_topk: int = 8
    iters: int = 30
    warmup: int = 5
    nvl_bytes: int = 1 << 30
    ll_tokens: int = 128
    ll_experts_per_rank: int = 32
    cast_tokens: int = 1024
    cast_experts_per_rank: int = 8


CONFIG_HELP = {
    "num_tokens": "tokens per rank (normal mode)",
    "iters": "timed calls per operation",
    "warmup": "untimed calls per operation",
    "nvl_bytes": "num_nvl_bytes of each rank's buffer",
    "ll_tokens": "tokens per rank of the low-latency latency rows",
    "cast_tokens": "tokens per rank of the fused FP8 cast row",
}


# ---------------------------------------------------------------------------------------------------------------
# Inputs and timing


def make_routing(rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int, routing: str, seed: int):
    """This rank's host inputs (`_common.random_routing`, skewed for `routing == 'skewed'`)."""
    return random_routing(num_tokens, hidden, num_experts, num_topk, seed * 1000 + rank, skewed=routing == "skewed")


def timed_graph(fn: Callable[[], Any], iters: int, warmup: int, group) -> tuple[float, str, Any]:
    """Seconds per call of `fn` captured in a CUDA graph and replayed back to back (see the module docstring), or
    eager if capture fails: `(seconds, 'graph' | 'eager', the captured call's outputs)`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside capture, as torch.cuda.graphs requires
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    graph, mode, outputs = torch.cuda.CUDAGraph(), "graph", None
    try:
        with torch.cuda.graph(graph):
            outputs = fn()
    except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager timing, and is reported
        print(f"[rank {dist.get_rank(group)}] capture failed, timing eagerly: {type(error).__name__}: {error}")
        graph, mode = None, "eager"
        torch.cuda.synchronize()
    modes = [None] * group.size()
    dist.all_gather_object(modes, mode, group=group)
    if "eager" in modes:  # every rank times the same way (the captured call must be replayed by every rank)
        graph, mode = None, "eager"
    run = graph.replay if graph is not None else fn
    if graph is not None:
        run()  # materialise the captured outputs once
        torch.cuda.synchronize()
        dist.barrier(group=group)
    return events_time(run, iters, warmup, group), mode, outputs


def events_time(run: Callable[[], Any], iters: int, warmup: int, group) -> float:
    """Seconds per call of `run`, `iters` calls back to back between two CUDA events, after a barrier."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def busy_time(run: Callable[[], Any], iters: int, warmup: int, group) -> float:
    """Seconds per call that this process's kernels kept the GPU busy, from the profiler's kernel records of `iters`
    eager calls: the union of their [start, end) intervals (kernels overlapping on two streams count once), so the
    host's launch overhead between calls is left out. Kernels that wait for a peer count their waiting."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    intervals = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy_us, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            busy_us += end - max(start, reach)
            reach = end
    return busy_us / 1e6 / iters


def copy_time(num_bytes: int, iters: int, warmup: int, group) -> float:
    """Seconds per device-to-device copy of `num_bytes` (every rank copying at the same time)."""
    src = torch.randint(0, 255, (max(num_bytes, 1),), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return events_time(lambda: dst.copy_(src), iters, warmup, group)


def latency(run: Callable[[], Any], iters: int, warmup: int, group) -> float:
    """Median seconds of one call (events around it), every call after a barrier."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------------------------
# The rank's work


def normal_rows(buffer, cfg: BenchConfig, routing: str, num_sms: int, rank: int, group) -> list[dict[str, Any]]:
    """layout, dispatch bf16/fp8 and combine at one SM count: this rank's rows."""
    num_ranks = group.size()
    x, topk_idx, topk_weights = make_routing(rank, cfg.num_tokens, cfg.hidden, cfg.num_experts, cfg.num_topk,
                                             routing, seed=1)  # fmt: skip
    x, topk_idx, topk_weights = x.cuda(), topk_idx.cuda(), topk_weights.cuda()
    e4m3, scales = per_token_cast_to_fp8(x.float())
    worst = cfg.num_tokens * num_ranks
    dispatch_config = deep_ep.Config(num_sms, 6, 256, 6, 128)
    combine_config = deep_ep.Config(num_sms, 6, 256, 6, 128)
    layout = buffer.get_dispatch_layout(topk_idx, cfg.num_experts)[:4]
    per_rank, per_node, per_expert, in_rank = layout

    def dispatch(data):
        return buffer.dispatch(
            data, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=worst,
            config=dispatch_config,
        )  # fmt: skip

    eager = dispatch(x)
    recv_x, recv_idx, _, _, handle, _ = eager
    num_recv = int(handle[0][-1, rank].item())  # rank_prefix_matrix: rows received from every source
    torch.cuda.synchronize()
    rows = []

    def record(op: str, seconds: float, mode: str, num_bytes: int, eager: Callable[[], Any]):
        busy = busy_time(eager, cfg.iters, cfg.warmup, group)
        rows.append({"op": op, "routing": routing, "num_sms": num_sms, "mode": mode, "bytes": num_bytes,
                     "seconds": seconds, "busy_seconds": busy})  # fmt: skip

    layout_bytes = topk_idx.numel() * 8 + in_rank.numel() + (per_rank.numel() + per_expert.numel()) * 4

    def layout_call():
        return buffer.get_dispatch_layout(topk_idx, cfg.num_experts)[:4]

    seconds, mode, _ = timed_graph(layout_call, cfg.iters, cfg.warmup, group)
    record("layout", seconds, mode, layout_bytes, layout_call)

    seconds, mode, out = timed_graph(lambda: dispatch(x), cfg.iters, cfg.warmup, group)
    if out is not None:
        torch.cuda.synchronize()
        assert torch.equal(out[0][:num_recv], recv_x[:num_recv]), "captured bf16 dispatch differs from eager"
    record("dispatch bf16", seconds, mode, num_recv * cfg.hidden * 2, lambda: dispatch(x))

    seconds, mode, _ = timed_graph(lambda: dispatch((e4m3, scales)), cfg.iters, cfg.warmup, group)
    record(
        "dispatch fp8", seconds, mode, num_recv * (cfg.hidden + cfg.hidden // 128 * 4), lambda: dispatch((e4m3, scales))
    )

    def combine():
        return buffer.combine(recv_x, handle, config=combine_config)

    eager_combined = combine()[0]
    seconds, mode, out = timed_graph(combine, cfg.iters, cfg.warmup, group)
    if out is not None:
        torch.cuda.synchronize()
        assert torch.equal(out[0], eager_combined), "captured combine differs from eager"
    record("combine bf16", seconds, mode, num_recv * cfg.hidden * 2, combine)

    for row in rows:
        row["copy_seconds"] = copy_time(row["bytes"], cfg.iters, cfg.warmup, group)
    return rows


def fp8_cast_rows(cfg: BenchConfig, routing: str, rank: int, group) -> list[dict[str, Any]]:
    """The low-latency dispatch's fused FP8 cast at a throughput setting, and the plain-PyTorch cast."""
    num_ranks = group.size()
    num_experts = cfg.cast_experts_per_rank * num_ranks
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(cfg.cast_tokens, cfg.hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, explicitly_destroy=True)
    try:
        x, topk_idx, _ = make_routing(rank, cfg.cast_tokens, cfg.hidden, num_experts, cfg.num_topk, routing, seed=2)
        x, topk_idx = x.cuda(), topk_idx.cuda()
        selections = int((topk_idx >= 0).sum())
        row_bytes = cfg.hidden + cfg.hidden // 128 * 4 + 16

        def dispatch():
            return buffer.low_latency_dispatch(x, topk_idx, cfg.cast_tokens, num_experts, use_fp8=True)

        def cast():
            return per_token_cast_to_fp8(x.float())

        rows = [{"op": "ll dispatch fp8 (fused cast)", "routing": routing, "num_sms": None, "mode": "eager",
                 "bytes": selections * row_bytes, "seconds": latency(dispatch, cfg.iters, cfg.warmup, group),
                 "busy_seconds": busy_time(dispatch, cfg.iters, cfg.warmup, group)}]  # fmt: skip
        # The unfused alternative: the plain-PyTorch cast of this rank's tokens (reads 2H, writes H + H / 32 bytes).
        rows.append({"op": "torch per_token_cast_to_fp8", "routing": routing, "num_sms": None, "mode": "eager",
                     "bytes": cfg.cast_tokens * (cfg.hidden + cfg.hidden // 128 * 4),
                     "seconds": events_time(cast, cfg.iters, cfg.warmup, group),
                     "busy_seconds": busy_time(cast, cfg.iters, cfg.warmup, group)})  # fmt: skip
        for row in rows:
            row["copy_seconds"] = copy_time(row["bytes"], cfg.iters, cfg.warmup, group)
        return rows
    finally:
        buffer.destroy()


def ll_latency_rows(cfg: BenchConfig, rank: int, group) -> list[dict[str, Any]]:
    """Upstream's low-latency setting: dispatch bf16 / fp8 and combine latency (eager, median)."""
    num_ranks = group.size()
    num_experts = cfg.ll_experts_per_rank * num_ranks
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(cfg.ll_tokens, cfg.hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, explicitly_destroy=True)
    try:
        x, topk_idx, topk_weights = make_routing(rank, cfg.ll_tokens, cfg.hidden, num_experts, cfg.num_topk,
                                                 "uniform", seed=3)  # fmt: skip
        x, topk_idx, topk_weights = x.cuda(), topk_idx.cuda(), topk_weights.cuda()
        selections = int((topk_idx >= 0).sum())
        rows = []
        for use_fp8 in (False, True):

            def dispatch(use_fp8=use_fp8):
                return buffer.low_latency_dispatch(x, topk_idx, cfg.ll_tokens, num_experts, use_fp8=use_fp8)

            seconds = latency(dispatch, cfg.iters, cfg.warmup, group)
            row_bytes = cfg.hidden + cfg.hidden // 128 * 4 + 16 if use_fp8 else 2 * cfg.hidden + 16
            rows.append({"op": f"ll dispatch {'fp8' if use_fp8 else 'bf16'}", "bytes": selections * row_bytes,
                         "seconds": seconds})  # fmt: skip
        recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, cfg.ll_tokens, num_experts, use_fp8=False)
        y = recv.clone()

        def combine():
            return buffer.low_latency_combine(y, topk_idx, topk_weights, handle)

        seconds = latency(combine, cfg.iters, cfg.warmup, group)
        rows.append({"op": "ll combine bf16", "bytes": selections * 2 * cfg.hidden, "seconds": seconds})
        return rows
    finally:
        buffer.destroy()


def bench_rank(rank: int, world_size: int, group, cfg: BenchConfig, sms: list[int]) -> dict[str, Any]:
    # Every rank shares the one GPU; the control group is gloo, so the CUDA executor is chosen by MTDEEPEP_DEVICE.
    os.environ["MTDEEPEP_DEVICE"] = "cuda"
    torch.cuda.set_device(0)
    buffer = deep_ep.Buffer(group, cfg.nvl_bytes, explicitly_destroy=True)
    if buffer.device.type != "cuda":
        raise RuntimeError(f"the CUDA executor was not chosen: {buffer!r}")
    # The ranks' kernels run at once on the one GPU and wait for each other: together they must fit on it.
    sms = [n for n in sms if n * world_size <= torch.cuda.get_device_properties(0).multi_processor_count]
    try:
        normal = [row for routing in ROUTINGS for n in sms for row in normal_rows(buffer, cfg, routing, n, rank, group)]
    finally:
        buffer.destroy()
    cast = [row for routing in ROUTINGS for row in fp8_cast_rows(cfg, routing, rank, group)]
    return {"normal": normal + cast, "low_latency": ll_latency_rows(cfg, rank, group)}


# ---------------------------------------------------------------------------------------------------------------
# Report


def slowest(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Row by row, the rank with the largest time (and its bytes and copy time)."""
    out = []
    for rows in zip(*per_rank):
        rank = max(range(len(rows)), key=lambda r: rows[r]["seconds"])
        out.append({**rows[rank], "rank": rank})
    return out


NORMAL_HEADERS = ["R", "op", "routing", "SMs", "mode", "MB/rank", "us", "GB/s", "copy GB/s", "of copy", "busy us",
                  "of copy (busy)"]  # fmt: skip
LL_HEADERS = ["R", "op", "us", "GB/s"]


def normal_table_row(num_ranks: int, row: dict[str, Any]) -> list[str]:
    gbps = row["bytes"] / row["seconds"] / 1e9
    copy_gbps = row["bytes"] / row["copy_seconds"] / 1e9
    busy = row.get("busy_seconds")
    cells = [str(num_ranks), row["op"], row["routing"], str(row["num_sms"] or "-"), row["mode"],
             f"{row['bytes'] / 1e6:.1f}", f"{row['seconds'] * 1e6:.1f}", f"{gbps:.0f}", f"{copy_gbps:.0f}",
             f"{100 * row['copy_seconds'] / row['seconds']:.0f}%"]  # fmt: skip
    if busy:
        return cells + [f"{busy * 1e6:.1f}", f"{100 * row['copy_seconds'] / busy:.0f}%"]
    return cells + ["-", "-"]


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--num-ranks", default="2,4", help="comma-separated rank counts on the one GPU (default 2,4)")
    parser.add_argument("--sms", default="8,16,24,32", help="comma-separated SM counts per rank (default 8,16,24,32)")
    add_config_arguments(parser, BenchConfig(), helps=CONFIG_HELP)
    parser.add_argument("--timeout", type=float, default=500, help="seconds allowed per rank count")
    parser.add_argument("--json", default=str(RESULTS_DIR / "cuda_kernels.json"))
    args = parser.parse_args()
    reason = cuda_skip_reason()
    if reason is not None:
        print(f"bench/cuda_kernels.py needs a GPU and mtdeepep's CUDA executor: {reason}", file=sys.stderr)
        sys.exit(2)
    cfg = config_from_args(BenchConfig, args)
    sms = parse_int_list(args.sms)
    props = torch.cuda.get_device_properties(0)
    results: dict[str, Any] = {"config": asdict(cfg), "sms": sms, "environment": environment(),
                               "gpu": {"name": props.name, "multiprocessors": props.multi_processor_count,
                                       "memory_bytes": props.total_memory, "cuda": torch.version.cuda},
                               "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
                               "normal": {}, "low_latency": {}}  # fmt: skip
    normal_rows_out, ll_rows_out = [], []
    for num_ranks in parse_int_list(args.num_ranks):
        per_rank = run_ranks(bench_rank, num_ranks, (cfg, sms), timeout_s=args.timeout)
        normal = slowest([r["normal"] for r in per_rank])
        low_latency = slowest([r["low_latency"] for r in per_rank])
        results["normal"][num_ranks] = normal
        results["low_latency"][num_ranks] = low_latency
        normal_rows_out += [normal_table_row(num_ranks, row) for row in normal]
        ll_rows_out += [[str(num_ranks), row["op"], f"{row['seconds'] * 1e6:.1f}",
                         f"{row['bytes'] / row['seconds'] / 1e9:.0f}"] for row in low_latency]  # fmt: skip
    print(f"GPU: {props.name} ({props.multi_processor_count} SMs)", end="; ")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"T={cfg.num_tokens} H={cfg.hidden} E={cfg.num_experts} K={cfg.num_topk}; {cfg.iters} calls per row; "
          f"MPS {'on' if results['mps'] else 'off (kernels of different ranks time-sliced)'}")  # fmt: skip
    note = (
        "slowest rank; 'of copy' = copy time / time per call for the same bytes, all ranks copying at once; "
        "'busy' = the GPU time of the rank's kernels in eager calls (profiler), without the host's overhead"
    )
    print_table(NORMAL_HEADERS, normal_rows_out, note)
    print()
    print(f"low latency: T={cfg.ll_tokens} H={cfg.hidden} E={cfg.ll_experts_per_rank}/rank K={cfg.num_topk}")
    print_table(LL_HEADERS, ll_rows_out, "median of single calls (eager, events around each), slowest rank")
    save_results(args.json, results)


if __name__ == "__main__":
    main()
