"""Peak memory of a piece of work: the CUDA caching allocator's peak on GPUs, the resident-set peak on CPU.

On CPU (Linux) the process's peak resident set (`VmHWM`) is reset through `/proc/self/clear_refs` before the
work and read after it. glibc is told once to serve every allocation of 64 KiB or more with its own mapping and to
return it on free (`mallopt`), so a freed tensor leaves the resident set at once and the peak is that of the live
tensors, not of allocator caching. The figure covers the whole process (other threads too): compare runs of the
same work in one process, as the tests and `bench/moe_recompute.py` do.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Callable

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 64 << 10


@functools.cache
def _exact_cpu_accounting() -> bool:
    """Make glibc map large allocations one by one (once per process); False if that is not possible here."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):
        return False


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024


def process_peak_bytes(device: torch.device | str = "cpu") -> int:
    """This process's memory high-water mark so far, in bytes: CUDA `max_memory_allocated`, CPU the resident-set
    peak (`VmHWM`, Linux)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type != "cpu":
        raise ValueError(f"process_peak_bytes: unsupported device {device}")
    return _status_bytes("VmHWM")


def peak_memory_bytes(work: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Runs `work()` and returns its peak memory above the memory in use when it started, in bytes.

    CUDA: `torch.cuda.max_memory_allocated` after a reset. CPU: the resident-set peak (Linux only; RuntimeError
    elsewhere). Tensors `work` returns are still counted in the peak.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        raise ValueError(f"peak_memory_bytes: unsupported device {device}")
    if not _exact_cpu_accounting():
        raise RuntimeError("peak_memory_bytes: glibc's mallopt is not available on this system")
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current resident set
    except OSError as error:
        raise RuntimeError(f"peak_memory_bytes: cannot reset the resident-set peak: {error}") from error
    start = _status_bytes("VmRSS")
    work()
    return _status_bytes("VmHWM") - start
