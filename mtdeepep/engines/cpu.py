"""The CPU executor: the ranks of one host exchange rows through POSIX shared memory (see csrc/runtime/).

One `_C.Runtime` per buffer and rank owns the segment (control block, the normal region of `num_nvl_bytes`, the
low-latency area of `num_rdma_bytes`), the peer group, the comm thread and the lifecycle; `_C.NormalProtocol` and
`_C.LowLatencyProtocol` run normal and low-latency mode on it. This module only adapts them to the `Engine`
interface: arguments arrive checked from the facades.
"""

from __future__ import annotations

import os

import torch

from .. import _C
from .base import DispatchOutputs, Engine
from .handles import DispatchRecord, attach, intranode_recv_sources, low_latency_handle


class CpuEngine(Engine):
    """Normal and low-latency mode for the `num_ranks` ranks of one host (this rank is `rank` among them).

    Set-up is two-step so that the caller runs one exchange for every engine it composes: `setup_entry()` goes into
    the exchanged string, then `connect(entries, uid, group)` with the entries of these ranks.
    """

    handle_kind = "intranode"
    device = torch.device("cpu")

    def __init__(self, *, rank: int, num_ranks: int, num_nvl_bytes: int, num_ll_bytes: int, timeout_s: float) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        self.num_nodes, self.num_ranks_per_node = 1, num_ranks
        self.runtime = _C.Runtime(rank, num_ranks, num_nvl_bytes, num_ll_bytes, timeout_s, torch.get_num_threads())
        self.normal: _C.NormalProtocol | None = None
        self.low_latency: _C.LowLatencyProtocol | None = None
        self.uid = 0
        self.group: tuple[tuple[int, ...], int] = ((), rank)
        self._creator_pid = os.getpid()

    @property
    def host_runtime(self) -> _C.Runtime:
        """The C++ runtime under this engine's segments (an internode engine's node stage runs its protocols on it)."""
        return self.runtime

    # ---- set-up and lifetime ----

    def setup_entry(self) -> str:
        return f"{self.runtime.segment_name()}\t{self.runtime.pid()}"

    def connect(self, entries: list[str], uid: int, group: tuple[tuple[int, ...], int], *, low_latency: bool) -> None:
        """Maps the peers' segments (`entries`: every rank's `setup_entry()`), starts the comm thread, and creates the
        protocols: low-latency mode over shared memory when `low_latency` (the internode engine makes its own, with
        the collective transport, on this runtime)."""
        fields = [entry.split("\t") for entry in entries]
        self.runtime.connect([name for name, _ in fields], [int(pid) for _, pid in fields], uid)
        self.uid, self.group = uid, group
        self.normal = _C.NormalProtocol(self.runtime)
        if low_latency:
            self.low_latency = _C.LowLatencyProtocol(self.runtime, self.rank, self.num_ranks, True)

    def set_timeout(self, timeout_s: float) -> None:
        self.runtime.set_timeout(timeout_s)

    def interrupt(self, reason: str) -> None:
        self.runtime.interrupt(reason)

    def destroy(self) -> None:
        if os.getpid() != self._creator_pid:
            return  # a forked child: the C++ runtime abandons its copy without touching the parent's group
        self.runtime.destroy()

    def empty(self, sizes, dtype):
        return self.normal.empty(list(sizes), dtype)

    def placed_empty(self, sizes, dtype, num_topk):
        """A view of this rank's shared region (see `_C.NormalProtocol.region_empty`)."""
        return self.normal.region_empty(list(sizes), dtype, num_topk)

    def local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        if use_rdma_buffer and self.runtime.num_ll_bytes() == 0:
            raise ValueError("mtdeepep: this buffer has no RDMA region (num_rdma_bytes is used by low-latency mode)")
        return self.runtime.get_local_buffer_tensor(dtype, offset, use_rdma_buffer)

    def _threads(self) -> None:
        self.runtime.set_num_threads(torch.get_num_threads())

    # ---- normal mode ----

    def layout(self, topk_idx, num_experts, previous, async_finish):
        self._threads()
        per_rank, _, per_expert, in_rank, event = self.normal.get_dispatch_layout(
            topk_idx, num_experts, previous, async_finish
        )
        return per_rank, None, per_expert, in_rank, event

    def dispatch(self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                 expert_alignment, num_worst_tokens, num_channels, previous, async_finish):  # fmt: skip
        self._threads()
        (recv_data, recv_scales, recv_idx, recv_weights, counts, rank_prefix_matrix, channel_prefix_matrix,
         recv_channel_prefix_matrix, recv_src_idx, send_head, seq, event) = self.normal.dispatch(
            data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, None, 0, 0,
            expert_alignment, num_worst_tokens, num_channels, previous, async_finish, None, None,
        )  # fmt: skip
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, send_head)  # fmt: skip
        # The layout and routing are complete when dispatch returns (the CPU waits for the counts): keep private
        # copies for combine and cached dispatch, whatever happens to the handle's tensors.
        record = DispatchRecord(
            kind=self.handle_kind, group=self.group, uid=self.uid, seq=seq, num_tokens=data.size(0),
            num_recv=recv_src_idx.size(0), state=(rank_prefix_matrix.clone(), send_head.clone()),
        )  # fmt: skip
        attach(rank_prefix_matrix, record)
        return DispatchOutputs(recv_data, recv_scales, recv_idx, recv_weights, counts, handle, event)

    def cached_dispatch(self, data, scales, record, num_worst_tokens, num_channels, previous, async_finish, out=None):
        self._threads()
        rank_prefix_matrix, send_head = record.state
        out_data, out_scales = (None, None) if out is None else out
        recv = self.normal.dispatch(
            data, scales, None, None, send_head, None, rank_prefix_matrix, record.uid, record.seq, 1,
            num_worst_tokens, num_channels, previous, async_finish, out_data, out_scales,
        )  # fmt: skip
        return recv[0], recv[1], recv[-1]

    def combine(self, x, topk_weights, bias0, bias1, record, num_channels, previous, async_finish):
        self._threads()
        rank_prefix_matrix, send_head = record.state
        return self.normal.combine(
            x, topk_weights, bias0, bias1, rank_prefix_matrix, send_head, record.uid, record.seq, num_channels,
            previous, async_finish,
        )  # fmt: skip

    def recv_sources(self, handle):
        return intranode_recv_sources(handle, self.rank, self.num_ranks)

    # ---- low-latency mode (shared-memory transport) ----

    def ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats,
                    use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):  # fmt: skip
        self._threads()
        recv_x, recv_scales, recv_count, src_info, layout_range, seq, event, hook = self.low_latency.dispatch(
            x, topk_idx, cumulative_stats, wait_stats, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
            round_scale, use_ue8m0, async_finish, return_recv_hook,
        )  # fmt: skip
        handle = low_latency_handle(self, src_info, layout_range, seq, x, num_max_dispatch_tokens_per_rank, num_experts)
        return recv_x, recv_scales, recv_count, handle, event, hook

    def ll_combine(self, x, topk_idx, topk_weights, record, handle, zero_copy, async_finish, return_recv_hook, out,
                   wait_stats):  # fmt: skip
        self._threads()
        src_info, layout_range, num_max_dispatch_tokens_per_rank, _, num_experts = handle
        return self.low_latency.combine(
            x, topk_idx, topk_weights, src_info, layout_range, wait_stats, num_max_dispatch_tokens_per_rank,
            num_experts, record.uid, record.seq, zero_copy, async_finish, return_recv_hook, out,
        )  # fmt: skip

    def ll_clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        self.low_latency.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def ll_next_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        return self.low_latency.next_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
