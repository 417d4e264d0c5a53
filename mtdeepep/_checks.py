"""Argument checks the facades run before any communication: a bad argument raises ValueError on the rank that got it.

The other ranks then wait at their next barrier and fail with a timeout that names this rank.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import _C
from .utils.fp8 import FP8_BLOCK
from .utils.thread_local import thread_local_setting

FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, name))
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_EXPERTS = 1 << 16
DEFAULT_TIMEOUT_S = 100.0


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"mtdeepep: {message}")


def check_timeout(timeout_s: Any) -> float:
    """The one timeout check, wherever a timeout enters (constructors, `set_timeout`, `MTDEEPEP_TIMEOUT_S`): a finite
    number of seconds > 0 (NaN and infinity are refused: a NaN deadline never passes)."""
    require(
        isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool),
        f"timeout_s must be a number of seconds, got {timeout_s!r}",
    )
    return _C.check_timeout(float(timeout_s))


def default_timeout(timeout_s: float | None) -> float:
    """`timeout_s`, else `MTDEEPEP_TIMEOUT_S`, else 100 s; checked."""
    if timeout_s is not None:
        return check_timeout(timeout_s)
    env = os.environ.get("MTDEEPEP_TIMEOUT_S")
    if env is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"mtdeepep: MTDEEPEP_TIMEOUT_S must be a number of seconds, got {env!r}") from None
    return check_timeout(value)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"{name} must be an int >= {minimum}, got {value!r}")  # fmt: skip
    return value


def check_tensor(
    name: str,
    tensor: Any,
    *,
    dim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    require(isinstance(tensor, torch.Tensor), f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dim is not None:
        require(tensor.dim() == dim, f"{name} must be {dim}-D, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        allowed = ", ".join(str(d) for d in dtypes)
        require(tensor.dtype in dtypes, f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    if shape is not None:
        require(len(shape) == tensor.dim(), f"{name} must be {len(shape)}-D, got shape {tuple(tensor.shape)}")
        expected = tuple(tensor.shape[i] if s is None else s for i, s in enumerate(shape))
        require(tuple(tensor.shape) == expected, f"{name} must have shape {expected}, got {tuple(tensor.shape)}")
    if device is not None:
        require(tensor.device == device, f"{name} must be on {device}, got {tensor.device}")
    return tensor


_value_checks = threading.local()


@contextlib.contextmanager
def skip_value_checks() -> Iterator[None]:
    """Within it (this thread), the checks of device tensors look at shapes, dtypes and devices only, not at values:
    reading a GPU tensor's values synchronises the host with its stream (two index ranges and a layout sum per
    dispatch), which a timed loop or a host that must run ahead of the GPU cannot afford. Values out of range are
    then the caller's responsibility, as in DeepEP. CPU tensors are still checked (no synchronisation there)."""
    with thread_local_setting(_value_checks, "skip", True, default=False):
        yield


def values_readable(tensor: torch.Tensor) -> bool:
    """Whether checks may read `tensor`'s values: always on the CPU; on a GPU not while a CUDA graph is being captured
    (reading a device value synchronises the host, which capture forbids: the graph path of dispatch/combine checks
    shapes only) nor inside `skip_value_checks()`."""
    if tensor.device.type == "cpu":
        return True
    if getattr(_value_checks, "skip", False):
        return False
    return tensor.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def check_num_experts(num_experts: Any, num_ranks: int) -> int:
    require(isinstance(num_experts, int) and not isinstance(num_experts, bool) and num_experts > 0,
            f"num_experts must be a positive int, got {num_experts!r}")  # fmt: skip
    require(num_experts % num_ranks == 0, f"num_experts={num_experts} is not divisible by the {num_ranks} ranks")
    require(num_experts <= MAX_EXPERTS, f"num_experts={num_experts} exceeds the supported {MAX_EXPERTS}")
    return num_experts


def check_topk_idx(topk_idx: Any, num_experts: int, device: torch.device, num_tokens: int | None = None) -> None:
    check_tensor("topk_idx", topk_idx, dim=2, dtypes=(torch.int64,), device=device)
    if num_tokens is not None:
        require(topk_idx.size(0) == num_tokens, f"topk_idx has {topk_idx.size(0)} rows but x has {num_tokens} tokens")
    if topk_idx.numel() and values_readable(topk_idx):
        low, high = torch.stack(torch.aminmax(topk_idx)).tolist()  # one read of the device, not two
        require(low >= -1 and high < num_experts,
                f"topk_idx values must lie in [-1, {num_experts}), found range [{low}, {high}]")  # fmt: skip


def split_x(x: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x` is `[T, H]` or the FP8 pair `(e4m3 [T, H], scales [T, H / 128])`; returns `(data, scales or None)`."""
    if isinstance(x, tuple):
        require(len(x) == 2, f"an FP8 x must be a pair (data, scales), got {len(x)} items")
        data, scales = x
        check_tensor("x[0]", data, dim=2, dtypes=FP8_DTYPES, device=device)
        require(data.size(1) % FP8_BLOCK == 0, f"FP8 hidden size must be a multiple of 128, got {data.size(1)}")
        check_tensor(
            "x[1] (scales)",
            scales,
            dim=2,
            dtypes=(torch.float32, torch.int32),
            shape=(data.size(0), data.size(1) // FP8_BLOCK),
            device=device,
        )
        return _rows_contiguous(data), scales
    check_tensor("x", x, dim=2, device=device)
    require(x.dtype.is_floating_point, f"x must be a floating-point tensor, got {x.dtype}")
    return _rows_contiguous(x), None


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(1) == 1 or tensor.size(1) <= 1 else tensor.contiguous()


def check_counts_args(expert_alignment: Any, num_worst_tokens: Any) -> None:
    check_int("expert_alignment", expert_alignment, 1)
    check_int("num_worst_tokens", num_worst_tokens, 0)


def check_layout_tensors(num_tokens: int, num_ranks: int, num_nodes: int, per_rank, per_node, in_rank, per_expert,
                         device: torch.device, layout_ready: bool) -> int:  # fmt: skip
    """The layout tensors of a dispatch (from `get_dispatch_layout`); returns the number of experts. The sums are
    compared only when the layout is complete (`layout_ready`): an async layout may still be in flight."""
    require(
        per_rank is not None and in_rank is not None and per_expert is not None,
        "dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert "
        "(from get_dispatch_layout)",
    )
    check_tensor("num_tokens_per_expert", per_expert, dim=1, dtypes=(torch.int32,), device=device)
    num_experts = check_num_experts(per_expert.size(0), num_ranks)
    check_tensor("num_tokens_per_rank", per_rank, dtypes=(torch.int32,), shape=(num_ranks,), device=device)
    check_tensor("is_token_in_rank", in_rank, dtypes=(torch.bool,), shape=(num_tokens, num_ranks), device=device)
    if per_node is not None:
        check_tensor("num_tokens_per_rdma_rank", per_node, dtypes=(torch.int32,), shape=(num_nodes,), device=device)
    if layout_ready and values_readable(in_rank):
        require(torch.equal(in_rank.sum(dim=0, dtype=torch.int32), per_rank),
                "num_tokens_per_rank does not match is_token_in_rank's column sums")  # fmt: skip
        if per_node is not None:
            per_node_from_ranks = (
                in_rank.reshape(num_tokens, num_nodes, num_ranks // num_nodes).any(dim=2).sum(dim=0, dtype=torch.int32)
            )
            require(
                torch.equal(per_node_from_ranks, per_node), "num_tokens_per_rdma_rank does not match is_token_in_rank"
            )
    return num_experts


def check_weights(topk_weights: Any, rows: int, device: torch.device, name: str = "topk_weights") -> None:
    check_tensor(name, topk_weights, dim=2, dtypes=(torch.float32,), device=device)
    require(topk_weights.size(0) == rows, f"{name} has {topk_weights.size(0)} rows, x has {rows}")


def check_biases(bias: Any, num_tokens: int, x: torch.Tensor, device: torch.device) -> tuple[Any, Any]:
    """`bias`: None, a `[T, H]` tensor or a pair of them (either may be None), in x's dtype."""
    biases = bias if isinstance(bias, tuple) else (bias, None)
    require(len(biases) == 2, f"bias must be a tensor or a pair of tensors, got {len(biases)} items")
    return tuple(
        None if b is None else check_tensor(
            "bias", b, dtypes=(x.dtype,), shape=(num_tokens, x.size(1)), device=device
        ).contiguous()
        for b in biases
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Low-latency mode


def check_ll_dispatch(num_ranks: int, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats,
                      wait_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    check_num_experts(num_experts, num_ranks)
    check_tensor("x", x, dim=2, dtypes=(torch.bfloat16,), device=device)
    check_tensor("topk_idx", topk_idx, dim=2, dtypes=(torch.int64,), device=device)
    require(topk_idx.size(0) == x.size(0), f"topk_idx has {topk_idx.size(0)} rows but x has {x.size(0)} tokens")
    require(
        x.size(0) <= num_max_dispatch_tokens_per_rank,
        f"x has {x.size(0)} tokens, more than num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}",
    )
    require(topk_idx.size(1) <= num_experts, f"top-k {topk_idx.size(1)} exceeds num_experts={num_experts}")
    require(x.size(1) > 0, "hidden must be positive")
    if use_fp8:
        require(x.size(1) % FP8_BLOCK == 0, f"FP8 dispatch needs hidden % 128 == 0, got hidden={x.size(1)}")
        require(round_scale or not use_ue8m0, "use_ue8m0 needs round_scale=True")
    require(not (async_finish and return_recv_hook), "async_finish and return_recv_hook cannot both be set")
    num_local_experts = num_experts // num_ranks
    if cumulative_stats is not None:
        check_tensor("cumulative_local_expert_recv_stats", cumulative_stats, dtypes=(torch.int32,),
                     shape=(num_local_experts,), device=device)  # fmt: skip
        require(cumulative_stats.is_contiguous(), "cumulative_local_expert_recv_stats must be contiguous")
    if wait_stats is not None:
        check_tensor("dispatch_wait_recv_cost_stats", wait_stats, dtypes=(torch.int64,), shape=(num_ranks,),
                     device=device)  # fmt: skip
        require(wait_stats.is_contiguous(), "dispatch_wait_recv_cost_stats must be contiguous")
    return x.contiguous(), topk_idx.contiguous()


def check_ll_handle(handle: Any, num_ranks: int) -> tuple:
    """DeepEP's low-latency handle `(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)`;
    returns it with contiguous tensors."""
    require(
        isinstance(handle, tuple) and len(handle) == 5, "handle must be the 5-tuple returned by low_latency_dispatch"
    )
    src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
    check_int("handle's num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    check_int("handle's hidden", hidden)
    check_num_experts(num_experts, num_ranks)
    num_local_experts = num_experts // num_ranks
    rows = num_ranks * num_max_dispatch_tokens_per_rank
    check_tensor("handle's src_info", src_info, dtypes=(torch.int32,), shape=(num_local_experts, rows))
    check_tensor("handle's layout_range", layout_range, dtypes=(torch.int64,), shape=(num_local_experts, num_ranks))
    return src_info.contiguous(), layout_range.contiguous(), num_max_dispatch_tokens_per_rank, hidden, num_experts


def check_ll_combine(num_ranks: int, handle: tuple, x, topk_idx, topk_weights, use_logfmt, async_finish,
                     return_recv_hook, out, wait_stats, device: torch.device):  # fmt: skip
    _, _, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
    require(not use_logfmt, "use_logfmt=True (LogFMT-compressed combine) is not supported; pass use_logfmt=False")
    require(not (async_finish and return_recv_hook), "async_finish and return_recv_hook cannot both be set")
    num_local_experts = num_experts // num_ranks
    check_tensor("x", x, dtypes=(torch.bfloat16,), device=device,
                 shape=(num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden))  # fmt: skip
    check_tensor("topk_idx", topk_idx, dim=2, dtypes=(torch.int64,), device=device)
    require(topk_idx.size(0) <= num_max_dispatch_tokens_per_rank,
            f"topk_idx has {topk_idx.size(0)} tokens, more than num_max_dispatch_tokens_per_rank="
            f"{num_max_dispatch_tokens_per_rank}")  # fmt: skip
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape), device=device)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), shape=(topk_idx.size(0), hidden), device=device)
        require(out.is_contiguous(), "out must be contiguous")
    if wait_stats is not None:
        check_tensor("combine_wait_recv_cost_stats", wait_stats, dtypes=(torch.int64,), shape=(num_ranks,),
                     device=device)  # fmt: skip
        require(wait_stats.is_contiguous(), "combine_wait_recv_cost_stats must be contiguous")
    return x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
