"""The CUDA (and MUSA) executor: the ranks of one node exchange rows through device buffers opened with CUDA IPC.

`mtdeepep._C_cuda` (csrc/runtime/cuda/, csrc/kernels/cuda/) owns the raw device memory, its IPC handles and the
kernel launchers, which take addresses and streams as integers; this module keeps everything else in torch: output
tensors from the caching allocator, the communication stream, events (`async_finish`, `previous_event`), the
receive hooks of low-latency mode, and the translation of the device status word into `CommTimeoutError` /
`CommError`.

Streams: normal-mode calls run on the engine's communication stream after `previous_event` (or after the caller's
current stream); without `async_finish` the current stream waits for them (no host synchronisation). Low-latency
calls run on the current stream, as upstream, or on the communication stream with `async_finish`.

Host synchronisation: only a normal dispatch that does not fix its receive size waits for the count exchange (to
size its outputs and return the per-expert counts, as upstream). With `num_worst_tokens > 0` nothing waits: the
outputs have `num_worst_tokens` rows (padding rows: `recv_topk_idx` -1, `recv_src_idx` -1), so dispatch and combine
can be captured in a CUDA graph: the kernels number the operations on the device, so each replay is a new operation
(the argument checks skip reading values while a capture runs). Low-latency calls number their calls on the host
(double buffering): they are not graph-capturable on this executor.

Failures: every device wait is bounded by the buffer's timeout; a wait that runs out records (kind, phase, peer,
rank) in a host-mapped word and stops this rank's peers too (their words then carry it as the cause). Every call,
event wait or query checks that word and raises `CommTimeoutError` naming the rank that did not arrive and the phase
(on every rank: also on those stopped by the first rank's timeout), or `CommError`; the buffer is unusable
afterwards (as the CPU runtime after a normal-mode failure). Two failures leave it usable, as on the CPU executor:
a receiver over `num_worst_tokens` (`GroupMismatchError`) and a receiver over the receive region (`CommError`).
Every rank finds them in the same traffic matrix before any row moves; a dispatch that sizes its outputs by the
counts raises them in the call, one with `num_worst_tokens` (no host synchronisation) at the buffer's next call or
event wait.

Single-process mode (`connect_local`, used by `mtdeepep.utils.local_ranks`): the engines of all ranks live in one
process on one GPU, their peer tables filled with each other's device pointers; the same kernels then run
concurrently on the ranks' streams.
"""

from __future__ import annotations

import os
import threading

import torch

from .. import _C
from .base import DispatchOutputs, Engine
from .handles import DispatchRecord, attach, intranode_recv_sources, low_latency_handle

try:
    from .. import _C_cuda
except ImportError:  # a CPU build: the registry (mtdeepep.engines) offers no GPU executor
    _C_cuda = None

# torch's module for the device: torch.cuda, or torch.musa (torch_musa mirrors its API) for a MUSA build.
_gpu = getattr(torch, _C_cuda.platform) if _C_cuda is not None and hasattr(torch, _C_cuda.platform) else torch.cuda

_FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class _DeviceMemory:
    """A device address range as `__cuda_array_interface__`, so that `torch.as_tensor` views it without a copy; the
    view keeps this object (and through it the engine's buffer) alive."""

    def __init__(self, owner: object, address: int, num_bytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def _view(owner: object, address: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    if num_bytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.as_tensor(_DeviceMemory(owner, address, num_bytes), dtype=torch.uint8, device=device)


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


class CudaEvent:
    """The completion of a call on the communication stream. `wait()` makes the caller's current stream wait (the
    host does not block, as upstream's `current_stream_wait`); both `wait()` and `query()` raise the device error of
    the buffer, if any."""

    def __init__(self, engine: CudaEngine, event: torch.cuda.Event) -> None:
        self.engine, self.event = engine, event

    def wait(self) -> None:
        self.engine.check()
        _gpu.current_stream(self.engine.device).wait_event(self.event)

    def query(self) -> bool:
        done = self.event.query()
        self.engine.check()
        return done

    def synchronize(self) -> None:
        self.event.synchronize()
        self.engine.check()


_claimed_streams: dict[int, int] = {}  # stream id -> live holders (engines, LocalRanks) in this process
_claims_lock = threading.Lock()


def claim_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of torch's pool that no other live engine of this process holds. torch hands its pool streams out
    round-robin (32 per priority), so the 33rd stream drawn is the first again: two ranks of one process whose
    communication streams coincided would queue one rank's wait for a peer in front of that peer's own kernels."""
    with _claims_lock:
        for _ in range(128):
            stream = _gpu.Stream(device)
            if stream.stream_id not in _claimed_streams:
                break
        else:
            raise _C.CommError("mtdeepep: every stream of torch's pool is held by a live mtdeepep engine")
        _claimed_streams[stream.stream_id] = 1
        return stream


def release_stream(stream: torch.cuda.Stream) -> None:
    with _claims_lock:
        _claimed_streams.pop(stream.stream_id, None)


class LocalGroup:
    """The engines of ranks that share one process and one GPU (single-process mode). Their device memory is
    released when the last of them is destroyed, once the device finished every rank's work: the other ranks'
    kernels read and write each rank's memory, and the ranks may be destroyed one by one from one thread (a
    destroy that waited for the others, as the multi-process barrier does, would wait for ranks not yet called)."""

    def __init__(self, engines: list[CudaEngine]) -> None:
        self.engines = engines
        self._released: set[int] = set()
        self._lock = threading.Lock()

    def release(self, engine: CudaEngine) -> None:
        with self._lock:
            self._released.add(engine.rank)
            last = len(self._released) == len(self.engines)
        if last:
            _gpu.synchronize(engine.device)
            for member in self.engines:
                member.buffer.destroy()
                release_stream(member.comm_stream)


class CudaEngine(Engine):
    """Normal and low-latency mode for the `num_ranks` ranks of one node, each on a GPU (several ranks may share one:
    IPC works between processes on the same device)."""

    handle_kind = "intranode"

    def __init__(self, *, rank: int, num_ranks: int, num_nvl_bytes: int, num_ll_bytes: int, timeout_s: float) -> None:
        if _C_cuda is None:
            raise _C.CommError("mtdeepep: this build has no CUDA executor (mtdeepep._C_cuda is missing)")
        self.rank, self.num_ranks = rank, num_ranks
        self.num_nodes, self.num_ranks_per_node = 1, num_ranks
        self.device = torch.device(_C_cuda.platform, _gpu.current_device())
        self.buffer = _C_cuda.DeviceBuffer(rank, num_ranks, num_nvl_bytes, num_ll_bytes, timeout_s, self.device.index)
        self.comm_stream = claim_stream(self.device)
        self.num_device_sms = self.buffer.num_sms
        self.uid = 0
        self.group: tuple[tuple[int, ...], int] = ((), rank)
        self._seq = 0  # dispatch identities (the kernels number the operations themselves, on the device)
        self._ll_seq = 0  # low-latency calls
        self._hook_pending = [False, False]  # per half: a hook-mode call whose receive has not run
        self._combine_buffers: list[torch.Tensor] = []
        self._zero_copy_combines = 0
        self._failed: BaseException | None = None
        self._creator_pid = os.getpid()
        self._local: LocalGroup | None = None  # single-process mode
        self._destroyed = False
        self._load_torch_kernels()

    def _load_torch_kernels(self) -> None:
        """Runs once, now, the torch operations this engine issues between its waiting kernels (the channel prefix,
        the handle copies, the zeroing of the low-latency control area), so that under CUDA's lazy module loading
        none of them is loaded at a first launch while this process's kernels wait for peers: such a load
        synchronises the context, which then waits for those kernels (see `load_all_kernels` in api.hpp; the
        executor's own kernels are loaded by DeviceBuffer)."""
        with _gpu.stream(self.comm_stream):
            send_head = torch.full((3, self.num_ranks), -1, dtype=torch.int32, device=self.device)
            prefix = self._channel_prefix(send_head, 2)
            torch.empty_like(prefix).copy_(prefix)
            torch.empty(16, dtype=torch.uint8, device=self.device).zero_()
        self.comm_stream.synchronize()

    # ---- set-up and lifetime ----

    def setup_entry(self) -> str:
        return self.buffer.ipc_entry()

    def connect(self, entries: list[str], uid: int, group: tuple[tuple[int, ...], int], *, low_latency: bool) -> None:
        self.buffer.connect(list(entries))
        self.uid, self.group = uid, group

    def connect_local(self, local: LocalGroup, uid: int) -> None:
        """Single-process mode: `local.engines[r]` is rank r's engine in this process, on this engine's device."""
        engines = local.engines
        if [e.rank for e in engines] != list(range(self.num_ranks)) or engines[self.rank] is not self:
            raise ValueError("mtdeepep: connect_local needs every rank's engine, in rank order")
        if any(e.device != self.device for e in engines):
            raise ValueError("mtdeepep: the ranks of one process must share one device")
        self.buffer.connect_local([e.buffer.nvl_address for e in engines], [e.buffer.ll_address for e in engines])
        self.uid, self.group, self._local = uid, (tuple(range(self.num_ranks)), self.rank), local

    def set_timeout(self, timeout_s: float) -> None:
        self.buffer.set_timeout(timeout_s)

    def interrupt(self, reason: str) -> None:
        self.buffer.abort()
        self._failed = _C.CommError(f"mtdeepep: rank {self.rank} was interrupted: {reason}")

    def check(self) -> None:
        """Raises the device error of this buffer (a bounded wait that ran out, a stopped peer), if any."""
        if self._failed is not None:
            raise self._failed
        if self._destroyed or self.buffer.destroyed:
            raise _C.CommError("mtdeepep: the buffer was destroyed")
        code = self.buffer.status()
        if code == 0:
            return
        cause = self.buffer.cause()
        message = _C_cuda.error_message(code, cause, self.buffer.detail(0), self.buffer.detail(1))
        kind = _C_cuda.error_kind(code)
        if _C_cuda.is_recoverable(code):
            # Every rank found it before any row moved: clear it once the failed operation's kernels are done.
            if not _gpu.is_current_stream_capturing():
                self.buffer.clear_error(self.comm_stream.cuda_stream)
            raise (_C.GroupMismatchError if kind == _C_cuda.ERROR_WORST_TOKENS else _C.CommError)(message)
        timed_out = kind == _C_cuda.ERROR_TIMEOUT or (
            kind == _C_cuda.ERROR_PEER_FAILED and cause != 0 and _C_cuda.error_kind(cause) == _C_cuda.ERROR_TIMEOUT
        )
        self._failed = (_C.CommTimeoutError if timed_out else _C.CommError)(message)
        raise self._failed

    def debug_state(self) -> str:
        """This rank's device-side protocol state, for a failure report: its status word's message, its operation
        counter and the flags its peers set in its normal buffer (notify, barrier, dispatch, combine), the arrival
        counters. Read with a copy on a stream of its own (works while the communication stream is stuck)."""
        if self.buffer.destroyed:
            return f"rank {self.rank}: destroyed"
        layout = _C_cuda.normal_layout(self.num_ranks)
        side = _gpu.Stream(self.device)
        with _gpu.stream(side):
            control = _view(self, self.buffer.nvl_address, layout["control_bytes"], self.device).cpu()
        words = control.view(torch.int64)
        R = self.num_ranks

        def flags(name: str) -> list[int]:
            return words[layout[name] // 8 : layout[name] // 8 + R].tolist()

        arrivals = control[layout["arrivals"] : layout["arrivals"] + 8].view(torch.int32).tolist()
        code = self.buffer.status()
        message = _C_cuda.error_message(code, self.buffer.cause()) if code else "ok"
        op, poison = words[layout["op_counter"] // 8].item(), words[layout["poison"] // 8].item()
        return (f"rank {self.rank}: status: {message}; op {op}; notify {flags('notify_flags')} barrier "
                f"{flags('barrier_flags')} dispatch {flags('dispatch_flags')} combine {flags('combine_flags')}; "
                f"arrivals {arrivals}; poison {poison}")  # fmt: skip

    def destroy(self) -> None:
        if os.getpid() != self._creator_pid or self.buffer.destroyed or self._destroyed:
            return  # a forked child: CUDA state does not survive fork; the parent releases
        self._destroyed = True
        if self._local is not None:
            self._local.release(self)
            return
        if self.buffer.connected and self._failed is None and self.buffer.status() == 0:
            # Every rank stops using the others' memory before any frees its own: the barrier runs after this rank's
            # queued work on both streams (low-latency calls run on the caller's current stream).
            try:
                self.comm_stream.wait_stream(_gpu.current_stream(self.device))
                self.buffer.barrier(self.comm_stream.cuda_stream)
                self.comm_stream.synchronize()
            except Exception:  # noqa: BLE001 - destroy goes on; the barrier is bounded on the device anyway
                pass
        self.buffer.destroy()
        release_stream(self.comm_stream)

    def empty(self, sizes, dtype):
        return torch.empty(tuple(sizes), dtype=dtype, device=self.device)

    def local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        self.check()
        if use_rdma_buffer:
            if self.buffer.num_ll_bytes == 0:
                raise ValueError(
                    "mtdeepep: this buffer has no RDMA region (num_rdma_bytes is used by low-latency mode)"
                )
            address, num_bytes = self.buffer.ll_address, self.buffer.num_ll_bytes
        else:
            address, num_bytes = self.buffer.nvl_data_address, self.buffer.num_nvl_bytes
        element = torch.empty(0, dtype=dtype).element_size()
        if offset < 0 or offset * element > num_bytes:
            raise ValueError(f"mtdeepep: offset {offset} is outside the {num_bytes}-byte buffer")
        region = _view(
            self, address + offset * element, (num_bytes - offset * element) // element * element, self.device
        )
        return region.view(dtype)

    # ---- streams ----

    def _num_sms(self, num_channels: int) -> int:
        return max(1, min(2 * num_channels, self.num_device_sms))

    def _begin(self, previous) -> torch.cuda.Stream:
        """Checks the buffer, orders the communication stream after `previous` (or the current stream)."""
        self.check()
        if previous is None:
            self.comm_stream.wait_stream(_gpu.current_stream(self.device))
        elif isinstance(previous, CudaEvent):
            self.comm_stream.wait_event(previous.event)
        elif isinstance(previous, _gpu.Event):
            self.comm_stream.wait_event(previous)
        else:
            previous.wait()  # a completed CPU event (EventHandle()): nothing on the device to wait for
            self.comm_stream.wait_stream(_gpu.current_stream(self.device))
        return self.comm_stream

    def _finish(self, stream: torch.cuda.Stream, async_finish: bool, tensors: tuple) -> CudaEvent | None:
        """Records the completion; the caller's current stream waits for it unless `async_finish` (then the tensors
        used on the stream are marked as in use by it, for the caching allocator)."""
        event = _gpu.Event()
        event.record(stream)
        current = _gpu.current_stream(self.device)
        if stream == current:
            return CudaEvent(self, event) if async_finish else None
        if not async_finish:
            # The caller's stream continues after the communication: its tensors are safe to free from there.
            current.wait_event(event)
            return None
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == self.device.type:
                tensor.record_stream(stream)
        return CudaEvent(self, event)

    def _next_seq(self) -> int:
        """The identity of a dispatch (its record); the kernels number operations on the device (graph replays)."""
        self._seq += 1
        return self._seq

    # ---- normal mode ----

    def layout(self, topk_idx, num_experts, previous, async_finish):
        stream = self._begin(previous)
        num_tokens, num_topk = topk_idx.shape
        per_rank = torch.empty(self.num_ranks, dtype=torch.int32, device=self.device)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        in_rank = torch.empty((num_tokens, self.num_ranks), dtype=torch.bool, device=self.device)
        _C_cuda.dispatch_layout(
            _ptr(topk_idx), num_tokens, num_topk, self.num_ranks, num_experts, per_rank.data_ptr(),
            per_expert.data_ptr(), _ptr(in_rank), self.num_device_sms, stream.cuda_stream,
        )  # fmt: skip
        event = self._finish(stream, async_finish, (topk_idx, per_rank, per_expert, in_rank))
        return per_rank, None, per_expert, in_rank, event

    @staticmethod
    def _format(data: torch.Tensor, scales: torch.Tensor | None, num_topk: int) -> tuple[int, int, int, int]:
        """(x_bytes, num_scales, scale_bytes, num_topk): the row format every rank derives the same way."""
        num_scales = 0 if scales is None else scales.size(1)
        scale_bytes = 4 if scales is None else scales.element_size()
        return data.size(1) * data.element_size(), num_scales, scale_bytes, num_topk

    def _send(self, stream, data, scales, topk_idx, topk_weights, num_experts, fmt, send_head, prefix, num_worst_tokens,
              num_sms):  # fmt: skip
        x_bytes, num_scales, scale_bytes, num_topk = fmt
        scale_strides = (0, 0) if scales is None else scales.stride()
        self.buffer.dispatch_send(
            _ptr(data), data.stride(0) * data.element_size(), x_bytes, _ptr(scales), scale_strides[0],
            scale_strides[1], num_scales, scale_bytes, _ptr(topk_idx), _ptr(topk_weights), num_topk, data.size(0),
            num_experts, _ptr(send_head), prefix.data_ptr(), num_worst_tokens, num_sms, stream.cuda_stream,
        )  # fmt: skip

    def _receive(self, stream, data, scales, fmt, prefix, rows, with_topk, with_weights, num_sms):
        x_bytes, num_scales, scale_bytes, num_topk = fmt
        recv_x = torch.empty((rows, data.size(1)), dtype=data.dtype, device=self.device)
        recv_scales = None
        if scales is not None:
            recv_scales = torch.empty((rows, num_scales), dtype=scales.dtype, device=self.device)
        recv_idx = torch.empty((rows, num_topk), dtype=torch.int64, device=self.device) if with_topk else None
        recv_weights = torch.empty((rows, num_topk), dtype=torch.float32, device=self.device) if with_weights else None
        recv_src = torch.empty(rows, dtype=torch.int32, device=self.device)
        self.buffer.dispatch_receive(
            x_bytes, num_scales, scale_bytes, num_topk, prefix.data_ptr(), _ptr(recv_x), _ptr(recv_scales),
            _ptr(recv_idx), _ptr(recv_weights), _ptr(recv_src), rows, num_sms, stream.cuda_stream,
        )  # fmt: skip
        return recv_x, recv_scales, recv_idx, recv_weights, recv_src

    def _channel_prefix(self, send_head: torch.Tensor, num_channels: int) -> torch.Tensor:
        """`[R, C]` int32: tokens sent to each rank from channels <= c (channel c: tokens [c * per, (c + 1) * per), as
        the CPU executor splits them), computed on the device (no synchronisation). Run it on the stream that wrote
        `send_head`."""
        num_tokens = send_head.size(0)
        per = max(1, -(-num_tokens // num_channels))
        sent = (send_head >= 0).to(torch.int32)
        padded = torch.zeros((per * num_channels, self.num_ranks), dtype=torch.int32, device=self.device)
        padded[:num_tokens] = sent
        return padded.view(num_channels, per, self.num_ranks).sum(1).cumsum(0).t().contiguous().to(torch.int32)

    def dispatch(self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                 expert_alignment, num_worst_tokens, num_channels, previous, async_finish):  # fmt: skip
        stream = self._begin(previous)
        num_tokens, num_experts, R = data.size(0), num_tokens_per_expert.numel(), self.num_ranks
        num_local = num_experts // R
        if num_local > _C_cuda.max_local_experts:
            raise ValueError(f"mtdeepep: the CUDA executor takes at most {_C_cuda.max_local_experts} experts per rank")
        num_sms = self._num_sms(num_channels)
        channels = max(1, min(num_channels, _C_cuda.max_channels))
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        fmt = self._format(data, scales, num_topk)
        capacity = _C_cuda.normal_capacity(R, self.buffer.num_nvl_bytes, *fmt)
        # Everything is allocated from the caller's stream (the caching allocator's stream of the outputs); the
        # work, torch ops included, runs on the communication stream.
        send_head = torch.empty((num_tokens, R), dtype=torch.int32, device=self.device)
        num_sent = torch.empty(R, dtype=torch.int32, device=self.device)
        prefix = torch.empty((R, R), dtype=torch.int32, device=self.device)
        channel_prefix = torch.empty((R, channels), dtype=torch.int32, device=self.device)
        recv_channel_prefix = torch.empty((R, channels), dtype=torch.int32, device=self.device)
        recv_per_expert = torch.empty(num_local, dtype=torch.int32, device=self.device)
        state = (torch.empty_like(prefix), torch.empty_like(send_head))
        seq = self._next_seq()
        if num_worst_tokens == 0:
            self.buffer.reset_host_counts()
        _C_cuda.send_positions(_ptr(is_token_in_rank), num_tokens, R, _ptr(send_head), num_sent.data_ptr(),
                               stream.cuda_stream)  # fmt: skip
        with _gpu.stream(stream):
            channel_prefix.copy_(self._channel_prefix(send_head, channels))
        self.buffer.notify(
            num_sent.data_ptr(), num_tokens_per_expert.data_ptr(), num_experts, channel_prefix.data_ptr(),
            channels, expert_alignment, capacity, num_worst_tokens, prefix.data_ptr(), recv_channel_prefix.data_ptr(),
            recv_per_expert.data_ptr(), stream.cuda_stream,
        )  # fmt: skip
        if num_worst_tokens > 0:
            rows, counts = num_worst_tokens, []
        else:
            # The one host synchronisation: the outputs' size and the per-expert counts (upstream does the same).
            stream.synchronize()
            self.check()
            rows, counts = self.buffer.host_counts(num_local)
        self._send(stream, data, scales, topk_idx, topk_weights, num_experts, fmt, send_head, prefix, num_worst_tokens,
                   num_sms)  # fmt: skip
        recv_x, recv_scales, recv_idx, recv_weights, recv_src = self._receive(
            stream, data, scales, fmt, prefix, rows, topk_idx is not None, topk_weights is not None, num_sms
        )
        with _gpu.stream(stream):  # private copies for combine and cached dispatch, whatever happens to the handle
            state[0].copy_(prefix)
            state[1].copy_(send_head)
        handle = (prefix, channel_prefix, recv_channel_prefix, recv_src, is_token_in_rank, send_head)
        record = DispatchRecord(
            kind=self.handle_kind, group=self.group, uid=self.uid, seq=seq, num_tokens=num_tokens, num_recv=rows,
            state=state,
        )  # fmt: skip
        attach(prefix, record)
        event = self._finish(
            stream, async_finish,
            (data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, send_head, num_sent,
             prefix, channel_prefix, recv_channel_prefix, recv_per_expert, recv_x, recv_scales, recv_idx,
             recv_weights, recv_src, *state),
        )  # fmt: skip
        return DispatchOutputs(recv_x, recv_scales, recv_idx, recv_weights, counts, handle, event)

    def cached_dispatch(self, data, scales, record, num_worst_tokens, num_channels, previous, async_finish, out=None):
        stream = self._begin(previous)
        prefix, send_head = record.state
        num_sms = self._num_sms(num_channels)
        # The receive regions' capacity is checked on the device, for every receiver alike (ErrorKind.kOverflow).
        fmt = self._format(data, scales, 0)
        rows = num_worst_tokens if num_worst_tokens > 0 else record.num_recv
        self.buffer.barrier(stream.cuda_stream)
        self._send(stream, data, scales, None, None, self.num_ranks, fmt, send_head, prefix, num_worst_tokens, num_sms)
        recv_x, recv_scales, _, _, recv_src = self._receive(
            stream, data, scales, fmt, prefix, rows, False, False, num_sms
        )
        event = self._finish(stream, async_finish, (data, scales, prefix, send_head, recv_x, recv_scales, recv_src))
        return recv_x, recv_scales, event

    def combine(self, x, topk_weights, bias0, bias1, record, num_channels, previous, async_finish):
        # Copies on the caller's stream first: the communication stream is ordered after them by _begin.
        bias0 = None if bias0 is None else bias0.contiguous()
        bias1 = None if bias1 is None else bias1.contiguous()
        stream = self._begin(previous)
        prefix, send_head = record.state
        num_sms = self._num_sms(num_channels)
        kind = _FLOAT_KIND[x.dtype]
        hidden, num_topk = x.size(1), 0 if topk_weights is None else topk_weights.size(1)
        combined = torch.empty((record.num_tokens, hidden), dtype=x.dtype, device=self.device)
        combined_weights = None
        if topk_weights is not None:
            combined_weights = torch.empty((record.num_tokens, num_topk), dtype=torch.float32, device=self.device)
        self.buffer.barrier(stream.cuda_stream)
        self.buffer.combine_send(
            kind, hidden, num_topk, _ptr(x), _ptr(topk_weights), prefix.data_ptr(), num_sms, stream.cuda_stream
        )
        self.buffer.combine_reduce(
            kind, hidden, num_topk, _ptr(x), _ptr(topk_weights), prefix.data_ptr(), _ptr(send_head),
            record.num_tokens, _ptr(bias0), _ptr(bias1), _ptr(combined), _ptr(combined_weights), num_sms,
            stream.cuda_stream,
        )  # fmt: skip
        event = self._finish(
            stream, async_finish, (x, topk_weights, bias0, bias1, prefix, send_head, combined, combined_weights)
        )
        return combined, combined_weights, event

    def recv_sources(self, handle):
        return intranode_recv_sources(handle, self.rank, self.num_ranks)

    # ---- low-latency mode ----

    def _ll_layout(self, num_max_tokens: int, hidden: int, num_experts: int) -> dict:
        layout = _C_cuda.low_latency_layout(num_max_tokens, hidden, self.num_ranks, num_experts)
        if self.buffer.num_ll_bytes == 0:
            raise ValueError("mtdeepep: low-latency calls need num_rdma_bytes > 0")
        if layout["half_bytes"] > self.buffer.ll_half_bytes:
            raise ValueError(
                f"mtdeepep: num_rdma_bytes={self.buffer.num_ll_bytes} is too small for these low-latency calls; use "
                "Buffer.get_low_latency_rdma_size_hint(...)"
            )
        return layout

    def _ll_begin(self, hook_mode: bool) -> int:
        """The next call number; refuses a call whose half still belongs to a hook that was not called."""
        self.check()
        seq = self._ll_seq + 1
        if self._hook_pending[seq % 2]:
            raise ValueError(
                "mtdeepep: the receive hook of the low-latency call two calls back was not called yet (its half of "
                "the buffer is still in use); call it first"
            )
        self._ll_seq = seq
        self._hook_pending[seq % 2] = hook_mode
        return seq

    def _ll_stream(self, async_finish: bool) -> torch.cuda.Stream:
        if not async_finish:
            return _gpu.current_stream(self.device)
        self.comm_stream.wait_stream(_gpu.current_stream(self.device))
        return self.comm_stream

    def _half_view(self, seq: int, layout: dict) -> tuple[torch.Tensor, int]:
        base = self.buffer.ll_address + layout["control_bytes"] + (seq % 2) * self.buffer.ll_half_bytes
        return _view(self, base, self.buffer.ll_half_bytes, self.device), base

    def ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats,
                    use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):  # fmt: skip
        T = num_max_dispatch_tokens_per_rank
        num_tokens, hidden = x.shape
        num_topk, R = topk_idx.size(1), self.num_ranks
        num_local = num_experts // R
        rows = R * T
        layout = self._ll_layout(T, hidden, num_experts)
        seq = self._ll_begin(return_recv_hook)
        stream = self._ll_stream(async_finish)
        half, _ = self._half_view(seq, layout)
        slots = torch.empty((num_tokens, num_topk), dtype=torch.int32, device=self.device)
        expert_counts = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        expert_begin = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        recv_count = torch.empty(num_local, dtype=torch.int32, device=self.device)
        src_info = torch.empty((num_local, rows), dtype=torch.int32, device=self.device)
        layout_range = torch.empty((num_local, R), dtype=torch.int64, device=self.device)
        self.buffer.ll_enter(seq, stream.cuda_stream)
        self.buffer.ll_dispatch_send(
            seq, _ptr(x), x.stride(0), _ptr(topk_idx), num_tokens, num_topk, hidden, T, num_experts, use_fp8,
            round_scale, use_ue8m0, _ptr(slots), expert_counts.data_ptr(), expert_begin.data_ptr(),
            self.num_device_sms, stream.cuda_stream,
        )  # fmt: skip

        def field(offset: int, num_bytes: int) -> torch.Tensor:
            return half[offset : offset + num_bytes]

        def receive(on: torch.cuda.Stream) -> None:
            self.buffer.ll_dispatch_receive(
                seq, T, hidden, num_experts, recv_count.data_ptr(), _ptr(cumulative_stats), _ptr(wait_stats),
                on.cuda_stream,
            )  # fmt: skip
            # The handle keeps copies: the half is rewritten two calls later, the combine may come after that.
            with _gpu.stream(on):
                src_info.copy_(field(layout["src_info"], 4 * num_local * rows).view(torch.int32).view(num_local, rows))
                layout_range.copy_(
                    field(layout["layout_range"], 8 * num_local * R).view(torch.int64).view(num_local, R)
                )

        if use_fp8:
            recv_x = field(layout["recv_x"], num_local * rows * hidden).view(torch.float8_e4m3fn)
            recv_x = recv_x.view(num_local, rows, hidden)
            num_scales = layout["num_scales"]
            if use_ue8m0:
                packed = -(-num_scales // 4)
                scales = field(layout["scales"], 4 * num_local * packed * rows).view(torch.int32)
                recv_scales = scales.view(num_local, packed, rows).transpose(1, 2)
            else:
                scales = field(layout["scales"], 4 * num_local * num_scales * rows).view(torch.float32)
                recv_scales = scales.view(num_local, num_scales, rows).transpose(1, 2)
        else:
            recv_x = field(layout["recv_x"], 2 * num_local * rows * hidden).view(torch.bfloat16)
            recv_x = recv_x.view(num_local, rows, hidden)
            recv_scales = None

        used = (x, topk_idx, slots, expert_counts, expert_begin, recv_count, src_info, layout_range,
                cumulative_stats, wait_stats)  # fmt: skip
        event, hook = self._receive_now_or_hook(seq, receive, stream, async_finish, return_recv_hook, used)
        handle = low_latency_handle(self, src_info, layout_range, seq, x, T, num_experts)
        return recv_x, recv_scales, recv_count, handle, event, hook

    def ll_combine(self, x, topk_idx, topk_weights, record, handle, zero_copy, async_finish, return_recv_hook, out,
                   wait_stats):  # fmt: skip
        src_info, layout_range, T, hidden, num_experts = handle
        num_tokens, num_topk = topk_idx.shape
        self._ll_layout(T, hidden, num_experts)
        seq = self._ll_begin(return_recv_hook)
        stream = self._ll_stream(async_finish)
        combined = (
            out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=self.device)
        )
        self.buffer.ll_enter(seq, stream.cuda_stream)
        # zero_copy: x is the area from ll_next_combine_buffer; the sender reads x in place either way.
        self.buffer.ll_combine_send(
            seq, _ptr(x), _ptr(src_info), _ptr(layout_range), num_topk, hidden, T, num_experts, self.num_device_sms,
            stream.cuda_stream,
        )  # fmt: skip

        def receive(on: torch.cuda.Stream) -> None:
            self.buffer.ll_combine_receive(
                seq, _ptr(topk_idx), _ptr(topk_weights), num_tokens, num_topk, hidden, T, num_experts,
                _ptr(combined), _ptr(wait_stats), self.num_device_sms, on.cuda_stream,
            )  # fmt: skip

        used = (x, topk_idx, topk_weights, src_info, layout_range, combined, wait_stats)
        event, hook = self._receive_now_or_hook(seq, receive, stream, async_finish, return_recv_hook, used)
        return combined, event, hook

    def _receive_now_or_hook(self, seq: int, receive, stream, async_finish: bool, return_recv_hook: bool, used):
        """The receive half of a low-latency call: `(event, None)` after running it now on `stream` (`used`: the
        tensors the event keeps alive), or `(None, hook)` with the hook that runs it later on the caller's current
        stream (DeepEP's `return_recv_hook`)."""
        if return_recv_hook:

            def hook() -> None:
                self._hook_pending[seq % 2] = False
                self.check()
                receive(_gpu.current_stream(self.device))

            return None, hook
        receive(stream)
        return self._finish(stream, async_finish, used), None

    def ll_clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zeroes the low-latency signalling state between two barriers of every rank (collective). A device-side
        failure is not recoverable on this executor: the buffer stays unusable."""
        self.check()
        self._ll_layout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        stream = self.comm_stream
        stream.wait_stream(_gpu.current_stream(self.device))
        self.buffer.barrier(stream.cuda_stream)
        control_bytes = _C_cuda.low_latency_layout(1, 1, self.num_ranks, self.num_ranks)["control_bytes"]
        with _gpu.stream(stream):
            _view(self, self.buffer.ll_address, control_bytes, self.device).zero_()
        self.buffer.barrier(stream.cuda_stream)
        stream.synchronize()
        self.check()
        self._ll_seq = 0
        self._hook_pending = [False, False]

    def ll_next_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Two areas alternate. Neither needs IPC: the combine sender reads its expert outputs locally."""
        shape = (num_experts // self.num_ranks, self.num_ranks * num_max_dispatch_tokens_per_rank, hidden)
        if not self._combine_buffers or tuple(self._combine_buffers[0].shape) != shape:
            self._combine_buffers = [torch.empty(shape, dtype=torch.bfloat16, device=self.device) for _ in range(2)]
        buffer = self._combine_buffers[self._zero_copy_combines % 2]
        self._zero_copy_combines += 1
        return buffer


def built() -> bool:
    """Whether this build has the GPU executor (`mtdeepep._C_cuda`); the registry offers `CudaEngine` only then."""
    return _C_cuda is not None
