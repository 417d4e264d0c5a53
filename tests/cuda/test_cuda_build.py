"""Checks of the GPU executor that run without a GPU: the CUDA compile check catches a kernel that does not compile,
the CPU build stays importable and chooses the CPU executor, and the executor choice refuses what it cannot serve."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtdeepep
from mtdeepep import engines
from mtdeepep.engines import cuda as cuda_executor

pytestmark = pytest.mark.slow  # slow: compiles and loads the CUDA test module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_cuda.sh"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and os.access("/usr/local/cuda/bin/nvcc", os.X_OK):
        found = "/usr/local/cuda/bin/nvcc"
    return found


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "CHECK_CUDA_PYTHON": sys.executable, **env},
    )  # fmt: skip


def test_check_cuda_refuses_a_missing_compiler():
    result = _run(NVCC="/nonexistent/nvcc")
    assert result.returncode == 2
    assert "not an executable" in result.stderr


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_check_cuda_fails_on_a_kernel_that_does_not_compile(tmp_path):
    broken = tmp_path / "broken.cu"
    # A real use of the device header with a type error: an int4 assigned to a float.
    broken.write_text(
        '#include "kernels/cuda/device.cuh"\n'
        "__global__ void k(float* out, const int4* in) { out[threadIdx.x] = in[threadIdx.x]; }\n"
    )
    result = _run(str(broken), NVCC=_nvcc())
    assert result.returncode != 0, result.stdout + result.stderr
    assert "ok " not in result.stdout


@pytest.mark.skipif(_nvcc() is None, reason="nvcc is not installed")
def test_check_cuda_passes_on_the_host_helpers():
    result = _run("csrc/kernels/cuda/common.cu", NVCC=_nvcc())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok csrc/kernels/cuda/common.cu" in result.stdout


def test_cpu_build_imports_and_serves_cpu(monkeypatch):
    assert "cpu" in engines.NODE_ENGINES
    monkeypatch.delenv("MTDEEPEP_DEVICE", raising=False)
    monkeypatch.setattr(engines.dist, "get_backend", lambda group: "gloo")
    assert engines.engine_device(object()) == torch.device("cpu")
    assert mtdeepep.Buffer is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_choice_without_a_device_raises(monkeypatch):
    monkeypatch.setenv("MTDEEPEP_DEVICE", "cuda")
    with pytest.raises(mtdeepep.CommError, match="no cuda device"):
        engines.engine_device(object())
    monkeypatch.delenv("MTDEEPEP_DEVICE")
    monkeypatch.setattr(engines.dist, "get_backend", lambda group: "nccl")
    with pytest.raises(mtdeepep.CommError, match="no cuda device"):
        engines.engine_device(object())


def test_unknown_device_choice_is_a_value_error(monkeypatch):
    monkeypatch.setenv("MTDEEPEP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="MTDEEPEP_DEVICE"):
        engines.engine_device(object())


def test_cuda_engine_module_imports_on_a_cpu_build():
    has_module = cuda_executor._C_cuda is not None
    assert (engines.node_engine_class("cuda") is cuda_executor.CudaEngine) == has_module  # registered only if built
    assert ("cuda" in engines.NODE_ENGINES) == has_module
    assert not cuda_executor.CudaEngine.__abstractmethods__  # the whole engine seam is implemented


# ---- the linked module (built by check_cuda.sh without a GPU: the CUDA runtime is linked statically) ----


@pytest.fixture(scope="module")
def cuda_module(tmp_path_factory):
    # scripts/test.sh runs the whole check just before pytest and hands over the module it linked: not twice.
    checked = os.environ.get("MTDEEPEP_CHECKED_C_CUDA_DIR")
    prebuilt = sorted(Path(checked).glob("_C_cuda*.so")) if checked else []
    if prebuilt:
        (path,) = prebuilt
    else:
        if _nvcc() is None:
            pytest.skip("nvcc is not installed")
        out = tmp_path_factory.mktemp("c_cuda")
        result = _run(NVCC=_nvcc(), MODULE_OUT=str(out))
        assert result.returncode == 0, result.stdout + result.stderr
        (path,) = out.glob("_C_cuda*.so")
    spec = importlib.util.spec_from_file_location("_C_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timeout_word_names_rank_peer_and_phase(cuda_module):
    m = cuda_module
    phase_dispatch_receive = 3
    code = m.encode_error(m.ERROR_TIMEOUT, phase_dispatch_receive, 2, 1)
    assert m.error_kind(code) == m.ERROR_TIMEOUT and m.error_peer(code) == 2
    message = m.error_message(code)
    assert "rank 1 timed out" in message and "waiting for rank 2" in message and "dispatch: rows received" in message
    assert m.error_message(0) == ""


class _FakeBuffer:
    """The status words of a DeviceBuffer, settable (what the kernels would have written)."""

    destroyed = False

    def __init__(self, code: int, cause: int = 0, detail: tuple[int, int] = (0, 0)) -> None:
        self.code, self.cause_code, self.details, self.cleared = code, cause, detail, 0

    def status(self) -> int:
        return self.code

    def cause(self) -> int:
        return self.cause_code

    def detail(self, i: int) -> int:
        return self.details[i]

    def clear_error(self, stream: int) -> None:
        self.cleared += 1
        self.code, self.cause_code, self.details = 0, 0, (0, 0)


class _FakeStream:
    cuda_stream = 0


def _engine_with_status(monkeypatch, module, code: int):
    monkeypatch.setattr(cuda_executor, "_C_cuda", module)
    monkeypatch.setattr(cuda_executor._gpu, "is_current_stream_capturing", lambda: False)
    engine = object.__new__(cuda_executor.CudaEngine)
    engine._failed, engine._destroyed, engine.buffer = None, False, _FakeBuffer(code)
    engine.comm_stream = _FakeStream()
    return engine


def test_engine_raises_comm_timeout_from_the_status_word(monkeypatch, cuda_module):
    m = cuda_module
    engine = _engine_with_status(monkeypatch, m, 0)
    engine.check()  # no error: nothing raised
    engine.buffer.code = m.encode_error(m.ERROR_TIMEOUT, 4, 3, 0)
    with pytest.raises(mtdeepep.CommTimeoutError, match="rank 0 timed out .* waiting for rank 3"):
        engine.check()
    with pytest.raises(mtdeepep.CommTimeoutError):  # the buffer stays failed
        engine.check()


def test_engine_raises_comm_error_when_a_peer_failed(monkeypatch, cuda_module):
    m = cuda_module
    engine = _engine_with_status(monkeypatch, m, m.encode_error(m.ERROR_PEER_FAILED, 1, 2, 0))
    with pytest.raises(mtdeepep.CommError, match="because rank 2 failed") as caught:
        engine.check()
    assert not isinstance(caught.value, mtdeepep.CommTimeoutError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_device_buffer_without_a_gpu_raises_cleanly(cuda_module):
    with pytest.raises(RuntimeError, match="mtdeepep: "):
        cuda_module.DeviceBuffer(0, 2, 1 << 20, 0, 5.0, 0)


@pytest.mark.parametrize(
    ("tokens", "hidden", "ranks", "experts"), [(128, 7168, 8, 256), (64, 2048, 2, 8), (3, 100, 4, 4)]
)
def test_low_latency_size_hint_covers_the_cuda_layout(cuda_module, tokens, hidden, ranks, experts):
    """Buffer.get_low_latency_rdma_size_hint (the CPU layout's) must be enough for the CUDA layout too."""
    layout = cuda_module.low_latency_layout(tokens, hidden, ranks, experts)
    needed = layout["control_bytes"] + 2 * layout["half_bytes"]
    assert needed <= mtdeepep.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts)
    assert layout["recv_x"] % 4096 == 0 and layout["combine_recv"] % 4096 == 0  # 16-byte rows stay aligned


def test_normal_capacity_fits_the_region(cuda_module):
    nbytes = 1 << 26
    for x_bytes, num_scales, num_topk in [(7168 * 2, 0, 8), (7168, 56, 8), (100 * 4, 0, 0), (6, 1, 1)]:
        capacity = cuda_module.normal_capacity(8, nbytes, x_bytes, num_scales, 4, num_topk)
        per_row = x_bytes + 4 * num_scales + 12 * num_topk + 4
        assert capacity > 0 and capacity * per_row <= nbytes


# Phases of api.hpp (Phase): what the messages name.
NOTIFY, DISPATCH_RECEIVE = 1, 3


def test_a_rank_stopped_by_a_peers_timeout_names_the_missing_rank(monkeypatch, cuda_module):
    """4 ranks, rank 1 missing: rank 0's wait runs out first and stops rank 2, whose word is 'stopped because a peer
    failed' with rank 0's timeout as the cause. Rank 2 must raise CommTimeoutError naming rank 1, the rank that did
    not arrive (not 'rank 0 failed')."""
    m = cuda_module
    rank0 = m.encode_error(m.ERROR_TIMEOUT, NOTIFY, 1, 0)
    rank2 = m.encode_error(m.ERROR_PEER_FAILED, DISPATCH_RECEIVE, m.error_rank(rank0), 2)
    message = m.error_message(rank2, rank0)
    assert "rank 2 stopped" in message and "rank 0 timed out on the GPU waiting for rank 1" in message, message
    assert "ranks that did not arrive: [1]" in message
    from .gpu import named_ranks

    assert named_ranks(message) == [1]
    engine = _engine_with_status(monkeypatch, m, rank2)
    engine.buffer.cause_code = rank0
    with pytest.raises(mtdeepep.CommTimeoutError, match=r"did not arrive: \[1\]"):
        engine.check()


def test_a_rank_stopped_by_an_interrupted_peer_raises_comm_error(monkeypatch, cuda_module):
    m = cuda_module
    cause = m.encode_error(m.ERROR_ABORTED, NOTIFY, 3, 3)
    engine = _engine_with_status(monkeypatch, m, m.encode_error(m.ERROR_PEER_FAILED, NOTIFY, 3, 0))
    engine.buffer.cause_code = cause
    with pytest.raises(mtdeepep.CommError, match="rank 3 was interrupted") as caught:
        engine.check()
    assert not isinstance(caught.value, mtdeepep.CommTimeoutError)


def test_num_worst_tokens_overflow_raises_and_leaves_the_buffer_usable(monkeypatch, cuda_module):
    """A receiver over num_worst_tokens: GroupMismatchError naming the rows and the bound (as the CPU executor), the
    error cleared on the device, and the next check passes."""
    m = cuda_module
    code = m.encode_error(m.ERROR_WORST_TOKENS, NOTIFY, 2, 0)
    assert m.is_recoverable(code) and not m.is_recoverable(m.encode_error(m.ERROR_TIMEOUT, NOTIFY, 2, 0))
    engine = _engine_with_status(monkeypatch, m, code)
    engine.buffer.details = (37, 10)
    with pytest.raises(mtdeepep.GroupMismatchError, match="rank 2 receives 37 tokens, more than num_worst_tokens=10"):
        engine.check()
    assert engine.buffer.cleared == 1
    engine.check()  # usable again


def test_region_overflow_raises_comm_error_and_leaves_the_buffer_usable(monkeypatch, cuda_module):
    m = cuda_module
    engine = _engine_with_status(monkeypatch, m, m.encode_error(m.ERROR_OVERFLOW, NOTIFY, 1, 0))
    engine.buffer.details = (5000, 4096)
    with pytest.raises(mtdeepep.CommError, match="rank 1 receives 5000 rows, more than the 4096") as caught:
        engine.check()
    assert not isinstance(caught.value, mtdeepep.GroupMismatchError)
    engine.check()


# ---- a missing executor on a GPU machine fails; value checks can be skipped (no host synchronisation) ----


def test_missing_executor_on_a_gpu_machine_is_not_a_skip(monkeypatch):
    """With a device and a CUDA build of torch, a missing `_C_cuda` is a broken build: `cuda_skip_reason` gives no
    reason to skip (the tests then fail, tests/cuda/conftest.py fails them at once), instead of letting every
    executor test skip and the run pass."""
    from mtdeepep.utils import testing

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    real_import = testing.importlib.import_module

    def no_executor(name, *args):
        if name == testing.CUDA_EXTENSION_MODULE:
            raise ImportError("built without nvcc")
        return real_import(name, *args)

    monkeypatch.setattr(testing.importlib, "import_module", no_executor)
    assert testing.cuda_skip_reason() is None
    assert "built without nvcc" in testing.cuda_executor_import_error()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device" in testing.cuda_skip_reason()


def test_skip_value_checks_leaves_device_values_unread():
    """Inside `skip_value_checks()` the facades' checks of device tensors read shapes only (no host synchronisation,
    bench/cuda_kernels.py times inside it); CPU tensors are checked either way. A meta tensor stands in for a GPU
    tensor (its values cannot be read at all)."""
    from mtdeepep import _checks

    device_idx = torch.empty((4, 2), dtype=torch.int64, device="meta")
    with mtdeepep.skip_value_checks():
        assert not _checks.values_readable(device_idx)
        _checks.check_topk_idx(device_idx, 8, torch.device("meta"))  # shapes only: no read of the meta values
        with pytest.raises(ValueError, match="values must lie in"):
            _checks.check_topk_idx(torch.full((4, 2), 9), 8, torch.device("cpu"))
    assert _checks.values_readable(device_idx) and _checks.values_readable(torch.zeros(1))
