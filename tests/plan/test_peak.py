"""A rank's peak FLOP/s for MFU (moe/trainer/plan/peak.py): the spec of the accelerator the runtime names, a measured
matmul on the CPU (once per process), and one figure for every rank of a run (rank 0's)."""

from __future__ import annotations

import pytest
import torch

from moe.trainer.plan import peak as peak_module
from moe.trainer.plan.peak import Peak, agreed_peak, device_peak, measured_cpu_peak
from tests.ranks import pool_fixture

pools = pool_fixture(world_size=2, comm_timeout_s=30, deadline_s=120)


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0),
        ("NVIDIA H100 80GB HBM3", "fp8", 1979.0),
        ("NVIDIA H200", "float32", 67.0),
        ("MTT S4000", "bfloat16", 100.0),
        ("MTT S4000", "fp8", None),  # no FP8 unit: no rate, no MFU
        ("NVIDIA B200", "bfloat16", 2250.0),
        ("NVIDIA H800", "fp8", 1979.0),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", None),  # no built-in spec (a100-pcie is the PCIe card's)
    ],
)
def test_accelerator_peak_from_its_spec(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    got = device_peak("cuda:0", dtype)
    if tflops is None:
        assert got is None
    else:
        assert got.flops_per_s == tflops * 1e12 and f"{tflops:g} TFLOP/s" in got.source


def test_cpu_peak_is_measured_once_per_process():
    measured_cpu_peak.cache_clear()
    first = device_peak("cpu", "float32")
    assert first.flops_per_s > 1e9 and first.source.startswith("measured: 1024^3 float32 matmul")
    assert device_peak("cpu", "float32") is first  # cached: the same figure for the whole run
    assert agreed_peak("cpu", "float32") is first  # one process: its own
    with pytest.raises(ValueError, match="dtype"):
        device_peak("cpu", "float16")


def _agreed_case(ctx) -> tuple[float, float]:
    """`(agreed peak, own peak)`; rank 1's own figure is made 1 FLOP/s, so that taking it would show."""
    own = device_peak("cpu", "float32") if ctx.rank == 0 else Peak(1.0, "rank 1's own")
    original = peak_module.device_peak
    peak_module.device_peak = lambda device, dtype: own
    try:
        return agreed_peak("cpu", "float32").flops_per_s, own.flops_per_s
    finally:
        peak_module.device_peak = original


def test_every_rank_takes_rank_0s_peak(pools):
    (agreed0, own0), (agreed1, own1) = pools.run(_agreed_case)
    assert agreed0 == agreed1 == own0 > 1e9 and own1 == 1.0
