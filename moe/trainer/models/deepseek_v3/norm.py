"""RMSNorm with transformers' DeepSeek-V3 precision: normalise in float32, round to the input dtype, then scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`weight * (x / sqrt(mean(x^2) + eps))` over the last dimension; `weight [D]` starts at ones.

    For float32 inputs and weight one fused `F.rms_norm`; otherwise the normalisation runs in float32 and is rounded
    to the input dtype before the (input-dtype) weight multiplies it, as transformers does in bfloat16.
    """

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.size(-1),)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"
