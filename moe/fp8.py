"""DeepSeek-V3 block-wise FP8 (E4M3) for the expert GEMMs.

Recipe: activations and gradients are quantised in 1x128 tiles along the reduction dimension, weights in
128x128 blocks, with one float32 scale per tile (`x ~= e4m3 * scale`, `mtdeepep.utils.fp8.quantize_blocks`, the
quantiser the dispatchers and mtdeepep's references use too) and float32 accumulation. All three GEMMs of
a linear layer use FP8:

    forward      y  = x  @ w      x: 1x128 tiles along K          w: 128x128 blocks
    input grad   dx = dy @ w^T    dy: 1x128 tiles along M         w^T: the same 128x128 blocks
    weight grad  dw = x^T @ dy    x^T: 1x128 tiles along tokens   dy: 128x1 tiles along tokens

`fp8_matmul` runs one GEMM: with `torch._scaled_mm` on a CUDA device whose build passes a one-time probe against
the emulation, otherwise by emulation (quantise to e4m3 with the block scales, dequantise, matmul in float32),
which gives the same numbers up to float32 summation order. Master weights and the SwiGLU in between stay in
the weights' dtype.

Legend: M rows, K reduction, N columns, L experts, H hidden, F expert FFN hidden.
"""

from __future__ import annotations

import functools

import torch

from moe import wgrad
from moe.experts import SwiGLUExperts, counts_to_list
from mtdeepep.utils.fp8 import FP8_BLOCK, dequantize_blocks, quantize_blocks

ACT_TILE = (1, FP8_BLOCK)  # one scale per row per 128 columns (columns = the reduction dimension)
WEIGHT_TILE = (FP8_BLOCK, FP8_BLOCK)
COL_TILE = (FP8_BLOCK, 1)  # one scale per column per 128 rows (rows = the reduction dimension)


def fake_quantize(x_MK: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Quantise-dequantise round trip (float32): what an FP8 GEMM sees of `x_MK`."""
    return dequantize_blocks(*quantize_blocks(x_MK, tile), tile)


# ---------------------------------------------------------------------------------------------------------------
# One FP8 GEMM: real (torch._scaled_mm, CUDA) or emulated
# ---------------------------------------------------------------------------------------------------------------


def _scaled_mm_variant(a_q, a_s, b_q, b_s, variant: tuple[bool, torch.dtype]) -> torch.Tensor:
    scales_col_major, out_dtype = variant
    if scales_col_major:
        a_s = a_s.t().contiguous().t()
    b_col_major = b_q.t().contiguous().t()
    return torch._scaled_mm(a_q.contiguous(), b_col_major, a_s, b_s.contiguous(), out_dtype=out_dtype).float()


@functools.cache
def scaled_mm_variant(device: torch.device, b_tile: tuple[int, int]) -> tuple[bool, torch.dtype] | None:
    """The `torch._scaled_mm` calling convention that reproduces the emulation on `device`, or None.

    Probed once per (device, weight tiling) on 256x256x256 random operands; any error or mismatch disables the
    real path, so an unsupported build or GPU silently uses the emulation.
    """
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 256, generator=gen).to(device)
    b = torch.randn(256, 256, generator=gen).to(device)
    a_q, a_s = quantize_blocks(a, ACT_TILE)
    b_q, b_s = quantize_blocks(b, b_tile)
    expected = dequantize_blocks(a_q, a_s, ACT_TILE) @ dequantize_blocks(b_q, b_s, b_tile)
    for variant in ((False, torch.float32), (True, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)):
        try:
            got = _scaled_mm_variant(a_q, a_s, b_q, b_s, variant)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue
        tol = 1e-2 if variant[1] == torch.bfloat16 else 1e-3
        if torch.allclose(got, expected, rtol=tol, atol=tol * float(expected.abs().max())):
            return variant
    return None


def fp8_matmul(a_MK: torch.Tensor, b_KN: torch.Tensor, b_tile: tuple[int, int]) -> torch.Tensor:
    """`a @ b` in FP8 with `a` in 1x128 tiles along K and `b` in `b_tile` blocks (128x128, or 128x1 for weight
    gradients). Returns `[M, N]` float32."""
    M, K = a_MK.shape
    N = b_KN.size(1)
    if M == 0 or K == 0 or N == 0:
        return a_MK.new_zeros(M, N, dtype=torch.float32)
    a_q, a_s = quantize_blocks(a_MK, ACT_TILE)
    b_q, b_s = quantize_blocks(b_KN, b_tile)
    variant = scaled_mm_variant(a_MK.device, b_tile) if a_MK.is_cuda else None
    if variant is not None and K % 16 == 0 and N % 16 == 0:
        return _scaled_mm_variant(a_q, a_s, b_q, b_s, variant)
    return dequantize_blocks(a_q, a_s, ACT_TILE) @ dequantize_blocks(b_q, b_s, b_tile)


# ---------------------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------------------


class _Fp8GroupedLinear(torch.autograd.Function):
    """`y[rows of group l] = x[rows of group l] @ w[l]` with all three GEMMs in block-wise FP8."""

    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: tuple[int, ...], slot, split) -> torch.Tensor:
        ctx.save_for_backward(x_NK, w_LKM)
        ctx.counts, ctx.slot, ctx.split = counts, slot, split
        outs = [fp8_matmul(x_e, w_LKM[e], WEIGHT_TILE) for e, x_e in enumerate(x_NK.split(counts))]
        y_NM = torch.cat(outs) if outs else x_NK.new_zeros(0, w_LKM.size(2), dtype=torch.float32)
        return y_NM.to(x_NK.dtype)

    @staticmethod
    def backward(ctx, grad_NM: torch.Tensor):
        x_NK, w_LKM = ctx.saved_tensors
        counts = list(ctx.counts)
        grad_x = grad_w = None
        g_parts = grad_NM.split(counts)
        if ctx.needs_input_grad[0]:
            parts = [fp8_matmul(g_e, w_LKM[e].t(), WEIGHT_TILE) for e, g_e in enumerate(g_parts)]
            grad_x = (torch.cat(parts) if parts else x_NK.new_zeros(0, x_NK.size(1))).to(x_NK.dtype)
        if ctx.needs_input_grad[1]:

            def weight_grad() -> torch.Tensor:
                parts = [fp8_matmul(x_e.t(), g_parts[e], COL_TILE) for e, x_e in enumerate(x_NK.split(counts))]
                return torch.stack(parts).to(w_LKM.dtype)

            # Queued while the dispatch's backward communicates, inside `moe.wgrad.deferring` (see moe/wgrad.py).
            grad_w = wgrad.wgrad_or_defer(ctx.slot, weight_grad, ctx.split)
        ctx.slot = ctx.split = None
        return grad_x, grad_w, None, None, None


def fp8_grouped_linear(x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
    """Grouped linear in block-wise FP8.

    Args:
        x_NK: `[N, K]` rows sorted by group.
        w_LKM: `[L, K, M]` one weight per group.
        counts: `[L]` rows per group, summing to N.
    Returns `[N, M]` in `x_NK.dtype` (accumulated in float32).
    """
    return _Fp8GroupedLinear.apply(
        x_NK, w_LKM, tuple(counts_to_list(counts)), wgrad.slot_for(w_LKM), wgrad.split_weight_of(w_LKM)
    )


def fp8_linear(x_MK: torch.Tensor, w_KN: torch.Tensor) -> torch.Tensor:
    """`x @ w` in block-wise FP8 (`x [M, K]`, `w [K, N]`), differentiable in both."""
    return fp8_grouped_linear(x_MK, w_KN.unsqueeze(0), [x_MK.size(0)])


class Fp8SwiGLUExperts(SwiGLUExperts):
    """`SwiGLUExperts` whose two grouped GEMMs run in block-wise FP8 (the weights stay in their dtype as master
    weights and are quantised per step). Supports impl 'grouped' and 'loop' (both compute the same)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.impl == "padded":
            raise ValueError("Fp8SwiGLUExperts does not support impl='padded'")

    def linear(self, x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return fp8_grouped_linear(x_NK, w_LKM, counts)

    @classmethod
    def from_experts(cls, experts: SwiGLUExperts) -> Fp8SwiGLUExperts:
        """An FP8 copy of `experts` (same weights, same layout)."""
        impl = "grouped" if experts.impl == "padded" else experts.impl
        new = cls(
            experts.num_local_experts,
            experts.hidden_size,
            experts.ffn_hidden_size,
            impl=impl,
            row_alignment=experts.row_alignment,
            init_std=experts.init_std,
            dtype=experts.w13.dtype,
            device=experts.w13.device,
        )
        new.load_state_dict(experts.state_dict())
        return new
