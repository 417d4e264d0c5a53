"""Checks of the GPU executor that run without a GPU: the CUDA compile check catches a kernel that does not compile,
the CPU build stays importable and chooses the CPU executor, and the executor choice refuses what it cannot serve."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtdeepep
from mtdeepep import _engine

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
        env={**os.environ, "PYTHON": sys.executable, **env},
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
    assert "cpu" in _engine.NODE_ENGINES
    monkeypatch.delenv("MTDEEPEP_DEVICE", raising=False)
    monkeypatch.setattr(_engine.dist, "get_backend", lambda group: "gloo")
    assert _engine.engine_device(object()) == torch.device("cpu")
    assert mtdeepep.Buffer is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_choice_without_a_device_raises(monkeypatch):
    monkeypatch.setenv("MTDEEPEP_DEVICE", "cuda")
    with pytest.raises(mtdeepep.CommError, match="no cuda device"):
        _engine.engine_device(object())
    monkeypatch.delenv("MTDEEPEP_DEVICE")
    monkeypatch.setattr(_engine.dist, "get_backend", lambda group: "nccl")
    with pytest.raises(mtdeepep.CommError, match="no cuda device"):
        _engine.engine_device(object())


def test_unknown_device_choice_is_a_value_error(monkeypatch):
    monkeypatch.setenv("MTDEEPEP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="MTDEEPEP_DEVICE"):
        _engine.engine_device(object())


def test_cuda_engine_module_imports_on_a_cpu_build():
    from mtdeepep import _cuda_engine

    has_module = _cuda_engine._C_cuda is not None
    assert ("cuda" in _engine.NODE_ENGINES) == has_module
