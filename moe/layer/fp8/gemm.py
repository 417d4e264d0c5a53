"""One FP8 GEMM on cast operands: `a @ b` with FP32 accumulation, real on CUDA where a probe passes, else emulated.

Emulation (CPU, and any GPU or build the probe rejects): dequantise both operands to FP32 (`e4m3 * scale`, exactly
the values an FP8 GEMM multiplies) and multiply in FP32; the result equals a hardware FP8 GEMM with FP32
accumulation up to the FP32 summation order. Real: `torch._scaled_mm`, with per-tensor scales, or DeepSeek-V3's
1x128 x 128x128 / 1x128 x 128x1 block scales, in the calling convention `scaled_mm_variant` found for the device.

Every FP8 GEMM of this package goes through `scaled_matmul` (tests and the benchmark count its calls).

Legend: M rows, K reduction, N columns.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from moe.layer.fp8.cast import Fp8Operand, amax_to_scale, cast_blockwise, cast_per_tensor
from moe.layer.fp8.recipe import ACT_TILE


class Variant(NamedTuple):
    """One calling convention of `torch._scaled_mm` for block-scaled operands.

    Builds differ in the scale layouts the block-scaled kernels accept and in whether they write float32. torch's
    checks (ScaledBlas.cpp) read the right operand transposed: a 128x128-tiled `b [K, N]` wants its
    `[K/128, N/128]` scales column-major, and newer builds want that storage's leading dimension rounded up to 4
    (`b_scale="col_pad4"`); 1x128 activations want their `[M, K/128]` scales column-major.
    """

    a_scale_col_major: bool
    b_scale: str  # "row" (as cast), "col" (column-major), "col_pad4" (column-major, leading dimension padded to 4)
    out_dtype: torch.dtype


BLOCK_VARIANTS: tuple[Variant, ...] = tuple(
    Variant(a_col, b_layout, out)
    for out in (torch.float32, torch.bfloat16)
    for b_layout in ("row", "col", "col_pad4")
    for a_col in (False, True)
)
PER_TENSOR_VARIANTS: tuple[Variant, ...] = (Variant(False, "row", torch.float32),)  # per-tensor: the plain one only


def _b_scale(scale: torch.Tensor, layout: str) -> torch.Tensor:
    """`b`'s block scales `[Kb, Nb]` (same values) in `layout`'s strides."""
    if scale.dim() == 0 or layout == "row":
        return scale.contiguous()
    if layout == "col":
        return scale.t().contiguous().t()
    kb, nb = scale.shape
    storage = torch.zeros(nb, -(-kb // 4) * 4, dtype=scale.dtype, device=scale.device)
    storage[:, :kb] = scale.t()
    return storage[:, :kb].t()


def _scaled_mm(a: Fp8Operand, b: Fp8Operand, variant: Variant) -> torch.Tensor:
    """`torch._scaled_mm(a, b)` in `variant`'s convention (b column-major, as cuBLASLt wants): `[M, N]` float32."""
    a_s = a.scale.t().contiguous().t() if variant.a_scale_col_major else a.scale
    b_col_major = b.q.t().contiguous().t()
    b_s = _b_scale(b.scale, variant.b_scale)
    return torch._scaled_mm(a.q.contiguous(), b_col_major, a_s, b_s, out_dtype=variant.out_dtype).float()


def _probe_operand(x: torch.Tensor, tile: tuple[int, int] | None) -> Fp8Operand:
    return cast_per_tensor(x, amax_to_scale(x.abs().amax())) if tile is None else cast_blockwise(x, tile)


def probe_scaled_mm(device: torch.device, b_tile: tuple[int, int] | None) -> list[tuple[Variant, str]]:
    """Every convention tried for `b_tile` on `device` with its outcome ("ok", "mismatch ...", or the error), in the
    order `scaled_mm_variant` tries them; stops at the first "ok". For a GPU run's log when the probe fails."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(256, 256, generator=gen).to(device) for _ in range(2))
    a8 = _probe_operand(a, None if b_tile is None else ACT_TILE)
    b8 = _probe_operand(b, b_tile)
    expected = a8.dequantize() @ b8.dequantize()
    report = []
    for variant in PER_TENSOR_VARIANTS if b_tile is None else BLOCK_VARIANTS:
        try:
            got = _scaled_mm(a8, b8, variant)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
            report.append((variant, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))
            continue
        tol = 1e-2 if variant.out_dtype == torch.bfloat16 else 1e-3
        if torch.allclose(got, expected, rtol=tol, atol=tol * float(expected.abs().max())):
            report.append((variant, "ok"))
            return report
        report.append((variant, f"mismatch: max abs difference {float((got - expected).abs().max()):.3e}"))
    return report


@functools.cache
def scaled_mm_variant(device: torch.device, b_tile: tuple[int, int] | None) -> Variant | None:
    """The `torch._scaled_mm` calling convention that reproduces the emulation on `device`, or None (emulate).

    `b_tile`: None for per-tensor operands, else the right operand's tiles (128x128 weights, 128x1 weight-gradient
    operands) with the left one in 1x128 tiles. Probed once per (device, tiling) on 256x256x256 random operands; any
    error or mismatch disables the real path, so an unsupported build or GPU silently uses the emulation
    (`probe_scaled_mm` says why).
    """
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    report = probe_scaled_mm(device, b_tile)
    return report[-1][0] if report and report[-1][1] == "ok" else None


def _real_variant(a: Fp8Operand, b: Fp8Operand) -> Variant | None:
    """The real GEMM's convention for these operands on their device, or None (emulate)."""
    if not a.q.is_cuda or a.q.size(1) % 16 or b.q.size(1) % 16:
        return None
    if a.tile is None and b.tile is None:
        return scaled_mm_variant(a.q.device, None)
    if a.tile == ACT_TILE and b.tile is not None:
        return scaled_mm_variant(a.q.device, b.tile)
    return None


def scaled_matmul(a: Fp8Operand, b: Fp8Operand) -> torch.Tensor:
    """`a [M, K] @ b [K, N]` of two cast operands: `[M, N]` float32."""
    M, K = a.q.shape
    if b.q.size(0) != K:
        raise ValueError(f"scaled_matmul: inner dimensions differ, a {tuple(a.q.shape)} b {tuple(b.q.shape)}")
    N = b.q.size(1)
    if M == 0 or K == 0 or N == 0:
        return torch.zeros(M, N, dtype=torch.float32, device=a.q.device)
    variant = _real_variant(a, b)
    if variant is not None:
        return _scaled_mm(a, b, variant)
    return a.dequantize() @ b.dequantize()
