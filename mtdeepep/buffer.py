"""`Buffer`: DeepEP's classic interface over mtdeepep's executors.

The CPU executor keeps one shared-memory region of `num_nvl_bytes` per rank, mapped by every rank of the host
(the CPU analog of DeepEP's NVLink IPC buffer). Dispatch writes each token straight into the regions of the
ranks that own its experts; combine writes expert outputs back into the senders' regions, where they are summed
in FP32. Communication runs on the buffer's comm thread; `EventOverlap` waits for it.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C
from ._checks import COMBINE_DTYPES, check_num_experts, check_tensor, check_topk_idx, split_x
from .config import Config
from .event import EventOverlap
from .internode import InternodeBuffer, check_nodes_share_hosts, resolve_num_ranks_per_node
from .low_latency import LowLatencyBuffer

DEFAULT_TIMEOUT_S = 100.0
_NAME_BYTES = 512

XLike = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _default_timeout() -> float:
    return float(os.environ.get("MTDEEPEP_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _gather_strings(group: dist.ProcessGroup, value: str, timeout_s: float) -> list[str]:
    """All-gathers one short string per rank, failing after `timeout_s` with the ranks that did not arrive."""
    backend = dist.get_backend(group)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        try:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as error:
            raise _C.CommTimeoutError(f"mtdeepep: Buffer set-up: not every rank arrived: {error}") from error
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    payload = value.encode()
    if len(payload) > _NAME_BYTES:
        raise ValueError(f"mtdeepep: set-up string too long ({len(payload)} bytes)")
    mine = torch.zeros(_NAME_BYTES, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(group.size())]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    if not work.wait(timeout=timeout):
        raise _C.CommTimeoutError(f"mtdeepep: Buffer set-up: the all-gather did not finish within {timeout_s} s")
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in gathered]


class Buffer:
    """The expert-parallel communication buffer, with DeepEP's constructor, methods and return tuples.

    Arguments mirror `deep_ep.Buffer`. `num_nvl_bytes` is the per-rank region shared with the other ranks of
    the host (shared memory on CPU). Payloads larger than the region move in several rounds. Arguments that
    only concern GPU transports (`num_qps_per_rank`, `allow_nvlink_for_low_latency_mode`, `allow_mnnvl`,
    `use_fabric`, `comm`) are accepted for compatibility.

    Keyword-only extras: `timeout_s` bounds every wait (default 100 s, or `MTDEEPEP_TIMEOUT_S`); a wait that
    runs out raises `mtdeepep.CommTimeoutError` naming the ranks and the phase that did not arrive.
    `num_ranks_per_node` groups consecutive ranks into nodes of that size (default: the `LOCAL_WORLD_SIZE`
    environment variable, else one node); the ranks of a node must share a host. When the group spans several
    nodes, dispatch and combine run in two stages (network, then node-local; see `mtdeepep.internode`) and
    low-latency mode uses the collective transport (torch.distributed all-to-all).

    Attributes: `rank`, `group_size`, `group`, `num_nvl_bytes`, `num_rdma_bytes`, `low_latency_mode`;
    class attribute `num_sms` (default 20).
    """

    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
        *,
        timeout_s: float | None = None,
        num_ranks_per_node: int | None = None,
    ) -> None:
        if group is None:
            group = dist.group.WORLD
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise ValueError("mtdeepep: buffer sizes must be non-negative")
        self.rank = group.rank()
        self.group_size = group.size()
        self.group = group
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.timeout_s = _default_timeout() if timeout_s is None else float(timeout_s)
        if self.timeout_s <= 0:
            raise ValueError(f"mtdeepep: timeout_s must be positive, got {self.timeout_s}")
        self.device = torch.device("cpu")
        # Handles this buffer issued, keyed by their rank prefix matrix: a handle from elsewhere is refused.
        self._issued_handles: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

        self.num_ranks_per_node = resolve_num_ranks_per_node(num_ranks_per_node, self.group_size)
        self._low_latency: LowLatencyBuffer | None = None
        self._internode: InternodeBuffer | None = None
        internode = self.num_ranks_per_node < self.group_size

        # Several nodes: the node-local stage's intranode Buffer owns the shared region and becomes self.runtime.
        self.runtime = None if internode else _C.Runtime(
            self.rank, self.group_size, self.num_nvl_bytes, self.timeout_s, torch.get_num_threads()
        )  # fmt: skip
        try:
            segment = "-" if internode else self.runtime.segment_name()
            me = f"{socket.gethostname()}\n{segment}\n{os.getpid()}"
            peers = [entry.split("\n") for entry in _gather_strings(group, me, self.timeout_s)]
            check_nodes_share_hosts([host for host, _, _ in peers], self.num_ranks_per_node)
            if internode:
                self._internode = InternodeBuffer(self, self.num_ranks_per_node)
                self.runtime = self._internode.node_buffer.runtime
            else:
                self.runtime.sync([name for _, name, _ in peers], [int(pid) for _, _, pid in peers])
            if low_latency_mode:
                self._low_latency = self._set_up_low_latency()
        except BaseException:
            if self._internode is not None:
                self._internode.destroy()
            elif self.runtime is not None:
                self.runtime.destroy()
            raise

    # ---------------------------------------------------------------------------------------------------------
    # Static helpers

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count (CPU: twice the channel count) used by the default configs. Must be even."""
        if new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"mtdeepep: the SM count must be a positive even number, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream. On CPU the caller's thread is the stream, so it is already complete."""
        return EventOverlap(_C.EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        return False

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch config for `num_ranks` (same table as upstream, any rank count accepted)."""
        return Buffer._config_for(num_ranks, _DISPATCH_CONFIGS)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine config for `num_ranks` (same table as upstream, any rank count accepted)."""
        return Buffer._config_for(num_ranks, _COMBINE_CONFIGS)

    @staticmethod
    def _config_for(num_ranks: int, table: dict[int, tuple[int, int, int, int]]) -> Config:
        if num_ranks <= 0:
            raise ValueError(f"mtdeepep: num_ranks must be positive, got {num_ranks}")
        key = min((k for k in table if k >= num_ranks), default=max(table))
        return Config(Buffer.num_sms, *table[key])

    # ---------------------------------------------------------------------------------------------------------
    # Buffer access and lifetime

    def get_comm_stream(self):
        """The CUDA stream of GPU executors; the CPU executor's comm thread has no stream object: None."""
        return None

    def get_local_device_id(self) -> int:
        return -1

    def get_num_rdma_ranks(self) -> int:
        """The number of nodes (1 within one node)."""
        return self.group_size // self.num_ranks_per_node

    def get_rdma_rank(self) -> int:
        """This rank's node."""
        return self.rank // self.num_ranks_per_node

    def get_root_rdma_rank(self, global_: bool) -> int:
        """The first rank of this rank's node: its group rank if `global_`, else its index in the node (0)."""
        return self.get_rdma_rank() * self.num_ranks_per_node if global_ else 0

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> torch.Tensor:
        """A tensor view of this rank's shared region (the part after the control block).

        `size`: element shape of the slice (default: all of it); `offset`: first element.
        """
        if use_rdma_buffer:
            raise ValueError("mtdeepep: this buffer has no RDMA region (num_rdma_bytes is used by internode mode)")
        tensor = self.runtime.get_local_buffer_tensor(dtype, offset)
        if size is None:
            return tensor
        size = torch.Size(size)
        if tensor.numel() < size.numel():
            raise ValueError(f"mtdeepep: {size} needs {size.numel()} elements, the buffer holds {tensor.numel()}")
        return tensor[: size.numel()].view(size)

    def set_timeout(self, timeout_s: float) -> None:
        """Change the bound on every wait (seconds)."""
        if timeout_s <= 0:
            raise ValueError(f"mtdeepep: timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.runtime.set_timeout(self.timeout_s)
        if self._low_latency is not None:
            self._low_latency.set_timeout(self.timeout_s)

    def destroy(self) -> None:
        """Release the shared regions and the comm thread. Needs `explicitly_destroy=True`, as upstream."""
        if not self.explicitly_destroy:
            raise RuntimeError("mtdeepep: `explicitly_destroy` must be set to call destroy()")
        self.runtime.destroy()
        if self._internode is not None:
            self._internode.destroy()
        if self._low_latency is not None:
            self._low_latency.destroy()

    # ---------------------------------------------------------------------------------------------------------
    # Layout, dispatch, combine

    def _prepare(self, previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool):
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("mtdeepep: allocate_on_comm_stream needs previous_event and async_finish")
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise ValueError(f"mtdeepep: previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        self.runtime.set_num_threads(torch.get_num_threads())
        return None if previous_event is None else previous_event.event

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """Compute where each token goes.

        Arguments:
            topk_idx: `[num_tokens, num_topk]` int64, expert ids, -1 for an unused slot.
            num_experts: total experts, divisible by the group size.

        Returns:
            num_tokens_per_rank: `[num_ranks]` int32, tokens sent to each rank (once per rank, however many of its
                experts there).
            num_tokens_per_rdma_rank: None within one node; with several nodes `[num_nodes]` int32, tokens sent to
                each node (once per node, however many of its ranks).
            num_tokens_per_expert: `[num_experts]` int32.
            is_token_in_rank: `[num_tokens, num_ranks]` bool.
            event: completion (meaningful with `async_finish`).
        """
        if self._internode is not None:
            return self._internode.get_dispatch_layout(
                topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream
            )
        check_num_experts(num_experts, self.group_size)
        check_topk_idx(topk_idx, num_experts, self.device)
        event = self._prepare(previous_event, async_finish, allocate_on_comm_stream)
        per_rank, per_rdma_rank, per_expert, in_rank, done = self.runtime.get_dispatch_layout(
            topk_idx.contiguous(), num_experts, event, async_finish
        )
        return per_rank, per_rdma_rank, per_expert, in_rank, EventOverlap(done, (topk_idx,) if async_finish else None)

    def dispatch(
        self,
        x: XLike,
        handle: tuple | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[XLike, torch.Tensor | None, torch.Tensor | None, list[int] | None, tuple, EventOverlap]:
        """Send each token once to every rank that owns at least one of its experts.

        Arguments:
            x: `[num_tokens, hidden]` (any float dtype, any hidden size), or the FP8 pair
                `(float8_e4m3fn [num_tokens, hidden], float32 scales [num_tokens, hidden // 128])`; scales may be
                row- or column-major.
            handle: from an earlier dispatch: reuse its layout (cached mode; pass no top-k).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from `get_dispatch_layout`.
            topk_idx: `[num_tokens, num_topk]` int64; topk_weights: `[num_tokens, num_topk]` float32.
            expert_alignment: round each local expert's received count up to this multiple.
            num_worst_tokens: if > 0, size the outputs for this many rows (graph-capture style); the count list
                comes back empty and unused rows of `recv_topk_idx` are -1.

        Returns:
            recv_x: `[num_recv_tokens, hidden]` (a pair for FP8, scales row-major), grouped by source rank
                (ascending), each source's rows in its token order.
            recv_topk_idx: `[num_recv_tokens, num_topk]` int64 local expert ids, -1 where the expert lives elsewhere.
            recv_topk_weights: `[num_recv_tokens, num_topk]` float32, 0 in the -1 slots.
            num_recv_tokens_per_expert_list: per local expert, aligned to `expert_alignment`.
            handle: `(rank_prefix_matrix [R, R], channel_prefix_matrix [R, C], recv_channel_prefix_matrix [R, C],
                recv_src_idx [num_recv_tokens], is_token_in_rank [num_tokens, R], send_head [num_tokens, R])`,
                int32 but `is_token_in_rank`; `send_head[t, r]` is token t's position among the tokens sent to r.
            event: completion of the data movement.

        Several nodes: the same results and row order; `num_tokens_per_rdma_rank` (optional) is checked; the handle
        is an `mtdeepep.internode.InternodeHandle` (8-tuple); the caller waits for the count and metadata
        exchanges, the token bytes move in the background (see `InternodeBuffer.dispatch`).
        """
        if self._internode is not None:
            return self._internode.dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                allocate_on_comm_stream,
            )  # fmt: skip
        config = self.get_dispatch_config(self.group_size) if config is None else config
        data, scales = split_x(x, self.device)
        num_tokens = data.size(0)
        _check_alignment(expert_alignment, num_worst_tokens)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("mtdeepep: cached dispatch (with a handle) takes no topk_idx / topk_weights")
            rank_prefix_matrix, _, _, _, is_token_in_rank, _ = self._check_handle(handle, num_tokens)
            event = self._prepare(previous_event, async_finish, allocate_on_comm_stream)
            recv = self.runtime.intranode_dispatch(
                data, scales, None, None, None, is_token_in_rank, None, rank_prefix_matrix,
                expert_alignment, num_worst_tokens, config.num_channels, event, async_finish,
            )  # fmt: skip
            recv_x = recv[0] if scales is None else (recv[0], recv[1])
            done = EventOverlap(recv[10], (data,) if async_finish else None)
            return recv_x, None, None, None, handle, done

        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError(
                "mtdeepep: dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                "num_tokens_per_expert (from get_dispatch_layout)"
            )
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, dim=1, dtypes=(torch.int32,), device=self.device)
        num_experts = num_tokens_per_expert.size(0)
        check_num_experts(num_experts, self.group_size)
        check_tensor(
            "num_tokens_per_rank", num_tokens_per_rank, dtypes=(torch.int32,), shape=(self.group_size,),
            device=self.device,
        )  # fmt: skip
        check_tensor(
            "is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), shape=(num_tokens, self.group_size),
            device=self.device,
        )  # fmt: skip
        # The layout may still be in flight (async get_dispatch_layout); then there is nothing to compare yet.
        if (previous_event is None or previous_event.query()) and not torch.equal(
            is_token_in_rank.sum(dim=0, dtype=torch.int32), num_tokens_per_rank
        ):
            raise ValueError("mtdeepep: num_tokens_per_rank does not match is_token_in_rank's column sums")
        if topk_idx is not None:
            check_topk_idx(topk_idx, num_experts, self.device, num_tokens)
            topk_idx = topk_idx.contiguous()
        if topk_weights is not None:
            if topk_idx is None:
                raise ValueError("mtdeepep: topk_weights needs topk_idx")
            check_tensor(
                "topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape), device=self.device
            )
            topk_weights = topk_weights.contiguous()
        event = self._prepare(previous_event, async_finish, allocate_on_comm_stream)
        (recv_data, recv_scales, recv_topk_idx, recv_topk_weights, counts, rank_prefix_matrix, channel_prefix_matrix,
         recv_channel_prefix_matrix, recv_src_idx, send_head, done) = self.runtime.intranode_dispatch(
            data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank.contiguous(),
            num_tokens_per_expert.contiguous(), None, expert_alignment, num_worst_tokens, config.num_channels, event,
            async_finish,
        )  # fmt: skip
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, send_head)  # fmt: skip
        self._issued_handles[id(rank_prefix_matrix)] = rank_prefix_matrix
        recv_x = recv_data if scales is None else (recv_data, recv_scales)
        keep = (data, topk_idx, topk_weights) if async_finish else None
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, EventOverlap(done, keep)

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send expert outputs back and sum them per original token, in FP32, without weights.

        Arguments:
            x: `[num_recv_tokens, hidden]` bfloat16/float16/float32, rows in the order dispatch returned them.
            handle: the handle of the matching dispatch.
            topk_weights: `[num_recv_tokens, num_topk]` float32, summed slot by slot (rebuilds the original weights).
            bias: `[num_tokens, hidden]` tensor or a pair of them (either may be None), added to the result.

        Returns:
            combined_x: `[num_tokens, hidden]` in x's dtype.
            combined_topk_weights: `[num_tokens, num_topk]` float32 or None.
            event: completion.

        Several nodes: node partial sums (FP32, rounded once to x's dtype) are summed in FP32 at the source and
        rounded again; all of it in the background with `async_finish` (see `InternodeBuffer.combine`).
        """
        if self._internode is not None:
            return self._internode.combine(
                x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream
            )
        config = self.get_combine_config(self.group_size) if config is None else config
        rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, send_head = self._check_handle(handle)
        num_tokens = is_token_in_rank.size(0)
        check_tensor("x", x, dim=2, dtypes=COMBINE_DTYPES, device=self.device)
        if x.size(0) != recv_src_idx.size(0):
            raise ValueError(f"mtdeepep: x has {x.size(0)} rows but the handle's dispatch received "
                             f"{recv_src_idx.size(0)}")  # fmt: skip
        x = x.contiguous()
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dim=2, dtypes=(torch.float32,), device=self.device)
            if topk_weights.size(0) != x.size(0):
                raise ValueError(f"mtdeepep: topk_weights has {topk_weights.size(0)} rows, x has {x.size(0)}")
            topk_weights = topk_weights.contiguous()
        biases = bias if isinstance(bias, tuple) else (bias, None)
        if len(biases) != 2:
            raise ValueError(f"mtdeepep: bias must be a tensor or a pair of tensors, got {len(biases)} items")
        biases = tuple(
            None if b is None else check_tensor(
                "bias", b, dtypes=(x.dtype,), shape=(num_tokens, x.size(1)), device=self.device
            ).contiguous()
            for b in biases
        )  # fmt: skip
        event = self._prepare(previous_event, async_finish, allocate_on_comm_stream)
        combined_x, combined_weights, done = self.runtime.intranode_combine(
            x, topk_weights, biases[0], biases[1], rank_prefix_matrix, send_head, config.num_channels, event,
            async_finish,
        )  # fmt: skip
        keep = (x, topk_weights, *[b for b in biases if b is not None]) if async_finish else None
        return combined_x, combined_weights, EventOverlap(done, keep)

    def _check_handle(self, handle: tuple, num_tokens: int | None = None) -> tuple:
        if not isinstance(handle, tuple) or len(handle) != 6:
            raise ValueError("mtdeepep: handle must be the 6-tuple returned by this buffer's dispatch")
        rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, send_head = handle
        if (
            not isinstance(rank_prefix_matrix, torch.Tensor)
            or self._issued_handles.get(id(rank_prefix_matrix)) is not rank_prefix_matrix
        ):
            raise ValueError("mtdeepep: the handle was not issued by this buffer (or by a dispatch of it)")
        if num_tokens is not None and is_token_in_rank.size(0) != num_tokens:
            raise ValueError(f"mtdeepep: x has {num_tokens} tokens but the handle was made for "
                             f"{is_token_in_rank.size(0)}")  # fmt: skip
        return handle

    # ---------------------------------------------------------------------------------------------------------
    # Low-latency mode (Buffer(..., low_latency_mode=True)); the work is done by mtdeepep/low_latency.py.

    def _set_up_low_latency(self) -> LowLatencyBuffer:
        """Second bootstrap gather: every rank's low-latency region. Ranks on several nodes (`num_ranks_per_node`)
        use the collective transport, ranks of one node the shared-memory one."""
        low_latency = LowLatencyBuffer(self.group, self.num_rdma_bytes, self.timeout_s)
        try:
            entries = _gather_strings(self.group, low_latency.setup_string(), self.timeout_s)
            low_latency.sync(entries, [r // self.num_ranks_per_node for r in range(self.group_size)])
        except BaseException:
            low_latency.destroy()
            raise
        return low_latency

    def _require_low_latency(self) -> LowLatencyBuffer:
        if self._low_latency is None:
            raise ValueError("mtdeepep: low-latency calls need Buffer(..., low_latency_mode=True)")
        return self._low_latency

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of `num_rdma_bytes` that low-latency calls with these arguments need (use them for every rank).

        The region holds a control area (per-source signals and per-expert slot counters) and two halves (double
        buffering), each with the dispatch receive slots (`[num_experts / num_ranks, num_ranks *
        num_max_dispatch_tokens_per_rank]` rows of `hidden` bfloat16, FP8 scales, source indices, per-source
        ranges) and the combine receive area (`[num_experts, num_max_dispatch_tokens_per_rank, hidden]` bfloat16).
        """
        return LowLatencyBuffer.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the low-latency signalling state (signals, slot counters, ranges) and restart the call numbering.

        Collective: every rank must call it, with the same arguments as the low-latency calls that follow, and with
        no low-latency call in flight (it first finishes this rank's queued calls, then waits for every rank). Use it
        to recover after a failed or timed-out low-latency call; unlike upstream it is not needed after normal-mode
        calls, which use a separate region.
        """
        self._require_low_latency().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[XLike, torch.Tensor, tuple, EventOverlap, Callable[[], None] | None]:
        """Send each token to every expert of its top-k, packed per local expert on the receiving rank.

        Every rank must call it (a collective), with the same `num_max_dispatch_tokens_per_rank`, `num_experts`,
        hidden size and FP8 options. At most two low-latency results can be alive at once: `recv_x` (and scales) are
        views into one half of this rank's region, which the call after next overwrites.

        Arguments:
            x: `[num_tokens, hidden]` bfloat16, `num_tokens <= num_max_dispatch_tokens_per_rank` (else ValueError);
                any hidden size, a multiple of 128 with `use_fp8`.
            topk_idx: `[num_tokens, num_topk]` int64 expert ids in `[-1, num_experts)`, -1 for an unused slot, no
                expert twice in a row; any `num_topk <= num_experts`.
            num_max_dispatch_tokens_per_rank: the most tokens any rank dispatches (same on every rank).
            num_experts: total experts, divisible by the group size.
            cumulative_local_expert_recv_stats: `[num_local_experts]` int32; the received counts are added to it.
            dispatch_wait_recv_cost_stats: `[num_ranks]` int64; the nanoseconds spent waiting for each source rank's
                rows are added to it (shared-memory transport; left untouched by the collective transport).
            use_fp8: the sender casts each token to E4M3 per 128 channels with float32 scales
                (`scale = max(amax, 1e-4) / 448`, as `mtdeepep.utils.refs.per_token_cast_to_fp8`).
            round_scale: round each scale up to a power of two.
            use_ue8m0: return the (power-of-two) scales as their 8-bit exponents, 4 per int32; needs `round_scale`.
            async_finish: run on the comm thread; the returned event completes when the data has arrived.
            return_recv_hook: only issue the sends (on the comm thread) and return; calling `hook()` waits for every
                source rank and completes the receive, so computation can run in between. Not with `async_finish`.
                Leave `x` and `topk_idx` unchanged until the hook (or event) has completed.

        Returns:
            recv_x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` bfloat16, or with
                `use_fp8` the pair `(float8_e4m3fn data, scales)`, scales `[num_local_experts, num_ranks *
                num_max_dispatch_tokens_per_rank, hidden / 128]` float32 (or int32 `[..., ceil(hidden / 512)]` with
                `use_ue8m0`, unused exponent bytes 0), column-major in the last two dimensions as upstream. Only the
                first `recv_count[e]` rows of expert e are valid.
            recv_count: `[num_local_experts]` int32 rows received per local expert.
            handle: `(src_info [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank] int32 token index on
                its source rank, layout_range [num_local_experts, num_ranks] int64 (begin << 32) | count of the rows
                from each source rank, num_max_dispatch_tokens_per_rank, hidden, num_experts)`.
            event: completion (meaningful with `async_finish`).
            hook: the receive hook with `return_recv_hook`, else None.
        """
        return self._require_low_latency().dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
        )  # fmt: skip

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Callable[[], None] | None]:
        """Send expert outputs back and reduce them per token **with** the top-k weights, accumulating in FP32.

        Arguments:
            x: `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` bfloat16 expert outputs, in
                the rows of the dispatch that made `handle`.
            topk_idx: `[num_tokens, num_topk]` int64, the ids this rank dispatched (-1 slots are skipped).
            topk_weights: `[num_tokens, num_topk]` float32.
            handle: from `low_latency_dispatch`.
            use_logfmt: must be False (LogFMT compression is not supported: ValueError).
            zero_copy: the outputs were already written into `get_next_low_latency_combine_buffer(handle)`; that area
                is read instead of `x` (no copy of `x` is made either way on this executor).
            async_finish, return_recv_hook: as in `low_latency_dispatch`.
            out: `[num_tokens, hidden]` bfloat16 contiguous, written in place and returned.
            combine_wait_recv_cost_stats: `[num_ranks]` int64, nanoseconds waited per source rank (shared-memory
                transport only).

        Returns:
            combined_x: `[num_tokens, hidden]` bfloat16, `sum_k topk_weights[t, k] * expert_output(topk_idx[t, k], t)`
                over the non-masked slots in slot order, in FP32, rounded once.
            event: completion (meaningful with `async_finish`).
            hook: the receive hook with `return_recv_hook`, else None.
        """
        return self._require_low_latency().combine(
            x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats,
        )  # fmt: skip

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` bfloat16 area the next
        `low_latency_combine(..., zero_copy=True)` reads: write the expert outputs into it. Two areas alternate between
        zero-copy combines, so one can be filled while the previous combine is still sending."""
        return self._require_low_latency().next_combine_buffer(handle)

    # ---------------------------------------------------------------------------------------------------------
    # End of low-latency mode

    def __repr__(self) -> str:
        return (
            f"mtdeepep.Buffer(rank={self.rank}, group_size={self.group_size}, num_nvl_bytes={self.num_nvl_bytes}, "
            f"executor=cpu-shm, timeout_s={self.timeout_s})"
        )


def _check_alignment(expert_alignment: int, num_worst_tokens: int) -> None:
    if not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise ValueError(f"mtdeepep: expert_alignment must be a positive int, got {expert_alignment}")
    if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        raise ValueError(f"mtdeepep: num_worst_tokens must be a non-negative int, got {num_worst_tokens}")


# Upstream's tuned tables (num_max_nvl_chunked_send/recv_tokens, num_max_rdma_chunked_send/recv_tokens).
_DISPATCH_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (16, 288, 20, 128),
    24: (8, 288, 32, 128), 32: (8, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
    144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}  # fmt: skip
_COMBINE_CONFIGS: dict[int, tuple[int, int, int, int]] = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (2, 288, 28, 128),
    24: (1, 288, 20, 128), 32: (1, 288, 20, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128),
    144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip
