"""Argument checks run before any communication: a bad argument raises ValueError on the rank that got it.

The other ranks then wait at their next barrier and fail with a timeout that names this rank.
"""

from __future__ import annotations

from typing import Any

import torch

FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, name))
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_EXPERTS = 1 << 16


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"mtdeepep: {message}")


def check_tensor(
    name: str,
    tensor: Any,
    *,
    dim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    _require(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dim is not None:
        _require(tensor.dim() == dim, f"{name} must be {dim}-D, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        allowed = ", ".join(str(d) for d in dtypes)
        _require(tensor.dtype in dtypes, f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    if shape is not None:
        expected = tuple(tensor.shape[i] if s is None else s for i, s in enumerate(shape))
        _require(tuple(tensor.shape) == expected, f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
    if device is not None:
        _require(tensor.device == device, f"{name} must be on {device}, got {tensor.device}")
    return tensor


def check_num_experts(num_experts: int, num_ranks: int) -> None:
    _require(isinstance(num_experts, int) and num_experts > 0, f"num_experts must be a positive int, got {num_experts}")
    _require(num_experts % num_ranks == 0, f"num_experts={num_experts} is not divisible by the {num_ranks} ranks")
    _require(num_experts <= MAX_EXPERTS, f"num_experts={num_experts} exceeds the supported {MAX_EXPERTS}")


def check_topk_idx(topk_idx: Any, num_experts: int, device: torch.device, num_tokens: int | None = None) -> None:
    check_tensor("topk_idx", topk_idx, dim=2, dtypes=(torch.int64,), device=device)
    if num_tokens is not None:
        _require(topk_idx.size(0) == num_tokens, f"topk_idx has {topk_idx.size(0)} rows but x has {num_tokens} tokens")
    if topk_idx.numel():
        low, high = int(topk_idx.min()), int(topk_idx.max())
        _require(
            low >= -1 and high < num_experts,
            f"topk_idx values must lie in [-1, {num_experts}), found range [{low}, {high}]",
        )


def split_x(x: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x` is `[T, H]` or the FP8 pair `(e4m3 [T, H], scales [T, H / 128])`; returns `(data, scales or None)`."""
    if isinstance(x, tuple):
        _require(len(x) == 2, f"an FP8 x must be a pair (data, scales), got {len(x)} items")
        data, scales = x
        check_tensor("x[0]", data, dim=2, dtypes=FP8_DTYPES, device=device)
        _require(data.size(1) % 128 == 0, f"FP8 hidden size must be a multiple of 128, got {data.size(1)}")
        check_tensor(
            "x[1] (scales)",
            scales,
            dim=2,
            dtypes=(torch.float32, torch.int32),
            shape=(data.size(0), data.size(1) // 128),
            device=device,
        )
        return _rows_contiguous(data), scales
    check_tensor("x", x, dim=2, device=device)
    _require(x.dtype.is_floating_point, f"x must be a floating-point tensor, got {x.dtype}")
    return _rows_contiguous(x), None


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(1) == 1 or tensor.size(1) <= 1 else tensor.contiguous()
