"""The Triton executor: the ranks of one node move rows with the Triton kernels of `mtdeepep.kernels`, which reach
the peers through a table of their regions' base addresses.

Where the regions come from:
- CPU (under Triton's interpreter, `TRITON_INTERPRET=1`): the shared-memory segments of the CPU executor's
  `_C.Runtime`, which also does the set-up, the liveness of the peers, the interruption and destroy;
  `Runtime.region_addresses` gives every rank's normal region as mapped in this process: the peer table.
- GPU (CUDA, ROCm): device memory of each rank shared through CUDA IPC handles (`peer_table.IpcRegions`); the
  kernels' waits read the GPU clocks (`sync.WaitBound`) and report into a status word in pinned host memory
  (`sync.StatusWord`). The host-side bookkeeping (counts, prefixes, signatures) stays on the CPU: one small copy per
  exchange. Not yet run on a GPU (no GPU was lent when it was written): scripts/gpu_check.sh runs it first.
The table the kernels index: `peer_table.PeerTable`.

The protocol (see `mtdeepep.kernels.intranode`): each operation begins with an all-to-all exchange that doubles as
the entry barrier (the counts for a dispatch, a signature for a combine or cached dispatch), then the rows move in
one round into the receivers' regions, a flag per sender says they are there, and the receiver copies or sums them.
Every wait is bounded (`mtdeepep.kernels.sync`) and ends in `CommTimeoutError` naming the rank that did not arrive
and the phase, on every rank. The calls run on the caller's thread: `async_finish` returns a completed event, and
`previous_event` is waited for first (as the CUDA executor treats a completed CPU event).

Low-latency mode runs `mtdeepep.kernels.low_latency` (its own control part, double buffer and hooks) on the
runtime's low-latency areas (`Runtime.region_addresses(True)`).

Not served yet (raise a clear error): operations larger than the region (the CPU executor moves them in rounds; this
executor, as the CUDA one, asks for a larger `num_nvl_bytes`), groups spanning several nodes (the internode engine
composes the CPU executor only), `async_finish` overlapping the caller (the kernels run on the caller's thread).
"""

from __future__ import annotations

import os

import torch

from .. import _C
from ..kernels import intranode, sync
from ..kernels.layout import dispatch_layout
from ..kernels.low_latency import LowLatencyKernels
from .base import DispatchOutputs, Engine
from .handles import DispatchRecord, attach, low_latency_handle
from .peer_table import PeerTable, open_regions

# Operation kinds in the exchanged signature (every rank of one operation must agree on it).
_OP_DISPATCH, _OP_CACHED_DISPATCH, _OP_COMBINE = 1, 2, 3
_FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _check_interpreter(device: torch.device) -> None:
    if device.type == "cpu" and not sync.interpreted():
        raise ValueError(
            "mtdeepep: the triton executor on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before starting (Triton cannot compile for the CPU)"
        )


class TritonEngine(Engine):
    """Normal and low-latency mode for the `num_ranks` ranks of one node (this rank is `rank` among them), on
    `device`: the CPU under Triton's interpreter (the default), or this process's current GPU of a device type
    (`torch.device("cuda")`). Set-up as the CPU executor: `setup_entry()`, then `connect(entries, uid, group)`."""

    handle_kind = "intranode"

    def __init__(self, *, rank: int, num_ranks: int, num_nvl_bytes: int, num_ll_bytes: int, timeout_s: float,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        self.device = device
        _check_interpreter(self.device)
        self.rank, self.num_ranks = rank, num_ranks
        self.num_nodes, self.num_ranks_per_node = 1, num_ranks
        self.layout_ = intranode.NormalLayout.of(num_ranks)
        least = self.layout_.control_bytes + intranode.ALIGNMENT
        if 0 < num_nvl_bytes < least:
            raise ValueError(
                f"mtdeepep: the triton executor needs num_nvl_bytes >= {least}"
                f" for {num_ranks} ranks (its control area is {self.layout_.control_bytes} bytes), got {num_nvl_bytes}"
            )
        # The regions every rank maps (`peer_table.Regions`: the CPU runtime's segments, or IPC-shared GPU memory).
        self.runtime = open_regions(rank, num_ranks, num_nvl_bytes, num_ll_bytes, timeout_s, self.device)
        self.status = sync.StatusWord(self.device)
        self.bound = sync.WaitBound.for_timeout(timeout_s, self.device)
        self.uid = 0
        self.group: tuple[tuple[int, ...], int] = ((), rank)
        self._op = 0  # operation number: every rank counts the same operations in the same order
        self._seq = 0  # dispatch identities
        self._operation = ""  # the call in progress, for the error messages
        self._creator_pid = os.getpid()
        self.region_table = torch.empty(0, dtype=torch.int64)  # every rank's normal region (the data area at 0)
        self.control_table = torch.empty(0, dtype=torch.int64)  # every rank's control area (the region's end)
        self.poison_table = torch.empty(0, dtype=torch.int64)
        self.control_base = 0
        self.region = torch.empty(0, dtype=torch.uint8)
        self.low_latency: LowLatencyKernels | None = None

    # ---- set-up and lifetime ----

    def setup_entry(self) -> str:
        return self.runtime.setup_entry()

    def connect(self, entries: list[str], uid: int, group: tuple[tuple[int, ...], int], *, low_latency: bool) -> None:
        self.runtime.connect(list(entries), uid)
        self.uid, self.group = uid, group
        self.region = self.runtime.get_local_buffer_tensor(torch.uint8, 0, False)
        # The control area sits at the region's end (every rank's region has the same size): the start is where
        # users write through get_local_buffer_tensor, and the data area is transient between calls anyway.
        table = PeerTable.of(
            self.runtime.region_addresses(False), self.runtime.region_addresses(True) if low_latency else None,
            self.region.numel(), self.layout_, self.device,
        )  # fmt: skip
        self.peer_table = table
        self.region_table, self.control_table, self.poison_table = table.regions, table.control, table.poison
        self.control_base = self.data_bytes = table.control_base
        if low_latency:
            self.low_latency = LowLatencyKernels(
                area=self.runtime.get_local_buffer_tensor(torch.uint8, 0, True),
                peer_table=table.low_latency, rank=self.rank,
                num_ranks=self.num_ranks, uid=uid, timeout_s=self.runtime.timeout_s(),
            )  # fmt: skip

    def set_timeout(self, timeout_s: float) -> None:
        self.runtime.set_timeout(timeout_s)
        self.bound = sync.WaitBound.for_timeout(timeout_s, self.device)
        if self.low_latency is not None:
            self.low_latency.set_timeout(timeout_s)

    def interrupt(self, reason: str) -> None:
        code = sync.encode_error(sync.KIND_ABORTED, 0, self.rank, self.rank)
        if self.region.numel():
            at = self.control_base + self.layout_.poison
            poison = torch.tensor([code], dtype=torch.int64)
            if self.device.type == "cpu":
                self.region[at : at + 8].view(torch.int64).copy_(poison)  # this rank's waits end at their next spin
            else:  # on a stream of its own: never queued behind the kernel that waits
                side = getattr(torch, self.device.type).Stream(self.device)
                with getattr(torch, self.device.type).stream(side):
                    self.region[at : at + 8].view(torch.int64).copy_(poison, non_blocking=False)
                side.synchronize()
        self.status.fail(_C.CommError(f"mtdeepep: rank {self.rank} was interrupted: {reason}"))
        if self.low_latency is not None:
            self.low_latency.interrupt()
        self.runtime.interrupt(reason)

    def destroy(self) -> None:
        if os.getpid() != self._creator_pid:
            return  # a forked child: the C++ runtime abandons its copy without touching the parent's group
        self.region = torch.empty(0, dtype=torch.uint8)
        if self.low_latency is not None:
            self.low_latency.destroy()  # the peers' low-latency waits end at once, naming this rank
            self.low_latency = None
        self.runtime.destroy()

    def empty(self, sizes, dtype):
        return torch.empty(tuple(sizes), dtype=dtype, device=self.device)

    def local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        if use_rdma_buffer and self.runtime.num_ll_bytes() == 0:
            raise ValueError("mtdeepep: this buffer has no RDMA region (num_rdma_bytes is used by low-latency mode)")
        return self.runtime.get_local_buffer_tensor(dtype, offset, use_rdma_buffer)

    # ---- the protocol's steps ----

    def _begin(self, previous) -> None:
        """Before a normal-mode call: an earlier failure raises again; `previous` is waited for."""
        if self.region.numel() < self.layout_.control_bytes + intranode.ALIGNMENT:
            raise ValueError("mtdeepep: normal-mode calls need a buffer with num_nvl_bytes > 0")
        self.status.check()
        if previous is not None:
            previous.wait()

    def _finish(self, async_finish: bool):
        return _C.EventHandle() if async_finish else None

    def _next_op(self, operation: str) -> int:
        self._operation = operation
        self._op += 1
        return self._op

    def _host_wait(self, flags_offset: int, op: int) -> int:
        """The interpreter: the host sleeps until the flags are there (`sync.host_wait_flags`); returns the kernel
        wait's bound (1 spin once the timeout ran out here: the kernel then reports whom it waited for)."""
        if self.bound.clock != sync.CLOCK_SPINS or self.device.type != "cpu":
            return self.bound.bound
        base = self.control_base
        flags = self.region[base + flags_offset : base + flags_offset + 8 * self.num_ranks].view(torch.int64)
        poison = self.region[base + self.layout_.poison : base + self.layout_.poison + 8].view(torch.int64)
        left = sync.host_wait_flags(flags, op, poison, self.runtime.timeout_s())
        return self.bound.bound if left > 0 else 1

    def _exchange(self, op: int, payload: torch.Tensor, flags_offset: int, phase: int) -> torch.Tensor:
        """`payload [R, n]` int32, row j for rank j -> `[R, n]`, row i from rank i (bounded; raises on failure)."""
        n = payload.size(1)
        payload = payload.to(self.device).contiguous()
        out = torch.zeros_like(payload)

        def launch(bound: int, send: bool, receive: bool) -> None:
            sync.exchange_kernel[(1,)](
                self.control_table, self.poison_table, self.status.words, payload, out, self.layout_.mailbox,
                flags_offset, op, bound, phase, self.rank, self.num_ranks, n, SLOT_BYTES=self.layout_.slot_bytes,
                BLOCK=sync.block_size(n), CLOCK=self.bound.clock, SEND=send, RECEIVE=receive,
            )  # fmt: skip

        if self.device.type == "cpu":
            launch(self.bound.bound, True, False)
            launch(self._host_wait(flags_offset, op), False, True)
        else:
            launch(self.bound.bound, True, True)
        self.status.check(self._operation)
        return out.cpu()  # the host's bookkeeping (counts, prefixes, signatures) runs on the CPU

    def _signal_and_wait(self, op: int, flags_offset: int, phase: int) -> None:
        """After a launch wrote rows into the peers: tell every rank, then wait for every rank's rows."""
        sync.signal_all_kernel[(1,)](self.control_table, flags_offset, op, self.rank, self.num_ranks)
        sync.wait_all_kernel[(1,)](
            self.control_table, self.poison_table, self.status.words, flags_offset, op,
            self._host_wait(flags_offset, op), phase, self.rank, self.num_ranks, CLOCK=self.bound.clock,
        )  # fmt: skip
        self.status.check(self._operation)

    def _agree(self, op: int, signature: list[int], what: str) -> None:
        """The barrier of a combine or cached dispatch: every rank's signature must be this one's."""
        row = torch.tensor(signature, dtype=torch.int32)
        everyone = self._exchange(op, row.expand(self.num_ranks, -1), self.layout_.barrier_flags, sync.PHASE_BARRIER)
        self._check_signatures(everyone, row, what)

    def _check_signatures(self, everyone: torch.Tensor, mine: torch.Tensor, what: str) -> None:
        differ = [i for i in range(self.num_ranks) if not torch.equal(everyone[i, : mine.numel()], mine)]
        if differ:
            raise _C.GroupMismatchError(
                f"mtdeepep: {what}: ranks {differ} called with a different operation, row format or handle than rank "
                f"{self.rank} (every rank must pass the handle of the same dispatch and rows of the same format)"
            )

    def _data(self, offset: int, num_bytes: int) -> torch.Tensor:
        return self.region[offset : offset + num_bytes]

    def _check_fits(self, fields: intranode.RowFields, what: str) -> None:
        if fields.total_bytes > self.data_bytes:
            raise _C.CommError(
                f"mtdeepep: {what}: {fields.capacity} rows need {fields.total_bytes} bytes of each receiver's region, "
                f"more than the {self.data_bytes} bytes of num_nvl_bytes left after the control area; the triton "
                "executor moves one operation in one round: raise num_nvl_bytes"
            )

    @staticmethod
    def _traffic(rank_prefix_matrix: torch.Tensor) -> torch.Tensor:
        """`[R, R]` int64: rows rank i sends to rank j, from the handle's inclusive prefix over source ranks."""
        prefix = rank_prefix_matrix.long()
        return torch.diff(prefix, dim=0, prepend=torch.zeros_like(prefix[:1]))

    def _checksum(self, rank_prefix_matrix: torch.Tensor) -> int:
        weights = torch.arange(1, rank_prefix_matrix.numel() + 1, dtype=torch.int64)
        return int((rank_prefix_matrix.reshape(-1).long() * weights).sum()) & 0x7FFFFFFF

    def _send_rows(self, op: int, data, scales, topk_idx, topk_weights, send_head, traffic, fields) -> None:
        recv_offset = traffic[: self.rank].sum(0).to(torch.int32)  # where this rank's rows start at each receiver
        intranode.launch_dispatch_send(
            self.region_table, 0, intranode.word_view(data), scales, topk_idx, topk_weights,
            send_head.contiguous(), recv_offset, self.num_ranks,
            0 if topk_idx is None else self._experts_per_rank, fields, self.device.type == "cpu",
        )  # fmt: skip
        self._signal_and_wait(op, self.layout_.dispatch_flags, sync.PHASE_DISPATCH_RECEIVE)

    def _receive_rows(self, data, scales, num_topk, with_weights, fields, num_recv, rows):
        """This rank's received rows, copied out of its data area into `rows`-row outputs (padding: -1 / 0). Each
        output is a fresh tensor, never written in place after it is made: a caller's autograd views of an async
        dispatch's outputs stay usable (tests/conformance's async_outputs case)."""
        hidden, x_bytes = data.size(1), data.size(1) * data.element_size()
        recv_x = _padded_copy(self._data(fields.x, num_recv * x_bytes).view(data.dtype).view(num_recv, hidden), rows, 0)
        recv_scales = None
        if scales is not None:
            num_scales = scales.size(1)
            area = self._data(fields.scales, num_recv * num_scales * 4).view(scales.dtype)
            recv_scales = _padded_copy(area.view(num_recv, num_scales), rows, 0)
        recv_src = _padded_copy(self._data(fields.src_idx, 4 * num_recv).view(torch.int32), rows, -1)
        recv_idx = recv_weights = None
        if num_topk > 0:
            area = self._data(fields.topk_idx, 8 * num_topk * num_recv).view(torch.int64)
            recv_idx = _padded_copy(area.view(num_recv, num_topk), rows, -1)
            if with_weights:
                area = self._data(fields.topk_weights, 4 * num_topk * num_recv).view(torch.float32)
                recv_weights = _padded_copy(area.view(num_recv, num_topk), rows, 0)
        return recv_x, recv_scales, recv_idx, recv_weights, recv_src

    def _check_worst(self, traffic: torch.Tensor, num_worst_tokens: int) -> None:
        if num_worst_tokens <= 0:
            return
        received = traffic.sum(0)
        for j in range(self.num_ranks):
            if int(received[j]) > num_worst_tokens:
                raise _C.GroupMismatchError(
                    f"mtdeepep: rank {j} receives {int(received[j])} tokens, more than num_worst_tokens="
                    f"{num_worst_tokens}"
                )

    # ---- normal mode ----

    def layout(self, topk_idx, num_experts, previous, async_finish):
        self.status.check()
        if previous is not None:
            previous.wait()
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.num_ranks)
        return per_rank, None, per_expert, in_rank, self._finish(async_finish)

    def dispatch(self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                 expert_alignment, num_worst_tokens, num_channels, previous, async_finish):  # fmt: skip
        self._begin(previous)
        R, me = self.num_ranks, self.rank
        num_tokens, num_experts = data.size(0), num_tokens_per_expert.numel()
        experts_per_rank = num_experts // R
        if experts_per_rank > intranode.MAX_LOCAL_EXPERTS:
            raise ValueError(
                f"mtdeepep: the triton executor takes at most {intranode.MAX_LOCAL_EXPERTS} experts per rank"
            )
        if num_channels > intranode.MAX_CHANNELS:
            raise ValueError(f"mtdeepep: the triton executor takes at most {intranode.MAX_CHANNELS} channels")
        self._experts_per_rank = experts_per_rank
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        x_bytes = data.size(1) * data.element_size()
        scale_bytes = 0 if scales is None else scales.size(1) * scales.element_size()

        # Routing: each token's position among the tokens sent to each rank, and the counts per rank and channel.
        in_rank = is_token_in_rank.to(torch.int32)
        send_head = torch.where(is_token_in_rank, in_rank.cumsum(0) - 1, -1).to(torch.int32)
        per_channel = max(1, -(-num_tokens // num_channels))
        channel = torch.clamp(torch.arange(num_tokens, device=self.device) // per_channel, max=num_channels - 1)
        channel_counts = torch.zeros((num_channels, R), dtype=torch.int32, device=self.device)
        channel_counts = channel_counts.index_add_(0, channel, in_rank).T.cpu()

        # Phase notify: counts (and the call's signature) to every rank; every rank then holds the traffic matrix.
        layout = self.layout_
        signature = torch.zeros(intranode.SIGNATURE_WORDS, dtype=torch.int32)
        signature[:7] = torch.tensor([_OP_DISPATCH, x_bytes, scale_bytes, num_topk, topk_weights is not None,
                                      num_experts, num_worst_tokens], dtype=torch.int32)  # fmt: skip
        payload = torch.zeros((R, layout.slot_words), dtype=torch.int32)
        payload[:, : intranode.SIGNATURE_WORDS] = signature
        counts_at = intranode.SIGNATURE_WORDS
        experts_at = counts_at + R
        channels_at = experts_at + intranode.MAX_LOCAL_EXPERTS
        payload[:, counts_at:experts_at] = in_rank.sum(0).to(torch.int32)
        payload[:, experts_at : experts_at + experts_per_rank] = num_tokens_per_expert.view(R, experts_per_rank)
        payload[:, channels_at : channels_at + num_channels] = channel_counts
        op = self._next_op("dispatch")
        everyone = self._exchange(op, payload, layout.notify_flags, sync.PHASE_NOTIFY)
        self._check_signatures(everyone, signature, "dispatch")
        traffic = everyone[:, counts_at:experts_at].long()
        self._check_worst(traffic, num_worst_tokens)
        num_recv = int(traffic[:, me].sum())
        capacity = num_worst_tokens if num_worst_tokens > 0 else int(traffic.sum(0).max())
        fields = intranode.RowFields.of(capacity, x_bytes, scale_bytes, num_topk)
        self._check_fits(fields, "dispatch")

        # Phase dispatch: rows into the receivers' areas, then this rank's rows out of its own.
        self._send_rows(op, data, scales, topk_idx, topk_weights, send_head, traffic, fields)
        rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = self._receive_rows(
            data, scales, num_topk, topk_weights is not None, fields, num_recv, rows
        )

        # The handle: DeepEP's matrices, computed from the exchanged counts.
        rank_prefix_matrix = traffic.cumsum(0).to(torch.int32)
        channel_prefix_matrix = channel_counts.cumsum(1).to(torch.int32).contiguous()
        theirs = everyone[:, channels_at : channels_at + num_channels].long()  # source i's channel counts for me
        starts = (rank_prefix_matrix[:, me].long() - traffic[:, me]).unsqueeze(1)
        recv_channel_prefix_matrix = (starts + theirs.cumsum(1) - theirs).to(torch.int32).contiguous()
        counts: list[int] = []
        if num_worst_tokens == 0:
            per_expert = everyone[:, experts_at : experts_at + experts_per_rank].long().sum(0)
            counts = ((per_expert + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src, is_token_in_rank,
                  send_head)  # fmt: skip
        self._seq += 1
        record = DispatchRecord(
            kind=self.handle_kind, group=self.group, uid=self.uid, seq=self._seq, num_tokens=num_tokens,
            num_recv=rows, state=(rank_prefix_matrix.clone(), send_head.clone()),
        )  # fmt: skip
        attach(rank_prefix_matrix, record)
        return DispatchOutputs(recv_x, recv_scales, recv_idx, recv_weights, counts, handle, self._finish(async_finish))

    def cached_dispatch(self, data, scales, record, num_worst_tokens, num_channels, previous, async_finish, out=None):
        self._begin(previous)
        rank_prefix_matrix, send_head = record.state
        traffic = self._traffic(rank_prefix_matrix)
        self._check_worst(traffic, num_worst_tokens)
        x_bytes = data.size(1) * data.element_size()
        scale_bytes = 0 if scales is None else scales.size(1) * scales.element_size()
        op = self._next_op("cached dispatch")
        self._agree(op, [_OP_CACHED_DISPATCH, x_bytes, scale_bytes, num_worst_tokens, record.uid & 0x7FFFFFFF,
                         record.seq, self._checksum(rank_prefix_matrix)], "cached dispatch")  # fmt: skip
        num_recv = int(traffic[:, self.rank].sum())
        capacity = num_worst_tokens if num_worst_tokens > 0 else int(traffic.sum(0).max())
        fields = intranode.RowFields.of(capacity, x_bytes, scale_bytes, 0)
        self._check_fits(fields, "cached dispatch")
        self._experts_per_rank = 0
        self._send_rows(op, data, scales, None, None, send_head, traffic, fields)
        rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        recv_x, recv_scales, _, _, _ = self._receive_rows(data, scales, 0, False, fields, num_recv, rows)
        if out is not None:
            out[0][:rows].copy_(recv_x)
            if out[1] is not None and recv_scales is not None:
                out[1][:rows].copy_(recv_scales)
            recv_x, recv_scales = out
        return recv_x, recv_scales, self._finish(async_finish)

    def combine(self, x, topk_weights, bias0, bias1, record, num_channels, previous, async_finish):
        self._begin(previous)
        R, me = self.num_ranks, self.rank
        rank_prefix_matrix, send_head = record.state
        traffic = self._traffic(rank_prefix_matrix)
        num_recv = int(traffic[:, me].sum())
        if x.size(0) < num_recv:
            raise ValueError(f"mtdeepep: x has {x.size(0)} rows but the handle's dispatch received {num_recv}")
        hidden, x_bytes = x.size(1), x.size(1) * x.element_size()
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        op = self._next_op("combine")
        self._agree(op, [_OP_COMBINE, x_bytes, _FLOAT_KIND[x.dtype], num_topk, record.uid & 0x7FFFFFFF, record.seq,
                         self._checksum(rank_prefix_matrix)], "combine")  # fmt: skip
        # Each rank gets back, in its area, the rows of every receiver j at (rows it sent to ranks < j) + position.
        capacity = int(traffic.sum(1).max())
        fields = intranode.RowFields.of(capacity, x_bytes, 0, num_topk, with_src=False)
        self._check_fits(fields, "combine")
        source = torch.repeat_interleave(torch.arange(R), traffic[:, me])
        first_row = rank_prefix_matrix[:, me].long() - traffic[:, me]  # where source i's rows start here
        sent_before = traffic[:, :me].sum(1)  # per source i: rows i sent to ranks before this one
        dst_row = (sent_before[source] + torch.arange(num_recv) - first_row[source]).to(torch.int32)
        rows = x[:num_recv].contiguous()
        weights = None if topk_weights is None else topk_weights[:num_recv].contiguous().float()
        intranode.launch_combine_send(
            self.region_table, 0, intranode.word_view(rows), weights,
            source.to(torch.int32), dst_row, fields, self.device.type == "cpu",
        )  # fmt: skip
        self._signal_and_wait(op, self.layout_.combine_flags, sync.PHASE_COMBINE_RECEIVE)

        num_tokens = record.num_tokens
        combined = torch.empty((num_tokens, hidden), dtype=x.dtype, device=self.device)
        combined_weights = None
        if topk_weights is not None:
            combined_weights = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=self.device)
        area_x = self._data(fields.x, capacity * x_bytes).view(x.dtype).view(capacity, hidden)
        area_w = None
        if topk_weights is not None:
            area_w = self._data(fields.topk_weights, 4 * num_topk * capacity).view(torch.float32).view(-1, num_topk)
        send_offset = (traffic[me].cumsum(0) - traffic[me]).to(torch.int32)
        intranode.launch_combine_reduce(
            area_x, area_w, send_head.contiguous(), send_offset, None if bias0 is None else bias0.contiguous(),
            None if bias1 is None else bias1.contiguous(), combined, combined_weights, self.device.type == "cpu",
        )  # fmt: skip
        return combined, combined_weights, self._finish(async_finish)

    def recv_sources(self, handle):
        rank_prefix_matrix, _, _, recv_src_idx, _, _ = handle
        column = rank_prefix_matrix[:, self.rank].long()
        per_source = torch.diff(column, prepend=column.new_zeros(1))
        src_rank = torch.repeat_interleave(torch.arange(self.num_ranks), per_source)
        return src_rank, recv_src_idx[: src_rank.numel()].long()

    # ---- low-latency mode: mtdeepep.kernels.low_latency on the runtime's low-latency areas ----

    def _ll(self) -> LowLatencyKernels:
        if self.low_latency is None:
            raise ValueError("mtdeepep: low-latency calls need a buffer made with low_latency_mode=True")
        return self.low_latency

    def ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats,
                    use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):  # fmt: skip
        recv_x, recv_scales, recv_count, src_info, layout_range, seq, hook = self._ll().dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats, use_fp8,
            round_scale, use_ue8m0, return_recv_hook,
        )  # fmt: skip
        handle = low_latency_handle(self, src_info, layout_range, seq, x, num_max_dispatch_tokens_per_rank, num_experts)
        return recv_x, recv_scales, recv_count, handle, self._finish(async_finish and hook is None), hook

    def ll_combine(self, x, topk_idx, topk_weights, record, handle, zero_copy, async_finish, return_recv_hook, out,
                   wait_stats):  # fmt: skip
        src_info, layout_range, num_max_dispatch_tokens_per_rank, _, num_experts = handle
        combined, hook = self._ll().combine(
            x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank, num_experts,
            record.uid, record.seq, zero_copy, return_recv_hook, out, wait_stats,
        )  # fmt: skip
        return combined, self._finish(async_finish and hook is None), hook

    def ll_clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        self._ll().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def ll_next_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        return self._ll().next_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)


def _padded_copy(rows: torch.Tensor, num_out: int, fill: int) -> torch.Tensor:
    """A fresh copy of `rows` (out of the shared region) with rows of `fill` appended up to `num_out` rows."""
    padding = rows.new_full((num_out - rows.size(0), *rows.shape[1:]), fill)
    return torch.cat([rows, padding])
