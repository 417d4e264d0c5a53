"""Where a case's ranks keep their tensors and buffers: the CPU executor, or the CUDA executor on GPU 0.

A conformance case builds its inputs and its references on the host, moves the inputs to its topology's placement
(`to`), runs the buffer there and copies the results back (`host`) to compare them: the CPU executor and the CUDA
executor are held to one definition, by one case. The CUDA placement serves the GPU tests of tests/cuda, whose
ranks are processes sharing GPU 0 or threads of one process (`mtdeepep.utils.local_ranks`); its buffers and
synchronisations go through tests/cuda/gpu.py (which also lets the GPU tests run on the CPU executor, `run_on_cpu`).
On the CPU placement every move is the identity and every synchronisation returns at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import mtdeepep as deep_ep


def _gpu():
    """tests/cuda/gpu.py, imported when a CUDA placement first needs it (gpu.py imports tests/reliability_cases.py,
    which imports the topologies: a module-level import would be a cycle)."""
    from ..cuda import gpu

    return gpu


@dataclass(frozen=True)
class Placement:
    """Where a case's tensors and buffers live; pickled into the rank processes with the case's topology."""

    device: str  # "cpu" or "cuda"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    def __str__(self) -> str:
        return self.device

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def default_nvl_bytes(self) -> int:
        """The receive region of a case's default buffer: the CUDA executor moves an operation in one round, so its
        region holds the largest operation of the GPU cases (4 ranks x ~1000 rows of 16 KB)."""
        return (256 if self.on_gpu else 64) << 20

    @property
    def timeout_slack_s(self) -> float:
        """How late after its timeout a wait may end: the CUDA executor's host notices a device-side timeout when it
        next polls the status word (the CPU executor's waits end on their own deadline)."""
        return 1.0 if self.on_gpu else 0.0

    def make_current(self) -> None:
        """Buffers that a client makes itself (e.g. torchtitan's `get_buffer`) then take this placement: on a GPU, GPU
        0 is current and the CUDA executor chosen (the CPU executor is the default of a gloo group)."""
        if self.on_gpu:
            _gpu().device()

    def check_buffer(self, buffer):
        """`buffer` (a `Buffer` or an `ElasticBuffer`) runs on this placement's executor. Returns it."""
        if self.on_gpu:
            return _gpu().check_cuda_buffer(buffer)
        assert buffer.device.type == "cpu", f"the CPU executor was not chosen: {buffer!r}"
        return buffer

    def new_buffer(self, ctx, num_nvl_bytes: int, **kwargs) -> deep_ep.Buffer:
        """A `Buffer` over the ranks of `ctx` (every rank calls it together)."""
        if self.on_gpu:
            return _gpu().new_buffer(ctx, num_nvl_bytes, **kwargs)
        return deep_ep.Buffer(ctx.group, num_nvl_bytes, **kwargs)

    def to(self, *tensors: torch.Tensor | None):
        """The host tensors on this placement's device (None stays None); one tensor in, one out."""
        if self.on_gpu:
            return _gpu().cuda(*tensors)
        return tensors[0] if len(tensors) == 1 else tensors

    def host(self, value):
        """`value` with its tensors on the host (through tuples and lists), after the device's work that made them."""
        return _gpu().host(value) if self.on_gpu else value

    def assert_on_device(self, *tensors: torch.Tensor | None) -> None:
        """Every result lives on this placement's device (None allowed)."""
        if self.on_gpu:
            _gpu().assert_on_gpu(*tensors)
            return
        for t in tensors:
            assert t is None or t.device.type == "cpu", f"result on {t.device}, not the CPU"

    def synchronize(self) -> None:
        """Waits for this rank's device work (nothing to wait for on the CPU: every call has finished)."""
        if self.on_gpu:
            _gpu().synchronize()

    def busy_stream(self, cycles: int) -> None:
        """Keeps the current stream busy for about `cycles` GPU clock cycles (the CPU has no stream to keep busy)."""
        if self.on_gpu:
            _gpu().sleep_on_stream(cycles)


CPU = Placement("cpu")
CUDA = Placement("cuda")
