"""Casts to E4M3 with the recipes' scales: per-tensor (delayed scaling) and block-wise (`quantize_blocks`).

Convention (both recipes, and `mtdeepep.utils.fp8`): a scale is the *dequantisation* factor, `x ~= e4m3 * scale`,
so `scale = amax / 448` puts the amax on E4M3's largest finite value. Values are divided by the scale, clamped to
+-448 (saturation: under delayed scaling a tensor may exceed the amax its scale came from) and rounded to nearest
even through `torch.float8_e4m3fn`.

An `Fp8Operand` is one GEMM operand after the cast: the E4M3 data, its FP32 scales and how they tile it (None: one
scale for the whole tensor). The block-wise casts are `mtdeepep.utils.fp8.quantize_blocks`, the one quantiser of the
library, its dispatchers and these recipes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtdeepep.utils.fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_E4M3_MAX, dequantize_blocks, quantize_blocks


@dataclass
class Fp8Operand:
    """E4M3 data `q [M, K]` and FP32 `scale`: 0-d (per-tensor) or `[ceil(M/r), ceil(K/c)]` for `tile=(r, c)`."""

    q: torch.Tensor
    scale: torch.Tensor
    tile: tuple[int, int] | None

    def dequantize(self) -> torch.Tensor:
        """`[M, K]` float32: exactly the values the FP8 GEMM multiplies."""
        if self.tile is None:
            return self.q.float() * self.scale
        return dequantize_blocks(self.q, self.scale, self.tile)

    def t(self) -> Fp8Operand:
        """The transposed operand (the same values and scales, tiles transposed)."""
        if self.tile is None:
            return Fp8Operand(self.q.t(), self.scale, None)
        return Fp8Operand(self.q.t(), self.scale.t(), (self.tile[1], self.tile[0]))


def amax_to_scale(amax: torch.Tensor, margin: int = 0) -> torch.Tensor:
    """FP32 dequantisation scale `max(amax, 1e-4) * 2**margin / 448` (the floor keeps an all-zero tensor finite)."""
    return amax.float().clamp(min=AMAX_FLOOR) * (2.0**margin) / FP8_E4M3_MAX


def cast_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> Fp8Operand:
    """`x` (2-D, any float dtype) to E4M3 with one given FP32 scale, saturating beyond `448 * scale`."""
    if x.dim() != 2:
        raise ValueError(f"cast_per_tensor expects a 2-D tensor, got shape {tuple(x.shape)}")
    scale = scale.float().reshape(())
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return Fp8Operand(q, scale, None)


def cast_blockwise(x: torch.Tensor, tile: tuple[int, int], power_of_two: bool = False) -> Fp8Operand:
    """`x` (2-D) to E4M3 with one FP32 scale per `tile` (`(1, 128)` activations, `(128, 128)` weights, `(128, 1)`
    the tokens-major operand of a weight gradient), computed from the tile's own amax; `power_of_two` rounds each
    scale up to a power of two (UE8M0)."""
    if x.dim() != 2:
        raise ValueError(f"cast_blockwise expects a 2-D tensor, got shape {tuple(x.shape)}")
    q, scale = quantize_blocks(x, tile, round_scale=power_of_two)
    return Fp8Operand(q, scale, tile)


def fake_quantize(x_MK: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Quantise-dequantise round trip (float32): what a block-wise FP8 GEMM sees of `x_MK`."""
    return cast_blockwise(x_MK, tile).dequantize()
