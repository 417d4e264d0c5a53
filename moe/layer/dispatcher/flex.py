"""DeepEP token dispatcher ('flex', Megatron's name for the DeepEP path), on an `mtdeepep.Buffer`.

dispatch: `deep_ep.dispatch` (layout + dispatch, differentiable w.r.t. the hidden states and the routing weights)
sends every token *once* to each rank that owns at least one of its experts. The rows received here come with their
local expert ids (-1 where the expert lives elsewhere) and routing weights; they are expanded to one row per
(received token, local expert) and stably sorted by local expert for the experts.
combine: every expert output row is weighted by its routing weight in float32 and summed per received token, then
`deep_ep.combine` sends the float32 partial sums back and adds them per source token in FP32 (cast to the hidden
dtype once at the end, as the 'alltoall' dispatcher does). For bfloat16 hidden states this moves twice the bytes
of a bfloat16 combine, the price of results identical to 'alltoall'.

Compared with 'alltoall', a token with several experts on one rank crosses the wire once per rank, not once per
slot, in both directions; the weighting moves to the expert's rank. Row order within an expert is the same (source
rank, then token order), so the two dispatchers feed the experts identical inputs.

Asynchrony, in training and inference alike: `dispatch_begin` calls `deep_ep.dispatch(..., async_finish=True)`,
which returns once the receive counts are known (the CPU sync upstream has too) while the rows move on the buffer's
comm thread; `dispatch_end` waits on its `EventOverlap`. So with `moe_shared_expert_overlap=True` the shared expert
computes while the rows are in flight, whether or not autograd records the dispatch. Likewise `combine_begin` calls
`deep_ep.combine(..., async_finish=True)` and `combine_end` waits. Results do not depend on the overlap: nothing
reads the received rows (or the combined sums) before the wait.

Backward: autograd records mtdeepep's ops, whose backward rules (DeepEP's: the dispatch's backward is a combine of
the gradients, the combine's a cached dispatch) are written once, in `mtdeepep.autograd`. The dispatch's backward
starts its combine and, while it is in flight, runs the thread's in-flight work (`mtdeepep.in_flight`): the
experts' delayed weight-gradient GEMMs (`moe.layer.wgrad`; MoEConfig `overlap_dispatch_backward_with_experts_wgrad`)
and, in an overlapped DualPipeV chunk, the other micro-batch; then it waits. Without such work it is synchronous.

FP8 dispatch (`use_fp8`, config `moe_flex_use_fp8`; DeepSeek-V3's recipe): the same op with `fp8=True` casts the
tokens to E4M3 with one float32 scale per token per 128 channels (`mtdeepep.utils.fp8.per_token_cast_to_fp8`) and
sends the pair, 1 + 4/128 bytes per element instead of 2 (BF16) or 4 (FP32); the wait in `dispatch_end` dequantises
the received rows to the hidden dtype for the experts (an FP8 expert GEMM re-tiling them 1x128 gets the same E4M3
values back). The op's backward treats the cast as the identity (straight-through) and combines the gradients in
their own dtype, and the forward combine stays in float32 partial sums: FP8 on the way out, high precision on the
way back, as DeepSeek-V3 does.
Without communication (one process) the rows go through the same E4M3 round trip, so every layout computes alike.

Buffers: the dispatcher asks an `EPBuffers` (`moe.layer.dispatcher.buffers`) for its group's normal-mode buffer at every
dispatch, so the layers of a model share one; the combine runs on the dispatch's buffer (kept in the handle), which
stays valid if the shared buffer was grown in between.

Legend: T tokens on this rank, K top-k slots, H hidden, E experts, L local experts, U tokens received here (each
once, however many of its experts are local), N rows for the experts (one per (received token, local expert)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from moe.layer.dispatcher.base import DispatchResult, sort_slots_by_expert, weighted_scatter_sum
from moe.layer.dispatcher.buffers import BufferDispatcher, EPBuffers
from moe.layer.fp8.recipe import fp8_switches
from moe.layer.phase_timer import mark_backward
from mtdeepep.utils.fp8 import per_token_cast_back, per_token_cast_to_fp8

# Combine sends float32 partial sums (exact FP32 reduction across ranks); size the buffer for float32 rows.
_COMBINE_DTYPE = torch.float32


@dataclass
class FlexHandle:
    """State kept between dispatch and combine.

    num_tokens: T, tokens this rank dispatched. dtype: the dispatched hidden dtype (the combine's output dtype).
    num_recv: U, tokens received here. recv_row_N: `[N] int64` received token of every expert row.
    weights_N: `[N] float32` routing weight of every expert row (differentiable).
    comm_handle: the `mtdeepep.Buffer.dispatch` handle for the combine; None without communication (one process).
    buffer: the buffer the dispatch ran on (the combine's); None without communication.
    """

    num_tokens: int
    dtype: torch.dtype
    num_recv: int
    recv_row_N: torch.Tensor
    weights_N: torch.Tensor
    comm_handle: tuple | None
    buffer: deep_ep.Buffer | None


@dataclass
class _PendingFlexDispatch:
    """A dispatch in flight: the received tensors are valid once `event` (None = already complete) finished."""

    num_tokens: int
    dtype: torch.dtype
    recv_x_UH: torch.Tensor
    recv_idx_UK: torch.Tensor  # int64 local expert ids, -1 = elsewhere
    recv_weights_UK: torch.Tensor  # float32, 0 in the -1 slots
    tokens_per_expert: list[int]
    comm_handle: tuple | None
    buffer: deep_ep.Buffer | None
    event: deep_ep.EventOverlap | None


@dataclass
class _PendingFlexCombine:
    """A combine in flight: `combined_TH` (`[T, H] float32`) is valid once `event` (None = complete) finished."""

    combined_TH: torch.Tensor
    dtype: torch.dtype
    event: deep_ep.EventOverlap | None


def expand_by_local_expert(
    recv_idx_UK: torch.Tensor, recv_weights_UK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per (received token, local expert), sorted by local expert, then by received position.

    Args:
        recv_idx_UK: `[U, K] int64` local expert ids, -1 where the slot's expert is elsewhere (or dropped).
        recv_weights_UK: `[U, K] float32` routing weights (differentiable).
    Returns `(recv_row_N [N] int64, expert_N [N] int64, weights_N [N] float32)`.
    """
    slots_N, expert_N = sort_slots_by_expert(recv_idx_UK)
    recv_row_N = slots_N // recv_idx_UK.size(1)
    weights_N = recv_weights_UK.float().reshape(-1).index_select(0, slots_N)
    return recv_row_N, expert_N, weights_N


class _Fp8RoundTrip(torch.autograd.Function):
    """The E4M3 per-token round trip of the wire, with a straight-through gradient (one process)."""

    @staticmethod
    def forward(ctx, x_TH: torch.Tensor) -> torch.Tensor:
        return per_token_cast_back(*per_token_cast_to_fp8(x_TH)).to(x_TH.dtype)

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor) -> torch.Tensor:
        return grad_TH


def nvl_bytes_hint(hidden_size: int, num_ranks: int) -> int:
    """`num_nvl_bytes` for one round of the default dispatch and combine configs with float32 rows of `hidden_size`
    (the larger of `Config.get_nvl_buffer_size_hint` for the two; smaller regions still work, in several rounds)."""
    hidden_bytes = hidden_size * _COMBINE_DTYPE.itemsize
    return max(
        deep_ep.Buffer.get_dispatch_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
        deep_ep.Buffer.get_combine_config(num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
    )


class FlexDispatcher(BufferDispatcher):
    """Token dispatcher on `mtdeepep`'s normal-mode kernels (`Buffer.get_dispatch_layout/dispatch/combine`).

    Args:
        num_experts: E, divisible by the expert-parallel size.
        hidden_size: H; sizes the buffer it asks `ep_buffers` for.
        ep_group: expert-parallel group. None with no `buffer`: one process, no communication (the rows are
            regrouped locally). None with a `buffer`: the buffer's group.
        buffer: an `mtdeepep.Buffer` over the EP group to use always; its owner destroys it.
        ep_buffers: the `EPBuffers` to take the group's normal-mode buffer from (at least
            `nvl_bytes_hint(hidden_size, ep_size)` bytes; created or grown on first use, collectively). None: the
            group's default (`moe.layer.dispatcher.buffers.default_ep_buffers`), shared by every dispatcher given none.
        use_fp8: send the tokens as E4M3 with per-128-channel float32 scales (see the module docstring);
            `hidden_size` must be a multiple of 128. May be switched later by setting `use_fp8`.
    """

    supports_async = True
    supports_async_combine = True

    @functools.cached_property
    def num_nvl_bytes(self) -> int:
        """The normal-mode region it asks `ep_buffers` for: `nvl_bytes_hint(hidden_size, ep_size)`."""
        return nvl_bytes_hint(self.hidden_size, self.ep_size)

    def _buffer_request(self) -> dict[str, Any]:
        return {"num_nvl_bytes": self.num_nvl_bytes}

    def dispatch_begin(self, hidden_TH, probs_TK, topk_idx_TK) -> _PendingFlexDispatch:
        T = hidden_TH.size(0)
        x_TH = hidden_TH.contiguous()
        weights_TK = probs_TK.float().contiguous()
        topk_idx_TK = topk_idx_TK.to(deep_ep.topk_idx_t).contiguous()
        buffer = self.buffer
        if buffer is None:  # one process: every token is "received" as is
            if self.use_fp8:
                x_TH = _Fp8RoundTrip.apply(x_TH)
            counts = torch.bincount(topk_idx_TK[topk_idx_TK >= 0], minlength=self.num_experts).tolist()
            return _PendingFlexDispatch(T, x_TH.dtype, x_TH, topk_idx_TK, weights_TK, counts, None, None, None)

        # mtdeepep's dispatch op, differentiable (its backward, DeepEP's rule, is a combine of the gradients that runs
        # the experts' delayed weight gradients while in flight: `mtdeepep.in_flight`), and an op, so that selective
        # checkpointing can save its outputs. FP8: the op sends E4M3 + scales and dequantises after the wait. The
        # received tensors are not read before `dispatch_end` waits.
        # The marks time the op's backward as 'dispatch' (its delayed weight gradients time themselves 'backward').
        timer = self.phase_timer
        recv_x, recv_idx, recv_weights, counts, comm_handle, event = deep_ep.dispatch(
            buffer, mark_backward(x_TH, timer, "dispatch", enter=False), topk_idx_TK, weights_TK, self.num_experts,
            async_finish=True, fp8=self.use_fp8,
        )  # fmt: skip
        recv_x = mark_backward(recv_x, timer, "dispatch", enter=True)
        return _PendingFlexDispatch(T, x_TH.dtype, recv_x, recv_idx, recv_weights, counts, comm_handle, buffer, event)

    def dispatch_end(self, pending: _PendingFlexDispatch) -> DispatchResult:
        if pending.event is not None:
            pending.event.current_stream_wait()  # FP8: also dequantises the received rows
        recv_row_N, _, weights_N = expand_by_local_expert(pending.recv_idx_UK, pending.recv_weights_UK)
        tokens_per_expert = [int(c) for c in pending.tokens_per_expert]
        if len(tokens_per_expert) != self.num_local_experts or sum(tokens_per_expert) != recv_row_N.numel():
            raise RuntimeError(
                f"dispatch counted {tokens_per_expert} rows per local expert but received {recv_row_N.numel()} "
                f"(token, local expert) pairs for {self.num_local_experts} local experts"
            )
        handle = FlexHandle(
            num_tokens=pending.num_tokens,
            dtype=pending.dtype,
            num_recv=pending.recv_x_UH.size(0),
            recv_row_N=recv_row_N,
            weights_N=weights_N,
            comm_handle=pending.comm_handle,
            buffer=pending.buffer,
        )
        return DispatchResult(pending.recv_x_UH.index_select(0, recv_row_N), tokens_per_expert, handle)

    def combine_begin(self, expert_output_NH: torch.Tensor, handle: FlexHandle) -> _PendingFlexCombine:
        """Weight `[N, H]` expert outputs in float32, sum per received token (`[U, H]` float32), and start sending
        the sums back with `deep_ep.combine(..., async_finish=True)` on the dispatch's buffer (FP32 sum over ranks
        on its comm thread)."""
        partial_UH = weighted_scatter_sum(expert_output_NH, handle.weights_N, handle.recv_row_N, handle.num_recv)
        if handle.comm_handle is None:
            return _PendingFlexCombine(partial_UH, handle.dtype, None)
        combined_TH, _, event = deep_ep.combine(handle.buffer, partial_UH, handle.comm_handle, async_finish=True)
        return _PendingFlexCombine(combined_TH, handle.dtype, event)

    def combine_end(self, pending: _PendingFlexCombine) -> torch.Tensor:
        """Wait for the combine: `[T, H]` in the dispatched hidden dtype (rounded once from the FP32 sum)."""
        if pending.event is not None:
            pending.event.current_stream_wait()
        return pending.combined_TH.to(pending.dtype)


def build_flex(config, ep_group: dist.ProcessGroup | None, ep_buffers: EPBuffers | None) -> FlexDispatcher:
    """Registry factory for 'flex': a `FlexDispatcher` on the buffer of `ep_buffers` (None: the group's default)."""
    return FlexDispatcher(
        num_experts=config.num_moe_experts,
        hidden_size=config.hidden_size,
        ep_group=ep_group,
        ep_buffers=ep_buffers,
        use_fp8=fp8_switches(config).flex_dispatch,
    )
