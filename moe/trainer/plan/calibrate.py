"""Micro-benchmarks of this machine for the 'cpu' device spec (`plan.py --calibrate`): a few seconds in all.

    GEMM        a 1024 x 1024 x 1024 matmul in FP32 and BF16 on one thread, and the FP8 recipes' emulated GEMM
                (block-wise casts of both operands, then the dequantised FP32 product); the fastest of several runs
                (other work shares the cores: the fastest run is the least disturbed one)
    memory      a 256 MiB tensor copy on one thread (bytes read + written per second), and the filling of a newly
                allocated 64 MiB tensor (the first touch of fresh pages: page faults)
    gloo        between 2 processes of the project's launcher (mtdeepep.utils.testing.run_processes): a 16 MiB
                all-reduce (bus bandwidth 2 (n-1)/n x bytes / time), a 16 MiB all-to-all, and a 4-byte
                all-reduce (the latency)
    runtime     the resident set of a fresh process that imported the library modules train.py imports
                (`TRAIN_PY_MODULES`) and joined a gloo group

Single-threaded, as the 'cpu' spec's ranks run (moe/trainer/plan/devices.py); the machine's rates are the one-thread
rates times the cores. Each figure replaces the built-in 'cpu' spec's, with "calibrated <date>" as its source. The
machine is shared with other work: rates measured while it is busy are what a rank gets then, not the cores' peak.
"""

from __future__ import annotations

import importlib
import re
import time

import torch
import torch.distributed as dist

from moe.layer.fp8.cast import cast_blockwise
from moe.layer.fp8.gemm import scaled_matmul
from moe.trainer.plan.devices import CPU, DeviceSpec
from mtdeepep.utils.testing import num_cores, run_processes

ALLREDUCE_BYTES = 16 << 20

# The library modules the run assembly (moe/trainer/run.py, what examples/deepseek_v3/train.py runs) imports
# (tests/plan/test_calibrate.py keeps this list in step with it): the runtime baseline is a process that loaded what
# a training rank loads, without running it.
TRAIN_PY_MODULES = (
    "moe",
    "moe.layer.fp8.convert",
    "moe.trainer.io.atomic",
    "moe.trainer.models.deepseek_v3",
    "moe.trainer.models.deepseek_v3.model_dir",
    "moe.trainer.models.deepseek_v3.tensor_parallel",
    "moe.trainer.models.deepseek_v3.flops",
    "moe.trainer.models.deepseek_v3.compile",
    "moe.trainer.pipeline",
    "moe.trainer.plan.peak",
    "moe.trainer.train.checkpoint",
    "moe.trainer.train.job_config",
    "moe.trainer.data.source",
    "moe.trainer.data.run_data",
    "moe.trainer.train.faults",
    "moe.trainer.train.metrics",
    "moe.trainer.train.parallel_state",
    "moe.trainer.train.rewind",
    "moe.trainer.train.trainer",
)


def _best_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_tflops(dtype: torch.dtype, n: int = 1024) -> float:
    """TFLOP/s of an n^3 matmul in `dtype` with torch's current threads."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b) / 1e12


def fp8_emulated_tflops(n: int = 512) -> float:
    """TFLOP/s (of the GEMM's 2 n^3) of the FP8 recipes' emulated block-wise GEMM, casts included."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, n, generator=gen, dtype=torch.bfloat16)

    def run():
        return scaled_matmul(cast_blockwise(x, (1, 128)), cast_blockwise(w, (128, 128)).t())

    return 2 * n**3 / _best_seconds(run, repeats=3) / 1e12


def copy_gbps(nbytes: int = 256 << 20) -> float:
    """GB/s of a tensor copy, bytes read + written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats=3) / 1e9


def fresh_gbps(nbytes: int = 64 << 20) -> float:
    """GB/s of filling a newly allocated tensor (page faults: the first touch of fresh mappings)."""
    return nbytes / _best_seconds(lambda: torch.empty(nbytes // 4).fill_(1.0), repeats=3) / 1e9


def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


def _gloo_worker(proc) -> dict:
    """One of 2 processes: the runtime baseline, then gloo all-reduce / all-to-all timings."""
    torch.set_num_threads(1)
    for name in TRAIN_PY_MODULES:  # what a training rank loads
        importlib.import_module(name)
    group = proc.init_group(timeout_s=60)
    baseline = _rss_mib("VmHWM")
    big = torch.ones(ALLREDUCE_BYTES // 4)
    out = torch.empty_like(big)
    small = torch.ones(1)

    def timed(fn, repeats=5):
        dist.barrier(group)
        return _best_seconds(fn, repeats=repeats)

    t_ar = timed(lambda: dist.all_reduce(big, group=group))
    t_a2a = timed(lambda: dist.all_to_all_single(out, big, group=group))
    t_lat = timed(lambda: dist.all_reduce(small, group=group), repeats=20)
    dist.destroy_process_group()
    return {"baseline_mib": baseline, "all_reduce_s": t_ar, "all_to_all_s": t_a2a, "latency_s": t_lat}


def measure(timeout_s: float = 180.0) -> dict[str, float]:
    """The raw measurements (see the module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cores = num_cores()
    try:
        out = {
            "float32_tflops": cores * gemm_tflops(torch.float32),
            "bfloat16_tflops": cores * gemm_tflops(torch.bfloat16),
            "fp8_tflops": cores * fp8_emulated_tflops(),
            "copy_gbps": cores * copy_gbps(),
            "fresh_gbps": fresh_gbps(),  # machine-wide: two processes get half each (devices.py)
        }
    finally:
        torch.set_num_threads(threads)
    results = run_processes(_gloo_worker, 2, (), timeout_s=timeout_s)
    ranks = [results.values[r][-1] for r in range(2)]
    n = 2
    t_ar = max(r["all_reduce_s"] for r in ranks)
    out.update(
        allreduce_bus_gbps=2 * (n - 1) / n * ALLREDUCE_BYTES / t_ar / 1e9,
        all_to_all_gbps=(n - 1) / n * ALLREDUCE_BYTES / max(r["all_to_all_s"] for r in ranks) / 1e9,
        latency_us=max(r["latency_s"] for r in ranks) * 1e6,
        runtime_gib=max(r["baseline_mib"] for r in ranks) / 1024,
        cores=num_cores(),
    )
    return out


def calibrated_cpu_spec(measured: dict[str, float] | None = None) -> DeviceSpec:
    """The 'cpu' spec with the figures measured now (or given)."""
    m = measure() if measured is None else measured
    when = time.strftime("%Y-%m-%d %H:%M")
    src = f"calibrated here {when} (moe/trainer/plan/calibrate.py)"
    sources = dict(CPU.sources)
    for key, what in (
        ("tflops.float32", "1024^3 FP32 matmul, one thread x cores"),
        ("tflops.bfloat16", "1024^3 BF16 matmul, one thread x cores"),
        ("tflops.fp8", "emulated block-wise FP8 GEMM, casts included, one thread x cores"),
        ("memory_gbps", "256 MiB copy, read + write, one thread x cores"),
        ("ep_intra_node_gbps", "half the one-thread copy rate (mtdeepep copies through shared memory)"),
        ("fresh_memory_gbps", "filling a newly allocated 64 MiB tensor (page faults), one process (machine-wide)"),
        ("intra_node_gbps", "gloo 16 MiB all-reduce bus bandwidth, 2 processes"),
        ("comm_latency_us", "gloo 4-byte all-reduce"),
        ("runtime_gib", "resident set after importing train.py's modules and joining gloo"),
    ):
        sources[key] = f"{src}: {what}"
    return CPU.replace(
        tflops={"float32": m["float32_tflops"], "bfloat16": m["bfloat16_tflops"], "fp8": m["fp8_tflops"]},
        memory_gbps=m["copy_gbps"],
        intra_node_gbps=m["allreduce_bus_gbps"],
        inter_node_gbps=m["allreduce_bus_gbps"],
        comm_latency_us=m["latency_us"],
        ep_intra_node_gbps=m["copy_gbps"] / m["cores"] / 2,
        fresh_memory_gbps=m["fresh_gbps"],
        runtime_gib=m["runtime_gib"],
        shared_cores=int(m["cores"]),
        sources=sources,
    )
