"""What every GPU test shares: the skip mark, the device, CUDA buffers, copies to the host for the references.

2 to 4 rank processes share the one GPU (device 0): control over gloo on 127.0.0.1, data over CUDA IPC peer memory (NCCL
refuses two ranks on one GPU). The same cases also run with the ranks as threads of one process
(`mtdeepep.utils.local_ranks`: peer pointers instead of IPC, each rank its own stream, the kernels truly concurrent): a
case reaches its ranks' buffers through `new_buffer(ctx)` and their collectives through the conformance helpers'
`barrier(ctx)` and `gather(ctx)`, which serve both. The cases both executors share are the conformance cases, run with
the GPU placement (tests/conformance/placement.py), which keeps its tensors and buffers through this module. Every GPU
test skips, with one reason, where there is no CUDA device; on a CUDA build of torch a missing executor is a failure,
not a skip (`mtdeepep.utils.testing.cuda_skip_reason`); the MoE layer's single-process GPU tests need only the device.

References stay on the host: results are copied to the CPU and compared with the plain-PyTorch references of
`mtdeepep.utils.refs` and the conformance helpers, the same ones the CPU executor is tested against, so the CPU executor
and the CUDA executor are held to one definition.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import mtdeepep as deep_ep
from mtdeepep.utils.local_ranks import current_context
from mtdeepep.utils.testing import cuda_skip_reason

from ..reliability_cases import named_missing_ranks

TIMEOUT_S = 30  # mtdeepep's own timeout in the ranks (MTDEEPEP_TIMEOUT_S)
DEVICE_INDEX = 0  # every rank shares this GPU

# True inside `run_on_cpu`: the cases run on the CPU executor (tests/cuda/test_cases_on_cpu.py).
_on_cpu = False


def run_on_cpu(ctx, case, *args):
    """Runs the GPU case `case(ctx, *args)` in a rank of a CPU pool with the CPU executor standing in for the GPU
    (device moves are no-ops, synchronisations return at once). The CPU executor is tested on its own, so this checks
    the cases and their references where CI can run them: on a GPU, a failure of the same case is the GPU's."""
    global _on_cpu
    _on_cpu = True
    try:
        return case(ctx, *args)
    finally:
        _on_cpu = False


def skip_unless_cuda(need_executor: bool = True) -> list[pytest.MarkDecorator]:
    """A module's marks: skip with the one reason `cuda_skip_reason` gives (no device), and `gpu_required`: on a
    machine with a GPU such a test must run (conftest.py fails it when it skips, or when it needs the executor and
    `mtdeepep._C_cuda` does not import)."""
    reason = cuda_skip_reason(need_executor)
    return [pytest.mark.skipif(reason is not None, reason=reason or ""), pytest.mark.gpu_required(need_executor)]


def device() -> torch.device:
    """GPU 0, made this process's current device, with the CUDA executor chosen for the buffers this process
    creates: the control group is gloo (NCCL refuses two ranks on one GPU), and mtdeepep picks the executor from
    `MTDEEPEP_DEVICE` when set, else from the group's backend (gloo: CPU)."""
    if _on_cpu:
        os.environ["MTDEEPEP_DEVICE"] = "cpu"
        return torch.device("cpu")
    os.environ["MTDEEPEP_DEVICE"] = "cuda"
    torch.cuda.set_device(DEVICE_INDEX)
    return torch.device("cuda", DEVICE_INDEX)


def synchronize() -> None:
    """Waits for the GPU's work (returns at once on the CPU executor). A rank thread of one process waits for its own
    stream only: the other ranks' queued kernels may be waiting for this rank's next call."""
    if _on_cpu:
        return
    if current_context() is not None:
        torch.cuda.current_stream().synchronize()
    else:
        torch.cuda.synchronize()


def sleep_on_stream(cycles: int) -> None:
    """Keeps the current stream busy for about `cycles` GPU clock cycles (nothing on the CPU executor)."""
    if not _on_cpu:
        torch.cuda._sleep(cycles)


def check_cuda_buffer(buffer):
    """`buffer` (a `Buffer` or an `ElasticBuffer`) runs on the CUDA executor; fails clearly if the CPU executor was
    chosen instead. Returns it."""
    expected = "cpu" if _on_cpu else "cuda"
    assert buffer.device.type == expected, f"the {expected} executor was not chosen: {buffer!r}"
    return buffer


def new_buffer(ctx, num_nvl_bytes: int = 256 << 20, **kwargs) -> deep_ep.Buffer:
    """A CUDA `Buffer` over the group of `ctx` (a pool's `RankContext`, or anything with `group`)."""
    device()
    if hasattr(ctx, "new_buffer"):  # ranks as threads of one process: every rank creates it together
        return check_cuda_buffer(ctx.new_buffer(num_nvl_bytes, **kwargs))
    return check_cuda_buffer(deep_ep.Buffer(ctx.group, num_nvl_bytes, **kwargs))


def cuda(*tensors: torch.Tensor | None):
    """The tensors on GPU 0 (None stays None); one tensor in, one out."""
    dev = device()
    out = tuple(None if t is None else t.to(dev) for t in tensors)
    return out[0] if len(out) == 1 else out


def host(value):
    """`value` with every tensor copied to the CPU (strides kept), through tuples and lists (a handle becomes a
    plain tuple). Synchronises with the current stream, as any read of results on the host does."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, (tuple, list)):
        return tuple(host(v) if isinstance(v, (torch.Tensor, tuple, list)) else v for v in value)
    return value


def assert_on_gpu(*tensors: torch.Tensor | None) -> None:
    """Every result lives on the buffer's GPU (None allowed)."""
    expected = torch.device("cpu") if _on_cpu else torch.device("cuda", DEVICE_INDEX)
    for t in tensors:
        assert t is None or t.device == expected, f"result on {t.device}, not {expected}"


def rank_ids(num_ranks: int) -> str:
    """Test ids of rank counts: `R2`, `R4` (scripts/gpu_check.sh selects its stages by them)."""
    return f"R{num_ranks}"


def named_ranks(message: str) -> list[int]:
    """The ranks an error message names as missing: the CPU executor's timeouts (`rank(s) [1] did not arrive`, see
    `named_missing_ranks`), the CUDA executor's (`ranks that did not arrive: [1]`), or a dead peer
    (`rank 1 (pid 123, host h) exited without arriving`). Empty if it names none."""
    named = named_missing_ranks(message)
    if named:
        return named
    listed = re.search(r"did not arrive: \[([0-9, ]+)\]", message)
    if listed:
        return [int(r) for r in listed.group(1).split(",")]
    return [int(r) for r in re.findall(r"rank (\d+) \(pid \d+[^)]*\) exited", message)]
