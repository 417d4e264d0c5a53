"""Low-latency DeepEP token dispatcher ('flex_ll', ours: Megatron has no name for it), for inference and decoding.

On an `mtdeepep.Buffer(..., low_latency_mode=True)`, DeepEP's decoding path:
dispatch: `low_latency_dispatch(..., return_recv_hook=True)` sends every (token, expert) slot straight into the slot
of its expert on the owning rank (`[L, R*T_max, H]`, `recv_count` valid rows per expert) and returns; the receive
hook, called by `dispatch_end`, waits for every source rank. So with `moe_shared_expert_overlap=True` the shared
expert computes while the rows are in flight. The valid rows are packed into `[N, H]`, sorted by local expert, then
by source rank, then token order (the order 'alltoall' gives), so any expert implementation can run on them.
combine: the expert outputs are scattered back into their slots and `low_latency_combine` sends them home, where
`sum_k probs[t, k] * expert_output(t, k)` is accumulated in FP32 in slot order and rounded to bfloat16 once;
`combine_begin` issues the sends and keeps the receive hook, `combine_end` calls it.

Inference only: the low-latency calls are not differentiable. `dispatch_begin` and `combine_begin` raise RuntimeError
when autograd would record through them (grad enabled and an input requires grad); train with 'flex'.

Dtypes: low-latency mode moves bfloat16 rows (or FP8 with `use_fp8`), so the hidden states must be bfloat16
(ValueError otherwise: cast the model, or use 'flex', which takes any dtype). Expert outputs are rounded to
bfloat16 for the combine; routing weights stay float32.

Batch size: every rank must use the same `num_max_dispatch_tokens_per_rank` (T_max; it sizes the buffer and is
checked by every call). A rank with more than T_max tokens raises ValueError before it communicates; the other ranks
then wait in the dispatch until the buffer's timeout, as for any bad input to mtdeepep. A batch never grows the
buffer: that would need an extra collective on every step to agree on the batch size, which is what low-latency mode
avoids. Size T_max for the largest decode batch (DeepEP's usual value, 128, is the default). The buffer comes from an
`EPBuffers` shared with the other layers, grown only when a layer's configured T_max, hidden size or expert count
needs more (which every rank decides alike from the config).

Legend: T tokens on this rank (<= T_max), K top-k slots, H hidden, E experts, R ranks, L local experts, N rows for
the experts (one per (received token, local expert)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from moe.layer.dispatcher.alltoall import AllToAllDispatcher
from moe.layer.dispatcher.base import DispatchResult
from moe.layer.dispatcher.buffers import BufferDispatcher, EPBuffers
from moe.layer.fp8.recipe import fp8_switches
from mtdeepep.utils.fp8 import per_token_cast_back, per_token_cast_to_fp8

DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK = 128
_WIRE_DTYPE = torch.bfloat16  # the only non-FP8 payload of low-latency mode


@dataclass
class FlexLowLatencyHandle:
    """State kept between dispatch and combine.

    num_tokens: T. topk_idx_TK: `[T, K] int64` the dispatched expert ids (-1 = dropped, skipped by the combine).
    weights_TK: `[T, K] float32` routing weights. comm_handle: the `low_latency_dispatch` handle (None in one process).
    slot_row_N: `[N] int64` row of every packed expert row in the flattened `[L * R*T_max]` slots.
    buffer: the buffer the dispatch ran on (the combine's); None in one process.
    local: the 'alltoall' handle of a single process (no buffer), else None.
    """

    num_tokens: int
    topk_idx_TK: torch.Tensor
    weights_TK: torch.Tensor
    comm_handle: tuple | None
    slot_row_N: torch.Tensor | None
    buffer: deep_ep.Buffer | None = None
    local: object | None = None


@dataclass
class _PendingLowLatencyDispatch:
    """A dispatch in flight: `recv` (a bfloat16 tensor, or the FP8 pair) is valid once `hook()` returned."""

    handle: FlexLowLatencyHandle
    recv: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
    recv_count: torch.Tensor | None
    hook: object | None
    local: object | None = None


@dataclass
class _PendingLowLatencyCombine:
    """A combine in flight: `combined_TH` (`[T, H] bfloat16`) is valid once `hook()` returned; `local` is the
    single-process 'alltoall' combine instead."""

    combined_TH: torch.Tensor | None
    hook: object | None
    local: object | None = None


def packed_slot_rows(layout_range_LR: torch.Tensor, rows_per_expert: int) -> tuple[torch.Tensor, list[int]]:
    """Where the valid rows of the slot layout are, in expert-major, then source-rank, then token order.

    Args:
        layout_range_LR: `[L, R] int64` from the dispatch handle, `(begin << 32) | count`: the rows of local expert l
            from source rank r are slots `[begin, begin + count)` of expert l (a contiguous segment in token order).
        rows_per_expert: R * T_max, the slots of one expert.
    Returns `(slot_row_N [N] int64, tokens_per_expert [L] ints)`; `slot_row_N` indexes the slots flattened to
    `[L * R*T_max]`.
    """
    L = layout_range_LR.size(0)
    begin_LR = layout_range_LR >> 32
    count_LR = layout_range_LR & 0xFFFFFFFF
    starts = (begin_LR + torch.arange(L).view(L, 1) * rows_per_expert).reshape(-1)
    sizes = count_LR.reshape(-1)
    packed_starts = sizes.cumsum(0) - sizes
    shift = torch.repeat_interleave(starts - packed_starts, sizes)
    slot_row_N = torch.arange(int(sizes.sum())) + shift
    return slot_row_N, count_LR.sum(1).tolist()


def low_latency_rdma_bytes(max_tokens_per_rank: int, hidden_size: int, num_ranks: int, num_experts: int) -> int:
    """`num_rdma_bytes` of a buffer for these low-latency calls (`Buffer.get_low_latency_rdma_size_hint`)."""
    return deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden_size, num_ranks, num_experts)


class FlexLowLatencyDispatcher(BufferDispatcher):
    """Token dispatcher on `mtdeepep`'s low-latency kernels (`low_latency_dispatch/combine`); inference only.

    Args:
        num_experts: E, divisible by the expert-parallel size.
        hidden_size: H; the hidden states must have this size.
        ep_group: expert-parallel group. None with no `buffer`: one process, no communication (the rows are
            regrouped locally, with the same dtype rules). None with a `buffer`: the buffer's group.
        buffer: an `mtdeepep.Buffer(..., low_latency_mode=True)` over the EP group to use always, with at least
            `low_latency_rdma_bytes(num_max_dispatch_tokens_per_rank, hidden_size, R, E)` bytes; its owner destroys it.
        ep_buffers: the `EPBuffers` to take the group's low-latency buffer from (at least that many bytes; created or
            grown on first use, collectively). None: the group's default
            (`moe.layer.dispatcher.buffers.default_ep_buffers`), shared by every dispatcher given none.
        num_max_dispatch_tokens_per_rank: T_max, the most tokens any rank dispatches in one call; the same on every
            rank. More raises ValueError (see the module docstring).
        use_fp8: send the rows as E4M3 with per-128-channel float32 scales (H must be a multiple of 128); the
            experts get them dequantised to bfloat16.
    """

    supports_async = True
    supports_async_combine = True

    def __init__(
        self, *, num_max_dispatch_tokens_per_rank: int = DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK, **arguments: Any
    ) -> None:  # the other arguments: `BufferDispatcher`'s (see the class docstring)
        T_max = num_max_dispatch_tokens_per_rank
        if isinstance(T_max, bool) or not isinstance(T_max, int) or T_max <= 0:
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, got {T_max!r}")
        super().__init__(**arguments)
        self.num_max_dispatch_tokens_per_rank = T_max
        self.rdma_bytes = low_latency_rdma_bytes(T_max, self.hidden_size, self.ep_size, self.num_experts)
        buffer = self._buffer
        if buffer is not None and not buffer.low_latency_mode:
            raise ValueError("the buffer must be created with low_latency_mode=True")
        if buffer is not None and buffer.num_rdma_bytes < self.rdma_bytes:
            raise ValueError(
                f"the buffer has num_rdma_bytes={buffer.num_rdma_bytes}, less than the {self.rdma_bytes} that "
                f"num_max_dispatch_tokens_per_rank={T_max}, hidden_size={self.hidden_size}, {self.ep_size} ranks "
                f"and {self.num_experts} experts need (Buffer.get_low_latency_rdma_size_hint)"
            )
        # One process: no buffer; the 'alltoall' dispatcher over no group regroups the rows locally.
        self._local = AllToAllDispatcher(num_experts=self.num_experts) if self.ep_group is None else None

    def _buffer_request(self) -> dict[str, Any]:
        # Low-latency calls use only the low-latency area (num_rdma_bytes), no normal region.
        return {"num_rdma_bytes": self.rdma_bytes, "low_latency_mode": True}

    # -----------------------------------------------------------------------------------------------------------
    # Checks (all local, before any communication)

    @staticmethod
    def _refuse_autograd(what: str, *tensors: torch.Tensor) -> None:
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise RuntimeError(
                f"the 'flex_ll' (low-latency) dispatcher is for inference only: autograd would have to record through "
                f"its {what}, which is not differentiable. Run under torch.no_grad() / torch.inference_mode(), or "
                "train with moe_token_dispatcher_type='flex'"
            )

    def _check_dispatch_inputs(self, hidden_TH: torch.Tensor, probs_TK: torch.Tensor) -> None:
        self._refuse_autograd("dispatch", hidden_TH, probs_TK)
        if hidden_TH.dtype != _WIRE_DTYPE:
            raise ValueError(
                f"the 'flex_ll' (low-latency) dispatcher moves bfloat16 rows; got {hidden_TH.dtype} hidden states. "
                "Use a bfloat16 model, or the 'flex' dispatcher (any dtype)"
            )
        if hidden_TH.dim() != 2 or hidden_TH.size(1) != self.hidden_size:
            raise ValueError(f"hidden states must be [T, {self.hidden_size}], got {list(hidden_TH.shape)}")
        if hidden_TH.size(0) > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"{hidden_TH.size(0)} tokens on this rank exceed num_max_dispatch_tokens_per_rank="
                f"{self.num_max_dispatch_tokens_per_rank} of the 'flex_ll' dispatcher; build it with a larger value "
                "(the same on every rank) or split the batch"
            )

    # -----------------------------------------------------------------------------------------------------------
    # TokenDispatcher

    def dispatch_begin(self, hidden_TH, probs_TK, topk_idx_TK) -> _PendingLowLatencyDispatch:
        self._check_dispatch_inputs(hidden_TH, probs_TK)
        x_TH = hidden_TH.contiguous()
        weights_TK = probs_TK.float().contiguous()
        topk_idx_TK = topk_idx_TK.to(deep_ep.topk_idx_t).contiguous()
        handle = FlexLowLatencyHandle(x_TH.size(0), topk_idx_TK, weights_TK, None, None)
        buffer = self.buffer
        if buffer is None:
            return _PendingLowLatencyDispatch(
                handle, None, None, None, self._local.dispatch_begin(x_TH, weights_TK, topk_idx_TK)
            )
        # The hook variant issues the sends on the comm thread and returns; the shared expert runs before hook().
        recv, recv_count, comm_handle, _, hook = buffer.low_latency_dispatch(
            x_TH,
            topk_idx_TK,
            self.num_max_dispatch_tokens_per_rank,
            self.num_experts,
            use_fp8=self.use_fp8,
            return_recv_hook=True,
        )
        handle.comm_handle, handle.buffer = comm_handle, buffer
        return _PendingLowLatencyDispatch(handle, recv, recv_count, hook)

    def dispatch_end(self, pending: _PendingLowLatencyDispatch) -> DispatchResult:
        handle = pending.handle
        if pending.local is not None:
            result = self._local.dispatch_end(pending.local)
            handle.local = result.handle
            rows_NH = result.expert_input_NH
            if self.use_fp8:  # the same per-token E4M3 round trip as the wire
                rows_NH = per_token_cast_back(*per_token_cast_to_fp8(rows_NH)).to(_WIRE_DTYPE)
            return DispatchResult(rows_NH, result.tokens_per_expert, handle)

        pending.hook()
        rows_per_expert = self.ep_size * self.num_max_dispatch_tokens_per_rank
        slot_row_N, tokens_per_expert = packed_slot_rows(handle.comm_handle[1], rows_per_expert)
        if tokens_per_expert != pending.recv_count.tolist():
            raise RuntimeError(
                f"low-latency dispatch counted {pending.recv_count.tolist()} rows per local expert but its layout "
                f"ranges hold {tokens_per_expert}"
            )
        handle.slot_row_N = slot_row_N
        # Copy the valid rows out of the buffer's half now: a later low-latency call reuses it.
        if self.use_fp8:
            data, scales = pending.recv
            expert_N, row_N = slot_row_N // rows_per_expert, slot_row_N % rows_per_expert
            rows_NH = per_token_cast_back(data[expert_N, row_N], scales[expert_N, row_N]).to(_WIRE_DTYPE)
        else:
            rows_NH = pending.recv.reshape(-1, self.hidden_size).index_select(0, slot_row_N)
        return DispatchResult(rows_NH, tokens_per_expert, handle)

    def combine_begin(self, expert_output_NH: torch.Tensor, handle: FlexLowLatencyHandle) -> _PendingLowLatencyCombine:
        """Scatter `[N, H]` expert outputs (rounded to bfloat16) back into their slots and start
        `low_latency_combine` on the dispatch's buffer (sends issued, receive hook returned)."""
        self._refuse_autograd("combine", expert_output_NH)
        y_NH = expert_output_NH.to(_WIRE_DTYPE)
        if handle.local is not None:
            return _PendingLowLatencyCombine(None, None, self._local.combine_begin(y_NH, handle.local))
        buffer = handle.buffer
        # Write straight into the area the zero-copy combine reads: no [L, R*T_max, H] temporary per call. Only the
        # rows the handle names are read, so the other slots need no clearing.
        slots = buffer.get_next_low_latency_combine_buffer(handle.comm_handle)
        slots.view(-1, self.hidden_size).index_copy_(0, handle.slot_row_N, y_NH)
        combined_TH, _, hook = buffer.low_latency_combine(
            slots, handle.topk_idx_TK, handle.weights_TK, handle.comm_handle, zero_copy=True, return_recv_hook=True
        )
        return _PendingLowLatencyCombine(combined_TH, hook)

    def combine_end(self, pending: _PendingLowLatencyCombine) -> torch.Tensor:
        """Wait for every source rank: `[T, H] bfloat16`, `sum_k probs[t, k] * expert_output(t, k)` accumulated in
        FP32 and rounded once."""
        if pending.local is not None:
            return self._local.combine_end(pending.local)
        pending.hook()
        return pending.combined_TH


def build_flex_ll(config, ep_group: dist.ProcessGroup | None, ep_buffers: EPBuffers | None) -> FlexLowLatencyDispatcher:
    """Registry factory for 'flex_ll': a `FlexLowLatencyDispatcher` on the low-latency buffer of `ep_buffers` (None:
    the group's default).

    T_max and FP8 come from the config fields `moe_flex_ll_num_max_dispatch_tokens_per_rank` (default 128) and
    `moe_flex_ll_use_fp8` (default False).
    """
    return FlexLowLatencyDispatcher(
        num_experts=config.num_moe_experts,
        hidden_size=config.hidden_size,
        ep_group=ep_group,
        ep_buffers=ep_buffers,
        num_max_dispatch_tokens_per_rank=config.moe_flex_ll_num_max_dispatch_tokens_per_rank,
        use_fp8=fp8_switches(config).flex_ll_dispatch,
    )
