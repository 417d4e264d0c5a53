"""Block-wise E4M3 quantisation (the DeepSeek-V3 FP8 recipe), in plain PyTorch: the one implementation that the
library's references and tests, the benchmarks, and the MoE layer's FP8 experts and low-latency dispatcher use.

A 2-D tensor is cut into tiles of `(rows, cols)` elements (ragged edges allowed) with one float32 scale per tile,
`scale = max(amax, 1e-4) / 448`, so that `x ~= e4m3 * scale` tile by tile. DeepEP's activation cast is the
`(1, 128)` tile: one scale per token per 128 channels (`per_token_cast_to_fp8`); the recipe's weights use
`(128, 128)` blocks and its weight gradients `(128, 1)` tiles.

Legend: M rows, K columns (the reduction dimension of a GEMM), T tokens, H hidden.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128
AMAX_FLOOR = 1e-4  # an all-zero tile gets a tiny scale instead of dividing by zero


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _tiles(x_MK: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """`x` in float32, zero-padded to whole tiles and viewed as `[M/rows, rows, K/cols, cols]` (`_untile` undoes it)."""
    M, K = x_MK.shape
    tr, tc = tile
    Mp, Kp = _cdiv(M, tr) * tr, _cdiv(K, tc) * tc
    x_pad = torch.nn.functional.pad(x_MK.float(), (0, Kp - K, 0, Mp - M))
    return x_pad.view(Mp // tr, tr, Kp // tc, tc)


def _untile(blocks: torch.Tensor, M: int, K: int) -> torch.Tensor:
    """`[M, K]` of the tiles of `_tiles` (padding dropped)."""
    a, tr, b, tc = blocks.shape
    return blocks.view(a * tr, b * tc)[:M, :K]


def quantize_blocks(
    x_MK: torch.Tensor, tile: tuple[int, int], round_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise E4M3 quantisation of a 2-D tensor.

    Args:
        x_MK: `[M, K]` any float dtype.
        tile: `(rows, cols)` of one scaling block, e.g. `(1, 128)` or `(128, 128)`. Ragged edges are allowed.
        round_scale: round each scale up to a power of two (UE8M0-representable scales).
    Returns:
        `(q [M, K] float8_e4m3fn, scale [ceil(M/rows), ceil(K/cols)] float32)` with `x ~= q * scale` per block,
        `scale = max(amax, 1e-4) / 448`.
    """
    M, K = x_MK.shape
    blocks = _tiles(x_MK, tile)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_E4M3_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scaled = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return _untile(scaled.to(FP8_DTYPE), M, K), scale


def dequantize_blocks(q_MK: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Inverse of `quantize_blocks`: `[M, K]` float32 (`scale` may be in either memory order)."""
    M, K = q_MK.shape
    return _untile(_tiles(q_MK, tile) * scale.float()[:, None, :, None], M, K)


def per_token_cast_to_fp8(x_TH: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token, per-128-channel E4M3 cast: `(e4m3 [T, H], float32 scales [T, H/128])`, the `(1, 128)`
    tiles of `quantize_blocks`. `H` must be a multiple of 128 (ValueError)."""
    if x_TH.size(1) % FP8_BLOCK:
        raise ValueError(f"hidden={x_TH.size(1)} must be a multiple of {FP8_BLOCK} for FP8")
    return quantize_blocks(x_TH, (1, FP8_BLOCK), round_scale)


def per_token_cast_back(e4m3_TH: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `per_token_cast_to_fp8`: `[T, H]` float32."""
    return dequantize_blocks(e4m3_TH, scales, (1, FP8_BLOCK))
