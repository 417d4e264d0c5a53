"""One FP8 GEMM on cast operands: `a @ b` with FP32 accumulation, real on CUDA where a probe passes, else emulated.

Emulation (CPU, and any GPU or build the probe rejects): dequantise both operands to FP32 (`e4m3 * scale`, exactly
the values an FP8 GEMM multiplies) and multiply in FP32; the result equals a hardware FP8 GEMM with FP32
accumulation up to the FP32 summation order. Real: `torch._scaled_mm`, per-tensor scales, or DeepSeek-V3's
1x128 x 128x128 / 1x128 x 128x1 block scales through `moe.fp8`'s probed calling convention.

Every FP8 GEMM of this package goes through `scaled_matmul` (tests count its calls).

Legend: M rows, K reduction, N columns.
"""

from __future__ import annotations

import functools

import torch

from moe.fp8 import ACT_TILE, _scaled_mm_variant, scaled_mm_variant
from moe.fp8_training.cast import Fp8Operand, amax_to_scale, cast_per_tensor


@functools.cache
def per_tensor_scaled_mm_ok(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` with per-tensor scales reproduces the emulation on `device` (probed once on
    256x256x256 random operands; any error or mismatch selects the emulation)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(256, 256, generator=gen).to(device) for _ in range(2))
    a8 = cast_per_tensor(a, amax_to_scale(a.abs().amax()))
    b8 = cast_per_tensor(b, amax_to_scale(b.abs().amax()))
    expected = a8.dequantize() @ b8.dequantize()
    try:
        got = _real_per_tensor(a8, b8)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    return torch.allclose(got, expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()))


def _real_per_tensor(a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    b_col_major = b.q.t().contiguous().t()
    return torch._scaled_mm(a.q.contiguous(), b_col_major, a.scale, b.scale, out_dtype=torch.float32)


def _real_path(a: Fp8Operand, b: Fp8Operand):
    """The real GEMM for these operands on their device, or None (emulate)."""
    if not a.q.is_cuda or a.q.size(1) % 16 or b.q.size(1) % 16:
        return None
    if a.tile is None and b.tile is None:
        return _real_per_tensor if per_tensor_scaled_mm_ok(a.q.device) else None
    if a.tile == ACT_TILE and b.tile is not None:
        variant = scaled_mm_variant(a.q.device, b.tile)
        if variant is not None:
            return lambda a_, b_: _scaled_mm_variant(a_.q, a_.scale, b_.q, b_.scale, variant)
    return None


def scaled_matmul(a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    """`a [M, K] @ b [K, N]` of two cast operands: `[M, N]` float32."""
    M, K = a.q.shape
    if b.q.size(0) != K:
        raise ValueError(f"scaled_matmul: inner dimensions differ, a {tuple(a.q.shape)} b {tuple(b.q.shape)}")
    N = b.q.size(1)
    if M == 0 or K == 0 or N == 0:
        return torch.zeros(M, N, dtype=torch.float32, device=a.q.device)
    real = _real_path(a, b)
    if real is not None:
        return real(a, b).float()
    return a.dequantize() @ b.dequantize()
