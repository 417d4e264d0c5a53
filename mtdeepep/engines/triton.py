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
the entry barrier (the counts for a dispatch, a signature for a combine or cached dispatch), then the rows move into
the receivers' data areas, in rounds when the areas cannot hold them at once (as the CPU executor stages them; a
region too small for one row fails on every rank, naming the bytes one row needs), a flag per sender says they are
there, and the receiver copies or sums them. Every wait is bounded (`mtdeepep.kernels.sync`) and ends in
`CommTimeoutError` naming the rank that did not arrive and the phase, on every rank.

Threads: the normal-mode operations run on this engine's worker thread, one at a time in submission order (the
counterpart of a comm stream, as the CPU executor's comm thread and the internode engine's worker). The caller waits
for the outputs' sizes only (a dispatch's counts exchange; a combine's and a cached dispatch's sizes come from the
handle), then for the rest unless `async_finish`: the event completes when the kernels finished, and an error after
the outputs were handed out is raised by its wait. The worker writes outputs already handed out through `.data`
aliases (`_unversioned`), so autograd never sees them modified in place. Triton's interpreter keeps the program
being run in module globals, so interpreted launches of every thread take one lock (`_serialize_interpreted_launches`).

Low-latency mode runs `mtdeepep.kernels.low_latency` (its own control part, double buffer and hooks) on the
runtime's low-latency areas (`Runtime.region_addresses(True)`), on the caller's thread after the worker drained
(under the interpreter a hook-mode call's send phase on the kernels' sender thread, which the hook joins).

Several nodes: the internode engine composes this executor as the node-local stage, as it composes the CPU one.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
from triton.runtime import interpreter

from .. import _C
from ..kernels import intranode, sync
from ..kernels.layout import dispatch_layout
from ..kernels.low_latency import LowLatencyKernels
from .base import LIVE_WORKER_ENGINES, DispatchOutputs, WorkerEngine
from .handles import DispatchRecord, attach, intranode_recv_sources, low_latency_handle
from .peer_table import PeerTable, SharedMemoryRegions, open_regions

# Operation kinds in the exchanged signature (every rank of one operation must agree on it).
_OP_DISPATCH, _OP_CACHED_DISPATCH, _OP_COMBINE = 1, 2, 3
_FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_NOTIFY_MARGIN_S = 30.0  # the caller's wait for outputs ends this long after the worker last made progress
_WAIT_SLICE_S = 0.25


def _serialize_interpreted_launches() -> None:
    """Triton's interpreter runs a launch with module-global state (the program id, the patched language): launches
    from two threads (an engine's worker and the caller, or two engines' workers) must not interleave. Each
    interpreted launch takes one process-wide lock (a launch's in-kernel waits are short: the host waits first)."""
    if not sync.interpreted():
        return
    call = interpreter.GridExecutor.__call__
    if getattr(call, "_mtdeepep_serialized", False):
        return
    lock = threading.RLock()

    def serialized(self, *args, **kwargs):
        with lock:
            return call(self, *args, **kwargs)

    serialized._mtdeepep_serialized = True
    interpreter.GridExecutor.__call__ = serialized


_serialize_interpreted_launches()


def _check_interpreter(device: torch.device) -> None:
    if device.type == "cpu" and not sync.interpreted():
        raise ValueError(
            "mtdeepep: the triton executor on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before starting (Triton cannot compile for the CPU)"
        )


class TritonEngine(WorkerEngine):
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
        # The region: the `num_nvl_bytes` data area users see (and operations stage rows in), then the control area.
        self.num_nvl_bytes = num_nvl_bytes
        self.data_bytes = num_nvl_bytes
        self.control_base = _align(num_nvl_bytes, intranode.ALIGNMENT) if num_nvl_bytes > 0 else 0
        region_bytes = self.control_base + self.layout_.control_bytes if num_nvl_bytes > 0 else 0
        # The regions every rank maps (`peer_table.Regions`: the CPU runtime's segments, or IPC-shared GPU memory).
        self.runtime = open_regions(rank, num_ranks, region_bytes, num_ll_bytes, timeout_s, self.device)
        self.status = sync.StatusWord(self.device)
        self.bound = sync.WaitBound.for_timeout(timeout_s, self.device)
        self.uid = 0
        self.group: tuple[tuple[int, ...], int] = ((), rank)
        self._op = 0  # exchange number (notify and barrier flags): every rank counts the same operations in order
        self._step = 0  # step number (rows-written and round-consumed flags): every rank counts the same rounds
        self._seq = 0  # dispatch identities
        self._operation = ""  # the call in progress, for the error messages
        self._creator_pid = os.getpid()
        self.region_table = torch.empty(0, dtype=torch.int64)  # every rank's normal region (the data area at 0)
        self.control_table = torch.empty(0, dtype=torch.int64)  # every rank's control area (the region's end)
        self.poison_table = torch.empty(0, dtype=torch.int64)
        self.region = torch.empty(0, dtype=torch.uint8)
        self.low_latency: LowLatencyKernels | None = None
        self._progress = 0  # the worker's steps so far: the caller's wait for outputs is bounded by its stalls
        self._destroyed = False
        self._start_worker("triton")
        weakref.finalize(self, self._worker.shutdown, wait=False)

    @property
    def host_runtime(self) -> _C.Runtime:
        """The C++ runtime under this engine's CPU segments (an internode engine's node stage runs its protocols on
        it); GPU regions have none."""
        if not isinstance(self.runtime, SharedMemoryRegions):
            raise ValueError(f"mtdeepep: the Triton executor on {self.device} has no host runtime (the internode "
                             "composition runs on CPU segments)")  # fmt: skip
        return self.runtime.host_runtime

    # ---- set-up and lifetime ----

    def setup_entry(self) -> str:
        return self.runtime.setup_entry()

    def connect(self, entries: list[str], uid: int, group: tuple[tuple[int, ...], int], *, low_latency: bool) -> None:
        self.runtime.connect(list(entries), uid)
        self.uid, self.group = uid, group
        self.region = self.runtime.get_local_buffer_tensor(torch.uint8, 0, False)
        # Every rank's region has the same size (the group agrees on num_nvl_bytes): the control area at the same
        # offset, after the data area (its size is a multiple of ALIGNMENT, so the table finds it there).
        table = PeerTable.of(
            self.runtime.region_addresses(False), self.runtime.region_addresses(True) if low_latency else None,
            self.region.numel(), self.layout_, self.device,
        )  # fmt: skip
        if self.num_nvl_bytes > 0 and table.control_base != self.control_base:
            raise AssertionError(f"mtdeepep: control area at {table.control_base}, expected {self.control_base}")
        self.peer_table = table
        self.region_table, self.control_table, self.poison_table = table.regions, table.control, table.poison
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
        """Finishes the queued operations (each bounded by the timeout), then releases the worker, the low-latency
        kernels and the runtime; idempotent; nothing in a forked child."""
        if os.getpid() != self._creator_pid:
            return  # a forked child: the C++ runtime abandons its copy without touching the parent's group
        if self._destroyed:
            return
        self._destroyed = True
        LIVE_WORKER_ENGINES.discard(self)
        self._worker.shutdown(wait=True)
        self.region = torch.empty(0, dtype=torch.uint8)
        if self.low_latency is not None:
            self.low_latency.destroy()  # the peers' low-latency waits end at once, naming this rank
            self.low_latency = None
        self.runtime.destroy()

    def empty(self, sizes, dtype):
        return torch.empty(tuple(sizes), dtype=dtype, device=self.device)

    def local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        if use_rdma_buffer:
            if self.runtime.num_ll_bytes() == 0:
                raise ValueError(
                    "mtdeepep: this buffer has no RDMA region (num_rdma_bytes is used by low-latency mode)"
                )
            return self.runtime.get_local_buffer_tensor(dtype, offset, True)
        element = torch.empty(0, dtype=dtype).element_size()
        if offset * element > self.num_nvl_bytes:
            raise ValueError(f"mtdeepep: offset {offset} is outside the {self.num_nvl_bytes}-byte buffer")
        whole = self.runtime.get_local_buffer_tensor(dtype, offset, False)  # the data area, then the control area
        return whole[: (self.num_nvl_bytes - offset * element) // element]

    # ---- the worker: operations in submission order, off the caller's thread ----

    def _task(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():  # communication is not differentiable (see mtdeepep.autograd)
                body()

        return run

    def _await_outputs(self, notified: Future) -> tuple:
        """The caller's wait for an operation's outputs: every step of the worker is bounded by the timeout, so the
        wait ends with a timeout error only once the worker made no progress for longer than that (and a margin)."""
        progress, since = self._progress, time.monotonic()
        while True:
            try:
                return notified.result(timeout=_WAIT_SLICE_S)
            except FutureTimeout:
                if notified.done():  # the operation's own error (a CommTimeoutError is a TimeoutError too)
                    raise
            if self._progress != progress:
                progress, since = self._progress, time.monotonic()
            elif time.monotonic() - since > self.runtime.timeout_s() + _NOTIFY_MARGIN_S:
                message = (
                    f"mtdeepep: rank {self.rank}: {self._operation or 'an operation'}: its outputs were not ready and "
                    f"the worker made no progress for {time.monotonic() - since:.1f} s"
                )
                self.interrupt(message)
                raise _C.CommTimeoutError(message)

    def _check_usable(self) -> None:
        if self._destroyed:
            raise _C.CommError("mtdeepep: the buffer was destroyed")
        if self.num_nvl_bytes <= 0:
            raise ValueError("mtdeepep: normal-mode calls need a buffer with num_nvl_bytes > 0")
        self.status.check()

    def _drain(self) -> None:
        """Waits for the worker's queued operations (before work on the caller's thread that shares the kernels'
        interpreter or the regions: low-latency mode). Their errors belong to their own events."""
        if self._busy:
            self._worker.submit(lambda: None).result()

    # ---- the protocol's steps (on the worker) ----

    def _next_op(self, operation: str) -> int:
        self._operation = operation
        self._op += 1
        return self._op

    def _next_step(self) -> int:
        self._step += 1
        return self._step

    def _host_wait(self, flags_offset: int, value: int) -> int:
        """The interpreter: the host sleeps until the flags are there (`sync.host_wait_flags`); returns the kernel
        wait's bound (1 spin once the timeout ran out here: the kernel then reports whom it waited for)."""
        self._progress += 1
        if self.bound.clock != sync.CLOCK_SPINS or self.device.type != "cpu":
            return self.bound.bound
        base = self.control_base
        flags = self.region[base + flags_offset : base + flags_offset + 8 * self.num_ranks].view(torch.int64)
        poison = self.region[base + self.layout_.poison : base + self.layout_.poison + 8].view(torch.int64)
        left = sync.host_wait_flags(flags, value, poison, self.runtime.timeout_s())
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

    def _signal_and_wait(self, flags_offset: int, phase: int) -> None:
        """After a launch wrote rows into the peers (or a round was consumed): tell every rank, then wait for every
        rank (the next step number)."""
        step = self._next_step()
        sync.signal_all_kernel[(1,)](self.control_table, flags_offset, step, self.rank, self.num_ranks)
        sync.wait_all_kernel[(1,)](
            self.control_table, self.poison_table, self.status.words, flags_offset, step,
            self._host_wait(flags_offset, step), phase, self.rank, self.num_ranks, CLOCK=self.bound.clock,
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

    def _staging(self, most: int, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool, what: str):
        """The fields of one round in every receiver's data area: as many of the `most` rows (the largest receiver's)
        as fit in `data_bytes`. Every rank computes the same from the exchanged counts, so when not even one row fits
        every rank raises the same GroupMismatchError, naming the bytes one row needs, before any row moves."""
        capacity = min(most, self.data_bytes // max(1, x_bytes + scale_bytes + 12 * num_topk + 4 * with_src))
        while capacity > 0:
            fields = intranode.RowFields.of(capacity, x_bytes, scale_bytes, num_topk, with_src=with_src)
            if fields.total_bytes <= self.data_bytes:
                return fields
            capacity -= 1
        one_row = intranode.RowFields.of(1, x_bytes, scale_bytes, num_topk, with_src=with_src).total_bytes
        raise _C.GroupMismatchError(
            f"mtdeepep: {what}: every rank has {self.data_bytes} bytes of num_nvl_bytes={self.num_nvl_bytes}, which "
            f"cannot hold one token row; {what} needs at least {one_row} bytes"
        )

    def _plan(self, traffic: torch.Tensor, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool,
              what: str) -> tuple[intranode.RowFields | None, bool]:  # fmt: skip
        """How an operation's rows move (`traffic [R, R]`: rows rank i sends rank j). `(fields, own_apart)`: when
        every receiver's rows fit in its data area, all of them in one round (`own_apart` False); else each rank's
        own rows are copied apart (no peer needs them) and the others move in rounds of `fields.capacity` rows
        (`fields` None: there are none). The same on every rank (it depends on the exchanged counts only)."""
        most = int(traffic.sum(0).max())
        if most == 0:
            return None, False
        fields = intranode.RowFields.of(most, x_bytes, scale_bytes, num_topk, with_src=with_src)
        if fields.total_bytes <= self.data_bytes:
            return fields, False
        most_remote = int(_remote(traffic).sum(0).max())
        if most_remote == 0:
            return None, True
        return self._staging(most_remote, x_bytes, scale_bytes, num_topk, with_src, what), True

    @staticmethod
    def _traffic(rank_prefix_matrix: torch.Tensor) -> torch.Tensor:
        """`[R, R]` int64: rows rank i sends to rank j, from the handle's inclusive prefix over source ranks."""
        prefix = rank_prefix_matrix.long()
        return torch.diff(prefix, dim=0, prepend=torch.zeros_like(prefix[:1]))

    def _checksum(self, rank_prefix_matrix: torch.Tensor) -> int:
        weights = torch.arange(1, rank_prefix_matrix.numel() + 1, dtype=torch.int64)
        return int((rank_prefix_matrix.reshape(-1).long() * weights).sum()) & 0x7FFFFFFF

    def _move_dispatch_rows(self, data, scales, topk_idx, topk_weights, send_head, traffic, experts_per_rank,
                            outputs: tuple, what: str) -> None:  # fmt: skip
        """This rank's rows into every receiver's outputs through the data areas (see `_plan`), round by round:
        round r carries rows `[r * capacity, (r + 1) * capacity)` of each receiver's area order (by source rank, then
        position). `outputs`: `(recv_x, recv_scales, recv_idx, recv_weights, recv_src)`, aliases the worker writes
        through."""
        me = self.rank
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = outputs
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        x_bytes = data.size(1) * data.element_size()
        scale_bytes = 0 if scales is None else scales.size(1) * scales.element_size()
        fields, own_apart = self._plan(traffic, x_bytes, scale_bytes, num_topk, True, what)
        head = send_head.long()
        words, recv_words = intranode.word_view(data), intranode.word_view(recv_x)
        out_start = traffic[:, me].cumsum(0) - traffic[:, me]  # where source i's rows start in this rank's outputs
        if own_apart:  # this rank's rows for itself, straight into its outputs
            own = (head[:, me] >= 0).nonzero().flatten()
            out_rows = out_start[me] + head[own, me]
            recv_words.index_copy_(0, out_rows, words[own])
            if recv_scales is not None:
                recv_scales.index_copy_(0, out_rows, scales[own])
            if recv_src is not None:
                recv_src.index_copy_(0, out_rows, own.to(torch.int32))
            if recv_idx is not None:
                ids = topk_idx[own]
                local = ids - me * experts_per_rank
                is_local = (ids >= 0) & (local >= 0) & (local < experts_per_rank)
                recv_idx.index_copy_(0, out_rows, torch.where(is_local, local, -1))
                if recv_weights is not None:
                    recv_weights.index_copy_(0, out_rows, torch.where(is_local, topk_weights[own].float(), 0.0))
        if fields is None:
            return
        area_traffic = _remote(traffic) if own_apart else traffic
        capacity = fields.capacity
        num_rounds = -(-int(area_traffic.sum(0).max()) // capacity)
        # The host's bookkeeping (traffic, prefixes) is on the CPU; what meets the rows goes to their device.
        recv_offset = area_traffic[:me].sum(0).to(head.device)  # where this rank's rows start in each receiver's area
        dest_row = torch.where(head >= 0, recv_offset + head, -1)  # [T, R]: the row of each receiver's area order
        if own_apart:
            dest_row[:, me] = -1
        # This rank's area order -> its output rows.
        order = torch.cat([torch.arange(int(out_start[i]), int(out_start[i] + area_traffic[i, me]))
                           for i in range(self.num_ranks)]).to(head.device)  # fmt: skip
        for round_ in range(num_rounds):
            lo = round_ * capacity
            in_round = (dest_row >= lo) & (dest_row < lo + capacity)
            tokens = in_round.any(1).nonzero().flatten()
            if tokens.numel():
                # The window of tokens with a row in this round (the interpreter's cost is per token launched).
                window = slice(int(tokens[0]), int(tokens[-1]) + 1)
                round_head = torch.where(in_round, head, -1)[window].to(torch.int32).contiguous()
                intranode.launch_dispatch_send(
                    self.region_table, 0, words[window], None if scales is None else scales[window],
                    None if topk_idx is None else topk_idx[window],
                    None if topk_weights is None else topk_weights[window], round_head,
                    (recv_offset - lo).to(torch.int32), self.num_ranks, experts_per_rank, fields,
                    self.device.type == "cpu", token_base=window.start,
                )  # fmt: skip
            self._signal_and_wait(self.layout_.dispatch_flags, sync.PHASE_DISPATCH_RECEIVE)
            n = min(capacity, order.numel() - lo)
            if n > 0:
                rows = order[lo : lo + n]
                recv_words.index_copy_(0, rows, self._data(fields.x, n * x_bytes).view(words.dtype).view(n, -1))
                if recv_scales is not None:
                    area = self._data(fields.scales, n * scale_bytes).view(scales.dtype)
                    recv_scales.index_copy_(0, rows, area.view(n, scales.size(1)))
                if recv_src is not None:
                    recv_src.index_copy_(0, rows, self._data(fields.src_idx, 4 * n).view(torch.int32))
                if recv_idx is not None:
                    area = self._data(fields.topk_idx, 8 * num_topk * n).view(torch.int64)
                    recv_idx.index_copy_(0, rows, area.view(n, num_topk))
                if recv_weights is not None:
                    area = self._data(fields.topk_weights, 4 * num_topk * n).view(torch.float32)
                    recv_weights.index_copy_(0, rows, area.view(n, num_topk))
            if round_ + 1 < num_rounds:  # every receiver copied this round out before the next one is written
                self._signal_and_wait(self.layout_.round_flags, sync.PHASE_BARRIER)

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
        """Local (no communication): on the caller's thread after `previous`, as the kernel's launch would be."""
        self.status.check()
        if previous is not None:
            previous.wait()
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.num_ranks)
        return per_rank, None, per_expert, in_rank, _done_event(async_finish)

    def dispatch(self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                 expert_alignment, num_worst_tokens, num_channels, previous, async_finish):  # fmt: skip
        R = self.num_ranks
        num_experts = num_tokens_per_expert.numel()
        experts_per_rank = num_experts // R
        if experts_per_rank > intranode.MAX_LOCAL_EXPERTS:
            raise ValueError(
                f"mtdeepep: the triton executor takes at most {intranode.MAX_LOCAL_EXPERTS} experts per rank"
            )
        if num_channels > intranode.MAX_CHANNELS:
            raise ValueError(f"mtdeepep: the triton executor takes at most {intranode.MAX_CHANNELS} channels")

        # `_dispatch` notifies (hands out the outputs) once the counts are exchanged, before the rows move.
        outputs, event = self._run(lambda notify: self._dispatch(
            data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, expert_alignment,
            num_worst_tokens, num_channels, experts_per_rank, notify), previous, async_finish)  # fmt: skip
        return DispatchOutputs(*outputs, event)

    def _dispatch(self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                  expert_alignment, num_worst_tokens, num_channels, experts_per_rank, notify) -> None:  # fmt: skip
        R, me = self.num_ranks, self.rank
        num_tokens, num_experts = data.size(0), num_tokens_per_expert.numel()
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        x_bytes = data.size(1) * data.element_size()
        scale_bytes = 0 if scales is None else scales.size(1) * scales.element_size()

        # Routing: each token's position among the tokens sent to each rank, and the counts per rank and channel.
        in_rank = is_token_in_rank.to(torch.int32)
        # A scan along the tokens as an inner dimension: along dim 0 of [T, R] the GPU scan runs one thread per rank
        # column (380 us at 4096 x 2 on an H200, 11-28); along the inner dimension it is parallel over the tokens.
        positions = in_rank.t().contiguous().cumsum(1).t()
        send_head = torch.where(is_token_in_rank, positions - 1, -1).to(torch.int32)
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
        self._plan(traffic, x_bytes, scale_bytes, num_topk, True, "dispatch")  # raises on every rank before any row

        # The outputs and the handle, handed out before the rows move (written through `.data` aliases).
        rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        recv_x = self.empty((rows, data.size(1)), data.dtype)
        recv_scales = None if scales is None else self.empty((rows, scales.size(1)), scales.dtype)
        recv_src = self.empty((rows,), torch.int32)
        recv_idx = None if num_topk == 0 else self.empty((rows, num_topk), torch.int64)
        recv_weights = None if topk_weights is None else self.empty((rows, num_topk), torch.float32)
        aliases = _unversioned(recv_x, recv_scales, recv_idx, recv_weights, recv_src)
        _fill_padding(aliases, num_recv)
        rank_prefix_matrix = traffic.cumsum(0).to(torch.int32)  # the host's copy (the record's)
        channel_prefix_matrix = channel_counts.cumsum(1).to(torch.int32).contiguous()
        theirs = everyone[:, channels_at : channels_at + num_channels].long()  # source i's channel counts for me
        starts = (rank_prefix_matrix[:, me].long() - traffic[:, me]).unsqueeze(1)
        recv_channel_prefix_matrix = (starts + theirs.cumsum(1) - theirs).to(torch.int32).contiguous()
        counts: list[int] = []
        if num_worst_tokens == 0:
            per_expert = everyone[:, experts_at : experts_at + experts_per_rank].long().sum(0)
            counts = ((per_expert + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
        # The handle's matrices on the device, as DeepEP's; the record keeps the host's copy for the bookkeeping.
        record_state = (rank_prefix_matrix.clone(), send_head.clone())
        rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix = (
            m.to(self.device) for m in (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix)
        )
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src, is_token_in_rank,
                  send_head)  # fmt: skip
        self._seq += 1
        record = DispatchRecord(
            kind=self.handle_kind, group=self.group, uid=self.uid, seq=self._seq, num_tokens=num_tokens,
            num_recv=rows, state=record_state,
        )  # fmt: skip
        attach(rank_prefix_matrix, record)
        notify((recv_x, recv_scales, recv_idx, recv_weights, counts, handle))

        # Phase dispatch: the rows, round by round, into the receivers' areas and out of this rank's.
        self._move_dispatch_rows(data, scales, topk_idx, topk_weights, send_head, traffic, experts_per_rank, aliases,
                                 "dispatch")  # fmt: skip

    def cached_dispatch(self, data, scales, record, num_worst_tokens, num_channels, previous, async_finish, out=None):
        rank_prefix_matrix, send_head = record.state
        traffic = self._traffic(rank_prefix_matrix)
        num_recv = int(traffic[:, self.rank].sum())
        rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        if out is not None:
            recv_x, recv_scales = out
        else:
            recv_x = self.empty((rows, data.size(1)), data.dtype)
            recv_scales = None if scales is None else self.empty((rows, scales.size(1)), scales.dtype)
        x_bytes = data.size(1) * data.element_size()
        scale_bytes = 0 if scales is None else scales.size(1) * scales.element_size()

        self._check_worst(traffic, num_worst_tokens)  # every rank alike, before any communication

        def operation(notify: Callable[[tuple], None]) -> None:
            notify((recv_x, recv_scales))
            op = self._next_op("cached dispatch")
            self._agree(op, [_OP_CACHED_DISPATCH, x_bytes, scale_bytes, num_worst_tokens, record.uid & 0x7FFFFFFF,
                             record.seq, self._checksum(rank_prefix_matrix)], "cached dispatch")  # fmt: skip
            aliases = _unversioned(recv_x, recv_scales, None, None, None)
            _fill_padding(aliases, num_recv)
            self._move_dispatch_rows(data, scales, None, None, send_head, traffic, 0, aliases, "cached dispatch")

        (recv_x, recv_scales), event = self._run(operation, previous, async_finish)
        return recv_x, recv_scales, event

    def combine(self, x, topk_weights, bias0, bias1, record, num_channels, previous, async_finish):
        rank_prefix_matrix, send_head = record.state
        traffic = self._traffic(rank_prefix_matrix)
        num_recv = int(traffic[:, self.rank].sum())
        if x.size(0) < num_recv:
            raise ValueError(f"mtdeepep: x has {x.size(0)} rows but the handle's dispatch received {num_recv}")
        num_tokens, num_topk = record.num_tokens, 0 if topk_weights is None else topk_weights.size(1)
        combined = self.empty((num_tokens, x.size(1)), x.dtype)
        combined_w = None if topk_weights is None else self.empty((num_tokens, num_topk), torch.float32)

        def operation(notify: Callable[[tuple], None]) -> None:
            notify((combined, combined_w))
            self._combine(x, topk_weights, bias0, bias1, record, traffic, *_unversioned(combined, combined_w))

        (combined, combined_w), event = self._run(operation, previous, async_finish)
        return combined, combined_w, event

    def _combine(self, x, topk_weights, bias0, bias1, record, traffic, combined, combined_w) -> None:
        """Every received row goes back to its source, round by round through the sources' data areas (round r:
        rows `[r * capacity, (r + 1) * capacity)` of each source's order, by receiver then position); the source
        sums each token's rows in FP32 (one round: in the kernel with the biases, rounded once; several rounds:
        each round's FP32 partial sums added in FP32, the biases, then rounded once)."""
        R, me = self.num_ranks, self.rank
        rank_prefix_matrix, send_head = record.state
        num_recv = int(traffic[:, me].sum())
        hidden, x_bytes = x.size(1), x.size(1) * x.element_size()
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        op = self._next_op("combine")
        self._agree(op, [_OP_COMBINE, x_bytes, _FLOAT_KIND[x.dtype], num_topk, record.uid & 0x7FFFFFFF, record.seq,
                         self._checksum(rank_prefix_matrix)], "combine")  # fmt: skip
        bias0 = None if bias0 is None else bias0.contiguous()
        bias1 = None if bias1 is None else bias1.contiguous()
        fields, own_apart = self._plan(traffic.T, x_bytes, 0, num_topk, False, "combine")
        head = send_head.long()
        dev = head.device  # the host's bookkeeping is on the CPU: what meets the rows here goes to their device (the
        # launchers move the index tensors they are handed themselves)
        source = torch.repeat_interleave(torch.arange(R), traffic[:, me])  # the source of every received row
        first_row = rank_prefix_matrix[:, me].long() - traffic[:, me]  # where source i's rows start here
        position = torch.arange(num_recv) - first_row[source]
        if not own_apart:
            if fields is None:  # nothing was dispatched anywhere: only the biases
                _finish_sum(torch.zeros(combined.shape, device=dev), bias0, bias1, combined)
                if combined_w is not None:
                    combined_w.zero_()
                return
            # One round: each source gets back, in its area, the rows of every receiver j at (rows it sent to ranks
            # < j) + position; the kernel sums them with the biases and rounds once.
            dst_row = traffic[:, :me].sum(1)[source] + position
            intranode.launch_combine_send(
                self.region_table, 0, intranode.word_view(x[:num_recv]),
                None if topk_weights is None else topk_weights[:num_recv].contiguous().float(),
                source.to(torch.int32), dst_row.to(torch.int32), fields, self.device.type == "cpu",
            )  # fmt: skip
            self._signal_and_wait(self.layout_.combine_flags, sync.PHASE_COMBINE_RECEIVE)
            send_offset = traffic[me].cumsum(0) - traffic[me]
            area_x, area_w = self._combine_area(fields, x.dtype, hidden, num_topk)
            intranode.launch_combine_reduce(
                area_x, area_w, send_head.contiguous(), send_offset.to(torch.int32), bias0, bias1, combined,
                combined_w, self.device.type == "cpu",
            )  # fmt: skip
            return

        # Rounds: this rank's own rows are summed here; the others go back through the sources' areas (each
        # source's area order: by receiver j, then position), and each round's FP32 partial sums are added up.
        acc = torch.zeros(combined.shape, dtype=torch.float32, device=dev)
        acc_w = None if combined_w is None else torch.zeros(combined_w.shape, dtype=torch.float32, device=dev)
        own_tokens = (head[:, me] >= 0).nonzero().flatten()  # in position order
        own_rows = slice(int(first_row[me]), int(first_row[me] + traffic[me, me]))
        acc.index_add_(0, own_tokens, x[own_rows].float())
        if acc_w is not None:
            acc_w.index_add_(0, own_tokens, topk_weights[own_rows].float())
        if fields is not None:
            remote = _remote(traffic)
            capacity = fields.capacity
            num_rounds = -(-int(remote.sum(1).max()) // capacity)
            dst_row = torch.where(source != me, remote[:, :me].sum(1)[source] + position, -1).to(dev)
            source_on_dev = source.to(dev, torch.int32)
            send_offset = (remote[me].cumsum(0) - remote[me]).to(dev)  # where receiver j's rows start in my area
            area_x, area_w = self._combine_area(fields, x.dtype, hidden, num_topk)
            round_rows = send_offset + head
            in_area = head >= 0
            in_area[:, me] = False
            for round_ in range(num_rounds):
                lo = round_ * capacity
                picked = ((dst_row >= lo) & (dst_row < lo + capacity)).nonzero().flatten()
                if picked.numel():
                    intranode.launch_combine_send(
                        self.region_table, 0, intranode.word_view(x[picked]),
                        None if topk_weights is None else topk_weights[picked].float(),
                        source_on_dev[picked], (dst_row[picked] - lo).to(torch.int32), fields,
                        self.device.type == "cpu",
                    )  # fmt: skip
                self._signal_and_wait(self.layout_.combine_flags, sync.PHASE_COMBINE_RECEIVE)
                in_round = in_area & (round_rows >= lo) & (round_rows < lo + capacity)
                tokens = in_round.any(1).nonzero().flatten()
                if tokens.numel():  # only the tokens with a row in this round (the interpreter's cost is per token)
                    round_head = torch.where(in_round, head, -1)[tokens].to(torch.int32).contiguous()
                    partial = torch.empty((tokens.numel(), hidden), dtype=torch.float32, device=dev)
                    partial_w = None if acc_w is None else torch.empty((tokens.numel(), num_topk), dtype=torch.float32,
                                                                       device=dev)  # fmt: skip
                    intranode.launch_combine_reduce(
                        area_x, area_w, round_head, (send_offset - lo).to(torch.int32), None, None, partial,
                        partial_w, self.device.type == "cpu",
                    )  # fmt: skip
                    acc.index_add_(0, tokens, partial)
                    if acc_w is not None:
                        acc_w.index_add_(0, tokens, partial_w)
                if round_ + 1 < num_rounds:  # this rank summed the round before the next one is written
                    self._signal_and_wait(self.layout_.round_flags, sync.PHASE_BARRIER)
        _finish_sum(acc, bias0, bias1, combined)
        if combined_w is not None:
            combined_w.copy_(acc_w)

    def _combine_area(self, fields: intranode.RowFields, dtype: torch.dtype, hidden: int, num_topk: int):
        """This rank's data area as the rows a combine sends back: `(x [capacity, hidden], weights or None)`."""
        capacity = fields.capacity
        area_x = self._data(fields.x, capacity * hidden * dtype.itemsize).view(dtype).view(capacity, hidden)
        if num_topk == 0:
            return area_x, None
        return area_x, self._data(fields.topk_weights, 4 * num_topk * capacity).view(torch.float32).view(-1, num_topk)

    def recv_sources(self, handle):
        return intranode_recv_sources(handle, self.rank, self.num_ranks)

    # ---- low-latency mode: mtdeepep.kernels.low_latency on the runtime's low-latency areas ----

    def _ll(self) -> LowLatencyKernels:
        if self.low_latency is None:
            raise ValueError("mtdeepep: low-latency calls need a buffer made with low_latency_mode=True")
        self._drain()  # the normal-mode operations queued before this call first (one kernel thread at a time)
        return self.low_latency

    def ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats,
                    use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):  # fmt: skip
        recv_x, recv_scales, recv_count, src_info, layout_range, seq, hook = self._ll().dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats, use_fp8,
            round_scale, use_ue8m0, return_recv_hook,
        )  # fmt: skip
        handle = low_latency_handle(self, src_info, layout_range, seq, x, num_max_dispatch_tokens_per_rank, num_experts)
        return (
            recv_x,
            recv_scales,
            recv_count,
            handle,
            _done_event(async_finish and hook is None),
            hook,
        )

    def ll_combine(self, x, topk_idx, topk_weights, record, handle, zero_copy, async_finish, return_recv_hook, out,
                   wait_stats):  # fmt: skip
        src_info, layout_range, num_max_dispatch_tokens_per_rank, _, num_experts = handle
        combined, hook = self._ll().combine(
            x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank, num_experts,
            record.uid, record.seq, zero_copy, return_recv_hook, out, wait_stats,
        )  # fmt: skip
        return combined, _done_event(async_finish and hook is None), hook

    def ll_clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        self._ll().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def ll_next_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        return self._ll().next_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)


def _done_event(async_finish: bool):
    """A completed event for a call that finished on the caller's thread (None without async_finish)."""
    return _C.EventHandle() if async_finish else None


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _unversioned(*outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Aliases of outputs handed to the caller before the worker writes them, as a comm stream writes through
    pointers: the same memory under a version counter of their own (`Tensor.data`), so autograd never sees an in-place
    change of what the caller holds (see mtdeepep.engines.internode's `_unversioned`)."""
    return tuple(None if output is None else output.data for output in outputs)


def _fill_padding(outputs: tuple, num_recv: int) -> None:
    """The rows past `num_recv` (num_worst_tokens): x and scales 0, top-k ids and source index -1, weights 0."""
    recv_x, recv_scales, recv_idx, recv_weights, recv_src = outputs
    for tensor, fill in ((recv_x, 0), (recv_scales, 0), (recv_idx, -1), (recv_weights, 0), (recv_src, -1)):
        if tensor is not None and tensor.size(0) > num_recv:
            tensor[num_recv:] = fill


def _remote(traffic: torch.Tensor) -> torch.Tensor:
    """`traffic` without each rank's rows for itself (the diagonal): the rows that cross between ranks."""
    return traffic * (1 - torch.eye(traffic.size(0), dtype=traffic.dtype))


def _finish_sum(acc: torch.Tensor, bias0, bias1, out: torch.Tensor) -> None:
    """`acc` (FP32 sums) plus the biases in FP32, rounded once into `out` (round to nearest even)."""
    if bias0 is not None:
        acc += bias0.float()
    if bias1 is not None:
        acc += bias1.float()
    out.copy_(acc)
