"""Differentiable collectives over an expert-parallel process group (any backend, gloo included).

`group=None` means a single process: every collective is the identity. Sizes are along dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.layer.adjoint import adjoint_pair
from mtdeepep.in_flight import in_flight

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    if group is None:
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    if group is None:
        return 0
    return dist.get_rank(group)


# ---------------------------------------------------------------------------------------------------------------
# All-to-all (asynchronous start, differentiable finish)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PendingAllToAll:
    """An all-to-all in flight: `finish_all_to_all` waits for it and returns the received rows."""

    send: torch.Tensor
    recv: torch.Tensor
    output_splits: list[int]
    input_splits: list[int]
    group: dist.ProcessGroup | None
    work: object | None


def _all_to_all_raw(x: torch.Tensor, output_splits, input_splits, group, async_op: bool):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=async_op)
    return out, work


def start_all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None
) -> PendingAllToAll:
    """Launch `all_to_all_single` of `x` (rows split by `input_splits`, one chunk per rank) without waiting."""
    if group_size(group) == 1:
        return PendingAllToAll(x, x.detach(), output_splits, input_splits, group, None)
    recv, work = _all_to_all_raw(x.detach(), output_splits, input_splits, group, async_op=True)
    return PendingAllToAll(x, recv, output_splits, input_splits, group, work)


class _FinishAllToAll(torch.autograd.Function):
    """Forward returns the already received rows; backward sends the gradient back the reverse way."""

    @staticmethod
    def forward(ctx, send: torch.Tensor, recv: torch.Tensor, pending: PendingAllToAll) -> torch.Tensor:
        ctx.pending = pending
        return recv.view_as(recv)

    @staticmethod
    def backward(ctx, grad_recv: torch.Tensor):
        p = ctx.pending
        grad_send, work = _all_to_all_raw(grad_recv, p.input_splits, p.output_splits, p.group, async_op=True)
        # This thread's in-flight work (the experts' delayed weight-gradient GEMMs after the dispatch: see
        # moe/layer/wgrad.py) runs while it travels.
        try:
            with in_flight("all_to_all_backward"):
                work.wait()
                work = None
        finally:
            if work is not None:
                work.wait()  # the in-flight work raised: never leave the all-to-all in flight
        return grad_send, None, None


def finish_all_to_all(pending: PendingAllToAll) -> torch.Tensor:
    """Wait for `pending` and return the received rows `[sum(output_splits), ...]`, differentiable w.r.t. the
    sent rows."""
    if pending.work is None:
        return pending.send
    pending.work.wait()
    if not pending.send.requires_grad:
        return pending.recv
    return _FinishAllToAll.apply(pending.send, pending.recv, pending)


def all_to_all_counts(send_counts_RL: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange a `[R, L]` int64 matrix: row `r` goes to rank `r`; returns what each source sent here."""
    if group_size(group) == 1:
        return send_counts_RL.clone()
    recv = torch.empty_like(send_counts_RL)
    dist.all_to_all_single(recv, send_counts_RL.contiguous(), group=group)
    return recv


# ---------------------------------------------------------------------------------------------------------------
# All-gather / reduce-scatter with per-rank sizes
# ---------------------------------------------------------------------------------------------------------------


def all_gather_sizes(n: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Every rank's `n`, in rank order."""
    if group_size(group) == 1:
        return [n]
    out = torch.empty(group_size(group), dtype=torch.int64, device=device)
    _all_gather_single(out, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return [int(v) for v in out.tolist()]


def all_gather_v_raw(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's `x [sizes[r], ...]` in rank order (no autograd)."""
    if group_size(group) == 1:
        return x
    pad = max(sizes)
    x_pad = x.new_zeros((pad, *x.shape[1:]))
    x_pad[: x.size(0)] = x
    out = x.new_empty((len(sizes) * pad, *x.shape[1:]))
    _all_gather_single(out, x_pad, group=group)
    return torch.cat([out[r * pad : r * pad + n] for r, n in enumerate(sizes)])


def reduce_scatter_v_raw(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `x [sum(sizes), ...]` over ranks and return this rank's rows (no autograd)."""
    if group_size(group) == 1:
        return x
    pad = max(sizes)
    x_pad = x.new_zeros((len(sizes) * pad, *x.shape[1:]))
    for r, chunk in enumerate(x.split(sizes)):
        x_pad[r * pad : r * pad + chunk.size(0)] = chunk
    out = x.new_empty((pad, *x.shape[1:]))
    _reduce_scatter_single(out, x_pad, group=group)
    return out[: sizes[group_rank(group)]]


# Each one's gradient is the other (the raw functions copy their input into padded buffers: any layout will do).
_AllGatherV, _ReduceScatterV = adjoint_pair(all_gather_v_raw, reduce_scatter_v_raw, ("_AllGatherV", "_ReduceScatterV"))


def all_gather_v(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-gather along dim 0 with per-rank sizes (backward: reduce-scatter)."""
    if group_size(group) == 1:
        return x
    return _AllGatherV.apply(x, sizes, group)


def reduce_scatter_v(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable sum-reduce-scatter along dim 0 with per-rank sizes (backward: all-gather)."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterV.apply(x, sizes, group)
