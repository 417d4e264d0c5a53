"""Rotary position embedding of MLA's decoupled key/query part: default RoPE and YaRN, interleaved or half layout.

Legend: B batch, S positions, N heads, D rotary dims (`qk_rope_head_dim`), D/2 rotary pairs.

YaRN (arXiv 2309.00071), as transformers computes it for DeepSeek-V3: the inverse frequencies blend interpolation
(`1 / (factor * theta^(2i/D))`) and extrapolation (`1 / theta^(2i/D)`) with a linear ramp between the correction
dims of `beta_fast` and `beta_slow` rotations over `original_max_position_embeddings`; cos/sin are multiplied by
`attention_factor` (mscale(factor, mscale) / mscale(factor, mscale_all_dim), 1 for DeepSeek-V3), and the attention
softmax scale by `mscale(factor, mscale_all_dim)^2` (`softmax_scale`).
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """`0.1 * mscale * ln(scale) + 1` for `scale > 1`, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(rope_parameters: dict, dim: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq [D/2] float32, attention_factor)` for `rope_parameters` (see the module docstring)."""
    base = float(rope_parameters["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if rope_parameters["rope_type"] == "default":
        return inv_freq, 1.0
    factor = float(rope_parameters["factor"])
    original = float(rope_parameters["original_max_position_embeddings"])
    attention_factor = rope_parameters.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_parameters.get("mscale"), rope_parameters.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope_parameters["beta_fast"]), correction_dim(rope_parameters["beta_slow"])
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 for the high-frequency dims (kept), 0 for the low ones (interpolated)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq, float(attention_factor)


def softmax_scale(rope_parameters: dict, qk_head_dim: int) -> float:
    """The attention's softmax scale: `qk_head_dim^-0.5`, times `mscale(factor, mscale_all_dim)^2` for YaRN with
    `mscale_all_dim` set (DeepSeek-V3's long-context scaling)."""
    scale = qk_head_dim**-0.5
    if rope_parameters["rope_type"] != "default" and rope_parameters.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_parameters["factor"]), float(rope_parameters["mscale_all_dim"]))
        scale = scale * m * m
    return scale


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables of the rotary pairs (non-persistent float32 `inv_freq` buffer: no state-dict entry)."""

    def __init__(self, rope_parameters: dict, dim: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq, self.attention_factor = inverse_frequencies(rope_parameters, dim)
        self.register_buffer("inv_freq", inv_freq if device is None else inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` `[..., D/2]` in `dtype` for integer `positions` `[...]` (angles in float32): `[S, D/2]` for
        one position axis shared by the rows, `[B, S, D/2]` for per-row positions (packed documents)."""
        angles = positions.float()[..., None] * self.inv_freq.float()
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate `x [B, S, N, D]` by position: the tables `[S, D/2]` (one per position, broadcast over the rows) or
    `[B, S, D/2]` (one per row and position); either broadcasts over the heads. Pair `j` is `(x[2j], x[2j+1])`
    when `interleaved` (DeepSeek's layout), `(x[j], x[j + D/2])` otherwise. Returns the rotated pairs as
    `[first elements | second elements]` (the half layout): queries and keys go through the same permutation, so
    their dot products are those of the input layout."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos_SP.unsqueeze(-2), sin_SP.unsqueeze(-2)  # the heads axis: [S, 1, D/2] or [B, S, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
