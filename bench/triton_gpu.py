"""The Triton executor on a GPU against a device-to-device copy of the same bytes, measured in the same run (issue 34,
point 5).

Setting (DeepEP's): 4096 tokens per rank, hidden 7168, top-8 of 256 experts, routing uniform (per token the top-8 of
random scores) or skewed (scores biased toward the low expert ids: the busiest rank receives about twice its share).
The ranks are processes sharing the one GPU through CUDA IPC (`MTDEEPEP_ENGINE=triton`, `MTDEEPEP_DEVICE=cuda`, a gloo
control group), as the one-GPU machine allows. Per routing, the medians over `--iters` calls of:

- `layout`: `get_dispatch_layout`; the copy of the same bytes: `topk_idx`;
- `dispatch_bf16` / `dispatch_fp8`: `dispatch` of x bfloat16 / of `(e4m3, scales)`; bytes: what this rank received;
- `combine`: `combine(recv_x, handle, topk_weights)`; bytes: the bf16 rows it sends back;
- `cast`: `mtdeepep.kernels.fp8.per_token_cast_to_fp8(x)`; bytes: x;
- `ll_dispatch` / `ll_combine`: low-latency FP8 dispatch and its combine at `--ll-tokens` tokens, in microseconds.

`fraction` = copy time / operation time for the same bytes (1.0: as fast as a copy; the issue's target 0.7, goal
0.9). Timing: a gloo barrier, then the call between `torch.cuda.synchronize()`s (`perf_counter`); the slowest rank
counts, against the busiest rank's bytes. The copy runs in the same process right after, `dst.copy_(src)` of a byte
tensor of that size.

Run on the GPU machine (scripts/gpu_check.sh's `measure` stage):

    python bench/triton_gpu.py --json $OUT/triton_gpu.json

`--device cpu` runs the same code on CPU tensors under Triton's interpreter at the shapes given (a plumbing check:
use small shapes, e.g. `--tokens 64 --hidden 256 --experts 8 --topk 2 --ll-tokens 8 --iters 1`).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import BenchConfig, config_from_args, config_parser


@dataclass(frozen=True)
class Config(BenchConfig):
    ranks: int = 2
    experts: int = 256
    ll_tokens: int = 128
    device: str = "cuda"
    timeout_s: float = 60.0
    profile_iters: int = 0  # > 0: after the measurement, torch.profiler over this many uniform dispatch + combine calls


def routing(cfg: Config, rank: int, skewed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank + (7 if skewed else 0))
    scores = torch.rand(cfg.tokens, cfg.experts, generator=generator)
    if skewed:
        scores = scores + 0.5 * torch.linspace(1.0, 0.0, cfg.experts)
    weights, topk_idx = scores.topk(cfg.topk, dim=1)
    return topk_idx.to(device), (weights / weights.sum(1, keepdim=True)).float().to(device)


def nbytes(value) -> int:
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value if v is not None)
    return value.numel() * value.element_size()


class Timer:
    def __init__(self, cfg: Config, device: torch.device, group: dist.ProcessGroup) -> None:
        self.cfg, self.device, self.group = cfg, device, group

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)

    def seconds(self, fn) -> tuple[float, object]:
        """The median seconds of `fn()` over the iterations (after the warm-up), every rank starting together."""
        samples, result = [], None
        for i in range(self.cfg.warmup + self.cfg.iters):
            dist.barrier(group=self.group)
            self.sync()
            begin = time.perf_counter()
            result = fn()
            self.sync()
            if i >= self.cfg.warmup:
                samples.append(time.perf_counter() - begin)
        return statistics.median(samples), result

    def copy_seconds(self, num_bytes: int) -> float:
        src = torch.empty(max(num_bytes, 1), dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        return self.seconds(lambda: dst.copy_(src))[0]


def measure_routing(buffer, timer: Timer, cfg: Config, x, topk_idx, topk_weights, name: str) -> list[tuple]:
    """(op, routing, seconds, bytes) of every operation under one routing (bytes 0: timed in microseconds only)."""
    from mtdeepep.kernels.fp8 import per_token_cast_to_fp8

    rows = []
    t, layout = timer.seconds(lambda: buffer.get_dispatch_layout(topk_idx, cfg.experts))
    rows.append(("layout", name, t, nbytes(topk_idx)))
    per_rank, _, per_expert, in_rank, _ = layout

    def dispatch(data):
        return buffer.dispatch(
            data, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights,
        )  # fmt: skip

    t, out = timer.seconds(lambda: dispatch(x))
    recv_x, _, recv_weights, _, handle, _ = out
    rows.append(("dispatch_bf16", name, t, nbytes(recv_x)))
    fp8 = per_token_cast_to_fp8(x)
    t, out8 = timer.seconds(lambda: dispatch(fp8))
    rows.append(("dispatch_fp8", name, t, nbytes(out8[0])))
    t, _ = timer.seconds(lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights))
    rows.append(("combine", name, t, nbytes(recv_x)))
    t, _ = timer.seconds(lambda: per_token_cast_to_fp8(x))
    rows.append(("cast", name, t, nbytes(x)))
    ll_x, ll_idx, ll_w = x[: cfg.ll_tokens], topk_idx[: cfg.ll_tokens], topk_weights[: cfg.ll_tokens]
    t, ll = timer.seconds(lambda: buffer.low_latency_dispatch(ll_x, ll_idx, cfg.ll_tokens, cfg.experts))
    rows.append(("ll_dispatch", name, t, 0))
    ll_recv, _, ll_handle, _, _ = ll
    # The combine's input: the received rows as bfloat16 (the values do not matter to the timing).
    y = ll_recv[0].float().to(torch.bfloat16) if isinstance(ll_recv, tuple) else ll_recv
    t, _ = timer.seconds(lambda: buffer.low_latency_combine(y, ll_idx, ll_w, ll_handle))
    rows.append(("ll_combine", name, t, 0))
    return rows


def profile_tables(buffer, timer: Timer, cfg: Config, x, topk_idx, topk_weights) -> str:
    """torch.profiler over `cfg.profile_iters` dispatch + combine calls (after one untimed call): where the time goes,
    as two tables, by device time and by host time (launches, host synchronisations, the Python around them)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, cfg.experts)

    def step():
        with record_function("dispatch"):
            recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights,
            )  # fmt: skip
        with record_function("combine"):
            buffer.combine(recv_x, handle, topk_weights=recv_w)

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if timer.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(cfg.profile_iters):
            dist.barrier(group=timer.group)
            step()
            timer.sync()
    events = prof.key_averages()
    device_key = "cuda_time_total" if timer.device.type == "cuda" else "cpu_time_total"
    return "\n".join([
        f"# {cfg.profile_iters} x (dispatch + combine), uniform routing, by device time",
        events.table(sort_by=device_key, row_limit=25, max_name_column_width=60),
        "# by host time",
        events.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60),
    ])  # fmt: skip


def bench_rank(rank: int, cfg: Config, port: int, results: dict, profiles: dict) -> None:
    os.environ.update(MTDEEPEP_ENGINE="triton", MTDEEPEP_DEVICE=cfg.device)
    if cfg.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.ranks)
    import mtdeepep

    device = torch.device("cpu") if cfg.device == "cpu" else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = dist.group.WORLD
    R, T, H = cfg.ranks, cfg.tokens, cfg.hidden
    row_bytes = 2 * H + 16 * cfg.topk + 64  # a bf16 row and its top-k fields, rounded up
    num_nvl_bytes = 2 * R * T * row_bytes + (64 << 20)
    num_rdma_bytes = mtdeepep.Buffer.get_low_latency_rdma_size_hint(cfg.ll_tokens, H, R, cfg.experts)
    buffer = mtdeepep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                             num_qps_per_rank=max(1, cfg.experts // R), explicitly_destroy=True)  # fmt: skip
    timer = Timer(cfg, device, group)
    rows = []
    try:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(device, torch.bfloat16)
        for skewed in (False, True):
            topk_idx, topk_weights = routing(cfg, rank, skewed, device)
            rows += measure_routing(buffer, timer, cfg, x, topk_idx, topk_weights, "skewed" if skewed else "uniform")
        measured = []
        for op, name, seconds, num_bytes in rows:
            copy = timer.copy_seconds(num_bytes) if num_bytes else None
            measured.append({"op": op, "routing": name, "seconds": seconds, "bytes": num_bytes, "copy_seconds": copy})
        results[rank] = measured
        if cfg.profile_iters > 0:
            topk_idx, topk_weights = routing(cfg, rank, False, device)
            profiles[rank] = profile_tables(buffer, timer, cfg, x, topk_idx, topk_weights)
    finally:
        buffer.destroy()
        dist.destroy_process_group()


def summarize(per_rank: dict[int, list[dict]]) -> list[dict]:
    """Per (op, routing): the slowest rank's time against the busiest rank's bytes and its copy of them (under skewed
    routing a rank that receives little can be the slowest, waiting for the others: its own bytes would understate
    what the call moved), and the fraction of that copy."""
    out = []
    for i, row in enumerate(per_rank[0]):
        entries = [per_rank[r][i] for r in per_rank]
        seconds = max(m["seconds"] for m in entries)
        busiest = max(entries, key=lambda m: m["bytes"])
        entry = {"op": row["op"], "routing": row["routing"], "seconds": seconds, "bytes": busiest["bytes"]}
        if busiest["copy_seconds"]:
            entry["copy_seconds"] = busiest["copy_seconds"]
            entry["fraction_of_copy"] = busiest["copy_seconds"] / seconds
        else:
            entry["microseconds"] = 1e6 * seconds
        out.append(entry)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set by scripts/gpu_check.sh when it started the MPS daemon: the ranks' kernels then run concurrently, not in the
# GPU's time slices per process (which a spinning wait for a peer costs whole).
MPS = os.environ.get("MTDEEPEP_BENCH_MPS") == "1"


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(__doc__, Config())
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile-out", type=Path, default=None, help="where the profile tables go (a text file)")
    args = parser.parse_args(argv)
    cfg = config_from_args(Config, args)
    with mp.Manager() as manager:
        results, profiles = manager.dict(), manager.dict()
        mp.spawn(bench_rank, args=(cfg, free_port(), results, profiles), nprocs=cfg.ranks, join=True)
        per_rank, per_rank_profiles = dict(results), dict(profiles)
    rows = summarize(per_rank)
    for row in rows:
        figure = (f"{row['fraction_of_copy']:.2f} of a copy" if "fraction_of_copy" in row
                  else f"{row['microseconds']:.1f} us")  # fmt: skip
        print(f"{row['op']:14s} {row['routing']:8s} {1e6 * row['seconds']:10.1f} us  {row['bytes']:>12d} B  {figure}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": asdict(cfg), "mps": MPS, "rows": rows}, indent=1))
    if per_rank_profiles:
        text = "\n\n".join(f"## rank {r}\n{per_rank_profiles[r]}" for r in sorted(per_rank_profiles))
        if args.profile_out is not None:
            args.profile_out.parent.mkdir(parents=True, exist_ok=True)
            args.profile_out.write_text(text)
        else:
            print(text)
    print(f"ranks as processes {'under MPS' if MPS else 'time-sliced (no MPS)'}; every step passed ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
