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
    row_align: int = 1  # the left operand's rows are padded to a multiple of this (cuBLASLt rejects some row counts)
    k_align: int = 1  # the reduction dimension is zero-padded to a multiple of this (see K_ALIGNS)


# The reduction dimension's alignments tried: on the H200 with torch 2.11 (11-28) the 128x128 kernels accept
# unpadded column-major scales but read them as if `K/128` were rounded up to 4: right at K = 512, wrong at K = 384.
# Zero-padding K to a multiple of 512 (zero data, scale 1) gives the same product for any K.
K_ALIGNS = (1, 512)
BLOCK_VARIANTS: tuple[Variant, ...] = tuple(
    Variant(a_col, b_layout, out, 1, k_align)
    for k_align in K_ALIGNS
    for out in (torch.float32, torch.bfloat16)
    for b_layout in ("row", "col", "col_pad4")
    for a_col in (False, True)
)
PER_TENSOR_VARIANTS: tuple[Variant, ...] = (Variant(False, "row", torch.float32),)  # per-tensor: the plain one only


def _column_major(t: torch.Tensor, leading: int | None = None) -> torch.Tensor:
    """2-D `t` (same values) with strides `(1, leading)` (default: its row count), set explicitly: `.t().contiguous()
    .t()` leaves arbitrary strides on size-1 dimensions, which the kernels' layout checks reject."""
    rows, cols = t.shape
    leading = rows if leading is None else leading
    storage = torch.ones(max(cols, 1) * leading, dtype=t.dtype, device=t.device)
    out = storage.as_strided((rows, cols), (1, leading))
    out.copy_(t)
    return out


def _b_scale(scale: torch.Tensor, layout: str) -> torch.Tensor:
    """`b`'s block scales `[Kb, Nb]` (same values) in `layout`'s strides."""
    if scale.dim() == 0 or layout == "row":
        return scale.contiguous()
    return _column_major(scale, None if layout == "col" else -(-scale.size(0) // 4) * 4)


def _scaled_mm(a: Fp8Operand, b: Fp8Operand, variant: Variant) -> torch.Tensor:
    """`torch._scaled_mm(a, b)` in `variant`'s convention (b column-major, as cuBLASLt wants): `[M, N]` float32."""
    M, K = a.q.shape
    a_q, a_scale, b_q, b_scale = a.q, a.scale, b.q, b.scale
    # K to a multiple of 16 always (the FP8 kernels' minimum: a weight gradient's K is an expert's row count).
    row_pad, k_pad = -M % variant.row_align, -K % max(variant.k_align, 16)
    if row_pad:  # zero rows (scale 1) to the row count the kernels take; their outputs are dropped below
        a_q = _pad_fp8(a_q, 0, row_pad)
        a_scale = _pad_ones(a_scale, 0, row_pad)
    if k_pad:  # zero columns of a / rows of b, each new 128-block with scale 1: the product is unchanged
        a_q, b_q = _pad_fp8(a_q, 1, k_pad), _pad_fp8(b_q, 0, k_pad)
        new_blocks = -(-(K + k_pad) // 128) - -(-K // 128)
        a_scale, b_scale = _pad_ones(a_scale, 1, new_blocks), _pad_ones(b_scale, 0, new_blocks)
    a_s = _column_major(a_scale) if variant.a_scale_col_major and a_scale.dim() == 2 else a_scale.contiguous()
    b_col_major = b_q.t().contiguous().t()
    b_s = _b_scale(b_scale, variant.b_scale)
    out = torch._scaled_mm(a_q.contiguous(), b_col_major, a_s, b_s, out_dtype=variant.out_dtype)
    return out[:M].float()


def _pad_fp8(q: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    """`q` (E4M3) with `extra` zero rows (dim 0) or columns (dim 1) appended (through bytes: cat of FP8 is not
    implemented everywhere)."""
    shape = list(q.shape)
    shape[dim] = extra
    return torch.cat([q.view(torch.uint8), q.new_zeros(shape, dtype=torch.uint8)], dim=dim).view(q.dtype)


def _pad_ones(scale: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    """Block scales with `extra` blocks of scale 1 appended along `dim` (a per-tensor 0-d scale is returned as is)."""
    if scale.dim() == 0 or extra == 0:
        return scale
    shape = list(scale.shape)
    shape[dim] = extra
    return torch.cat([scale, scale.new_ones(shape)], dim=dim)


def _probe_tensor(rows: int, cols: int, tile: tuple[int, int] | None, gen: torch.Generator) -> torch.Tensor:
    """Random `[rows, cols]` whose blocks of `tile` differ in magnitude by powers of two up to 2^+-4, so every block
    has its own scale and a scale read from the wrong block (a layout mix-up) shows in the product."""
    x = torch.randn(rows, cols, generator=gen)
    if tile is None:
        return x
    r, c = tile
    exponents = torch.randint(-4, 5, (-(-rows // r), -(-cols // c)), generator=gen).float()
    return x * torch.exp2(exponents).repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)[:, :cols]


def _probe_operand(x: torch.Tensor, tile: tuple[int, int] | None) -> Fp8Operand:
    return cast_per_tensor(x, amax_to_scale(x.abs().amax())) if tile is None else cast_blockwise(x, tile)


# The probe's shape: K/128 = 3 (not a multiple of 4, where padded and unpadded scale layouts differ), M, K, N distinct
# (a transposed reading fails), and the left operand's row alignments tried, smallest first.
PROBE_K, PROBE_N = 384, 256
PROBE_ROW_ALIGNS = (1, 8, 16, 128)


def _try(variant: Variant, M: int, b_tile: tuple[int, int] | None, device: torch.device) -> str:
    """The outcome of `variant` on an `[M, PROBE_K] @ [PROBE_K, PROBE_N]` probe: "ok", "mismatch ..." or the error."""
    gen = torch.Generator().manual_seed(M)
    a_tile = None if b_tile is None else ACT_TILE
    a8 = _probe_operand(_probe_tensor(M, PROBE_K, a_tile, gen).to(device), a_tile)
    b8 = _probe_operand(_probe_tensor(PROBE_K, PROBE_N, b_tile, gen).to(device), b_tile)
    expected = a8.dequantize() @ b8.dequantize()
    try:
        got = _scaled_mm(a8, b8, variant)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    tol = 1e-2 if variant.out_dtype == torch.bfloat16 else 1e-3
    if torch.allclose(got, expected, rtol=tol, atol=tol * float(expected.abs().max())):
        return "ok"
    worst, largest = float((got - expected).abs().max()), float(expected.abs().max())
    return f"mismatch: max abs difference {worst:.3e} of {largest:.3e}"


def probe_scaled_mm(device: torch.device, b_tile: tuple[int, int] | None) -> list[tuple[Variant, str]]:
    """Every convention tried for `b_tile` on `device` with its outcome ("ok", "mismatch ...", or the error), in the
    order `scaled_mm_variant` tries them, on 128 rows; the first that passes is then tried on an odd multiple of
    each of `PROBE_ROW_ALIGNS` rows, and the report ends with `(variant with its row_align, "ok")` where one passes.
    For a GPU run's log when the probe fails."""
    report = []
    for variant in PER_TENSOR_VARIANTS if b_tile is None else BLOCK_VARIANTS:
        outcome = _try(variant, 128, b_tile, device)
        report.append((variant, outcome))
        if outcome != "ok":
            continue
        for align in PROBE_ROW_ALIGNS:
            rows = 3 * align if align > 1 else 37
            aligned = variant._replace(row_align=align)
            outcome = _try(aligned, rows, b_tile, device)
            report.append((aligned, f"{rows} rows: {outcome}"))
            if outcome == "ok":
                report.append((aligned, "ok"))
                return report
    return report


@functools.cache
def scaled_mm_variant(device: torch.device, b_tile: tuple[int, int] | None) -> Variant | None:
    """The `torch._scaled_mm` calling convention that reproduces the emulation on `device`, or None (emulate).

    `b_tile`: None for per-tensor operands, else the right operand's tiles (128x128 weights, 128x1 weight-gradient
    operands) with the left one in 1x128 tiles. Probed once per (device, tiling) on random operands whose blocks
    differ in scale (`probe_scaled_mm`, which also says why a convention failed); any error or mismatch disables
    the real path, so an unsupported build or GPU silently uses the emulation.
    """
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    report = probe_scaled_mm(device, b_tile)
    return report[-1][0] if report and report[-1][1] == "ok" else None


def _real_variant(a: Fp8Operand, b: Fp8Operand) -> Variant | None:
    """The real GEMM's convention for these operands on their device, or None (emulate)."""
    if not a.q.is_cuda or b.q.size(1) % 16:
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
