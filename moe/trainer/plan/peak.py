"""The peak FLOP/s of the device one rank trains on: the denominator of MFU (model FLOPs utilisation).

The rate is that of the GEMMs' dtype: the training dtype ('float32', 'bfloat16'), or 'fp8' under an FP8 recipe (as
the planner's `Estimate.mfu`, moe/trainer/plan/search.py).
- An accelerator (cuda, musa): the dense rate in the built-in spec whose model name the device reports
  (moe/trainer/plan/devices.py: B200, H100, H200, H800, MTT S4000, MTT S5000), from the vendor's datasheet; None for a
  device without a spec or without the dtype's rate (no MFU then).
- The CPU: measured once per process and setting, with this process's intra-op threads (moe/trainer/plan/calibrate.py,
  the measurements behind the 'cpu' spec): a 1024^3 matmul in the dtype, the fastest of 5 runs after a warm-up (~0.1-0.2
  s on one core here), or for 'fp8' the recipes' emulated GEMM (casts + FP32 matmul). Not the 'cpu' spec's figure:
  the machine is shared, and what a process gets changes with the load.

`agreed_peak` takes one figure for the whole run: rank 0's, broadcast (the other ranks wait in the broadcast, so
rank 0 measures on a core they leave alone), so every rank reports the same MFU.

MFU = model FLOPs per token x tokens/s / (peak per rank x ranks) (moe/trainer/train/metrics.py `mfu`): the peak is one
rank's (one process with its threads, or one device) and every rank of the run shares the work of a step. On a CPU
shared by more single-threaded ranks than it has cores (scripts/train.sh: 4 ranks on 2 cores) the ranks cannot all run
at the one-process peak at once, so such a run's MFU is at most cores / ranks (0.5 there); train.py records that bound
in run.json ("max_mfu"). The planner's `Estimate.mfu` divides by what the ranks can share instead (its 'cpu' spec
gives a rank `DeviceSpec.share` of the machine), so on such a CPU its figure is ranks / cores times larger. The CPU
peak is one measurement under the load of the moment: on a machine shared with other work it varies from run to run
(41-57 GFLOP/s on one core here), and the MFU with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.trainer.plan.calibrate import fp8_emulated_tflops, gemm_tflops
from moe.trainer.plan.devices import B200, H100, H200, H800, MTT_S4000, MTT_S5000, RATE_DTYPES, DeviceSpec

# Device-name fragment (as the runtime reports it, e.g. "NVIDIA H100 80GB HBM3") -> spec.
NAMED_SPECS: dict[str, DeviceSpec] = {
    "B200": B200, "H100": H100, "H200": H200, "H800": H800, "S4000": MTT_S4000, "S5000": MTT_S5000,
}  # fmt: skip
CPU_MATMUL_SIZE = 1024


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one rank and where the figure comes from."""

    flops_per_s: float
    source: str

    def to_dict(self) -> dict:
        return {"flops_per_s": self.flops_per_s, "source": self.source}


@functools.cache
def measured_cpu_peak(dtype: str, threads: int) -> Peak:
    """The CPU GEMM rate of this process in `dtype` with `threads` intra-op threads (the cache key: measured once
    per process and setting)."""
    if dtype == "fp8":
        return Peak(fp8_emulated_tflops() * 1e12, f"measured: emulated block-wise FP8 GEMM, {threads} thread(s)")
    rate = gemm_tflops(getattr(torch, dtype), CPU_MATMUL_SIZE) * 1e12
    return Peak(rate, f"measured: {CPU_MATMUL_SIZE}^3 {dtype} matmul, {threads} thread(s), fastest of 5 runs")


def device_peak(device: torch.device | str, dtype: str) -> Peak | None:
    """The peak FLOP/s of `device` for GEMMs in `dtype` (one of `RATE_DTYPES`), None for an accelerator without
    a spec or a rate (see the module docstring)."""
    device = torch.device(device)
    if dtype not in RATE_DTYPES:
        raise ValueError(f"dtype must be one of {RATE_DTYPES}, got {dtype!r}")
    if device.type == "cpu":
        return measured_cpu_peak(dtype, torch.get_num_threads())
    runtime = getattr(torch, device.type, None)
    name = runtime.get_device_name(device) if runtime is not None and hasattr(runtime, "get_device_name") else ""
    for fragment, spec in NAMED_SPECS.items():
        if fragment in name.upper():
            rate = spec.tflops.get(dtype)
            if rate is None:
                return None
            return Peak(rate * 1e12, f"{spec.name} spec (moe/trainer/plan/devices.py): {rate:g} TFLOP/s dense {dtype}")
    return None


def agreed_peak(device: torch.device | str, dtype: str) -> Peak | None:
    """`device_peak` of rank 0 on every rank of the default process group (collective when one is initialised;
    a single process measures its own). None on every rank when rank 0's device has no spec."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return device_peak(device, dtype)
    dist.barrier()  # the others are idle in the broadcast while rank 0 measures
    box = [device_peak(device, dtype) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
