"""`Buffer`: DeepEP's classic (V1) interface, a thin facade over an engine (see `mtdeepep.engines`).

It keeps DeepEP's names, argument order, defaults, return tuples and handles, checks every argument before any
communication (a bad one raises ValueError on the rank that got it), and calls the engine chosen at set-up: the CPU
executor for the ranks of one host (shared memory), or the internode engine, which composes a node engine with a
network stage when the group spans several nodes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import _C
from ._checks import (
    COMBINE_DTYPES,
    check_biases,
    check_counts_args,
    check_int,
    check_layout_tensors,
    check_ll_combine,
    check_ll_dispatch,
    check_ll_handle,
    check_num_experts,
    check_tensor,
    check_timeout,
    check_topk_idx,
    check_weights,
    default_timeout,
    require,
    split_x,
)
from .config import Config
from .engines import Engine, create_engine
from .engines.handles import record_of
from .event import EventOverlap, as_event

XLike = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class Buffer:
    """The expert-parallel communication buffer, with DeepEP's constructor, methods and return tuples.

    Arguments mirror `deep_ep.Buffer`. `num_nvl_bytes` is the per-rank region shared with the other ranks of the host
    (shared memory on CPU); payloads larger than the region move in several rounds. `num_rdma_bytes` sizes the
    low-latency area (`low_latency_mode=True`; `get_low_latency_rdma_size_hint`). Arguments that only concern GPU
    transports (`num_qps_per_rank`, `allow_nvlink_for_low_latency_mode`, `allow_mnnvl`, `use_fabric`, `comm`) are
    accepted for compatibility.

    Keyword-only extras: `timeout_s` bounds every wait, set-up included (default 100 s, or `MTDEEPEP_TIMEOUT_S`; a
    finite number > 0); a wait that runs out raises `mtdeepep.CommTimeoutError` naming the ranks and the phase that
    did not arrive. `num_ranks_per_node` groups consecutive ranks into nodes of that size (default: the
    `LOCAL_WORLD_SIZE` environment variable, else one node); the ranks of a node must share a host. When the group
    spans several nodes, dispatch and combine run in two stages (network, then node-local) and low-latency mode uses
    the collective transport (torch.distributed all-to-all).

    Lifetime: `destroy()` (with `explicitly_destroy=True`) finishes the queued work first; without it the buffer is
    released when collected, or at exit. Received tensors that view the shared region stay valid for as long as they
    are held, whatever happens to the buffer.

    Attributes: `rank`, `group_size`, `group`, `num_nvl_bytes`, `num_rdma_bytes`, `low_latency_mode`; class
    attribute `num_sms` (default 20).
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
        self._engine: Engine | None = None
        if group is None:
            group = dist.group.WORLD
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                    f"{name} must be a non-negative int, got {value!r}")  # fmt: skip
        self.rank = group.rank()
        self.group_size = group.size()
        self.group = group
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.timeout_s = default_timeout(timeout_s)
        self._engine = create_engine(
            group, num_nvl_bytes=num_nvl_bytes, num_ll_bytes=num_rdma_bytes, low_latency=self.low_latency_mode,
            num_ranks_per_node=num_ranks_per_node, timeout_s=self.timeout_s,
        )  # fmt: skip
        self.device = self._engine.device
        self.num_ranks_per_node = self._engine.num_ranks_per_node
        self._destroyed = False

    @classmethod
    def _over_engine(cls, engine: Engine, *, num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool,
                     timeout_s: float, explicitly_destroy: bool = True) -> Buffer:  # fmt: skip
        """A buffer over an engine set up without a process group (the ranks of one process,
        `mtdeepep.utils.local_ranks`): the same facade, checks and return tuples; `group` is None."""
        self = cls.__new__(cls)
        self._engine = engine
        self.rank, self.group_size, self.group = engine.rank, engine.num_ranks, None
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = 0
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = False
        self.timeout_s = check_timeout(timeout_s)
        self.device = engine.device
        self.num_ranks_per_node = engine.num_ranks_per_node
        self._destroyed = False
        return self

    def __del__(self) -> None:
        # Upstream releases a buffer that was not destroyed explicitly when it is collected. Nothing at interpreter
        # shutdown: the exit hook (mtdeepep.__init__) has released every runtime already.
        if self._engine is not None and not getattr(self, "_destroyed", True) and not sys.is_finalizing():
            with contextlib.suppress(Exception):  # a destructor must not raise
                self._engine.destroy()

    # ---------------------------------------------------------------------------------------------------------
    # Static helpers

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count (CPU: twice the channel count) used by the default configs. Must be even."""
        require(isinstance(new_num_sms, int) and new_num_sms > 0 and new_num_sms % 2 == 0,
                f"the SM count must be a positive even number, got {new_num_sms!r}")  # fmt: skip
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
        require(isinstance(num_ranks, int) and num_ranks > 0, f"num_ranks must be a positive int, got {num_ranks!r}")
        key = min((k for k in table if k >= num_ranks), default=max(table))
        return Config(Buffer.num_sms, *table[key])

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes of `num_rdma_bytes` that low-latency calls with these arguments need (use them for every rank).

        The area holds a control part (per-source signals and per-expert slot counters) and two halves (double
        buffering) of a fixed size, each with the dispatch receive slots (`[num_experts / num_ranks, num_ranks *
        num_max_dispatch_tokens_per_rank]` rows of `hidden` bfloat16, FP8 scales, source indices, per-source ranges)
        and the combine receive area (`[num_experts, num_max_dispatch_tokens_per_rank, hidden]` bfloat16).
        """
        return _C.LowLatencyProtocol.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # ---------------------------------------------------------------------------------------------------------
    # Buffer access and lifetime

    def _live_engine(self) -> Engine:
        if self._destroyed:
            raise _C.CommError("mtdeepep: the buffer was destroyed")
        return self._engine

    def get_comm_stream(self):
        """The CUDA stream of GPU executors; the CPU executor's comm thread has no stream object: None."""
        return getattr(self._engine, "comm_stream", None)

    def get_local_device_id(self) -> int:
        """The GPU of a GPU executor; -1 on the CPU executor."""
        return -1 if self.device.type == "cpu" or self.device.index is None else self.device.index

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
        """A tensor view of this rank's shared region (`use_rdma_buffer`: of its low-latency area). It keeps the
        mapping alive while held, even after `destroy()`.

        `size`: element shape of the slice (default: all of it); `offset`: first element.
        """
        require(isinstance(offset, int) and offset >= 0, f"offset must be a non-negative int, got {offset!r}")
        tensor = self._live_engine().local_buffer_tensor(dtype, offset, use_rdma_buffer)
        if size is None:
            return tensor
        size = torch.Size(size)
        require(tensor.numel() >= size.numel(),
                f"{size} needs {size.numel()} elements, the buffer holds {tensor.numel()}")  # fmt: skip
        return tensor[: size.numel()].view(size)

    def set_timeout(self, timeout_s: float) -> None:
        """Change the bound on every wait (a finite number of seconds > 0)."""
        self.timeout_s = check_timeout(timeout_s)
        self._live_engine().set_timeout(self.timeout_s)

    def destroy(self) -> None:
        """Finish the queued work, then release the shared regions and the comm thread. Needs
        `explicitly_destroy=True`, as upstream. Tensors that view the regions stay valid while held."""
        require(self.explicitly_destroy, "`explicitly_destroy` must be set to call destroy()")
        if not self._destroyed:
            self._destroyed = True
            self._engine.destroy()

    # ---------------------------------------------------------------------------------------------------------
    # Layout, dispatch, combine

    @staticmethod
    def _previous(previous_event, async_finish: bool, allocate_on_comm_stream: bool):
        require(not allocate_on_comm_stream or (previous_event is not None and async_finish),
                "allocate_on_comm_stream needs previous_event and async_finish")  # fmt: skip
        return as_event(previous_event)

    def _num_channels(self, config: Config | None, default: Callable[[int], Config]) -> int:
        config = default(self.group_size) if config is None else config
        require(isinstance(config, Config), f"config must be an mtdeepep.Config, got {type(config).__name__}")
        return config.num_channels

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
        engine = self._live_engine()
        check_num_experts(num_experts, self.group_size)
        check_topk_idx(topk_idx, num_experts, self.device)
        previous = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        topk_idx = topk_idx.contiguous()
        per_rank, per_node, per_expert, in_rank, event = engine.layout(topk_idx, num_experts, previous, async_finish)
        return per_rank, per_node, per_expert, in_rank, EventOverlap(event, (topk_idx,) if async_finish else None)

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
                The dispatch's identity is attached to it (see `mtdeepep.engines.handles`): any live buffer of the
                same group accepts it; ranks that combine handles of different dispatches all raise
                `GroupMismatchError`.
            event: completion of the data movement.

        Several nodes: the same results and row order; `num_tokens_per_rdma_rank` (optional) is checked; the handle
        is an `mtdeepep.InternodeHandle` (8-tuple); the caller waits for the count and metadata exchanges, the
        token bytes move in the background (see `mtdeepep.engines.internode`).
        """
        engine = self._live_engine()
        num_channels = self._num_channels(config, self.get_dispatch_config)
        data, scales = split_x(x, self.device)
        num_tokens = data.size(0)
        check_counts_args(expert_alignment, num_worst_tokens)
        previous = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None:
            require(topk_idx is None and topk_weights is None,
                    "cached dispatch (with a handle) takes no topk_idx / topk_weights")  # fmt: skip
            record = record_of(handle, engine.handle_kind, engine.group, "cached dispatch")
            require(record.num_tokens == num_tokens,
                    f"x has {num_tokens} tokens but the handle was made for {record.num_tokens}")  # fmt: skip
            recv_data, recv_scales, event = engine.cached_dispatch(
                data, scales, record, num_worst_tokens, num_channels, previous, async_finish
            )
            recv_x = recv_data if scales is None else (recv_data, recv_scales)
            return recv_x, None, None, None, handle, EventOverlap(event, (data,) if async_finish else None)

        layout_ready = previous is None or previous.query()
        check_layout_tensors(num_tokens, self.group_size, engine.num_nodes, num_tokens_per_rank,
                             num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, self.device,
                             layout_ready)  # fmt: skip
        num_experts = num_tokens_per_expert.size(0)
        if topk_idx is not None:
            check_topk_idx(topk_idx, num_experts, self.device, num_tokens)
            topk_idx = topk_idx.contiguous()
        if topk_weights is not None:
            require(topk_idx is not None, "topk_weights needs topk_idx")
            check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape),
                         device=self.device)  # fmt: skip
            topk_weights = topk_weights.contiguous()
        out = engine.dispatch(
            data, scales, topk_idx, topk_weights, is_token_in_rank.contiguous(), num_tokens_per_expert.contiguous(),
            expert_alignment, num_worst_tokens, num_channels, previous, async_finish,
        )  # fmt: skip
        recv_x = out.recv_x if scales is None else (out.recv_x, out.recv_scales)
        keep = (data, topk_idx, topk_weights) if async_finish else None
        return (recv_x, out.recv_topk_idx, out.recv_topk_weights, out.num_recv_tokens_per_expert, out.handle,
                EventOverlap(out.event, keep))  # fmt: skip

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
        rounded again; all of it in the background with `async_finish` (see `mtdeepep.engines.internode`).
        """
        engine = self._live_engine()
        num_channels = self._num_channels(config, self.get_combine_config)
        record = record_of(handle, engine.handle_kind, engine.group, "combine")
        check_tensor("x", x, dim=2, dtypes=COMBINE_DTYPES, device=self.device)
        require(x.size(0) == record.num_recv,
                f"x has {x.size(0)} rows but the handle's dispatch received {record.num_recv}")  # fmt: skip
        x = x.contiguous()
        if topk_weights is not None:
            check_weights(topk_weights, x.size(0), self.device)
            topk_weights = topk_weights.contiguous()
        bias0, bias1 = check_biases(bias, record.num_tokens, x, self.device)
        previous = self._previous(previous_event, async_finish, allocate_on_comm_stream)
        combined_x, combined_weights, event = engine.combine(
            x, topk_weights, bias0, bias1, record, num_channels, previous, async_finish
        )
        keep = tuple(t for t in (x, topk_weights, bias0, bias1) if t is not None) if async_finish else None
        return combined_x, combined_weights, EventOverlap(event, keep)

    # ---------------------------------------------------------------------------------------------------------
    # Low-latency mode (Buffer(..., low_latency_mode=True))

    def _low_latency_engine(self) -> Engine:
        engine = self._live_engine()
        require(self.low_latency_mode, "low-latency calls need Buffer(..., low_latency_mode=True)")
        return engine

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the low-latency signalling state (signals, slot counters, ranges) and restart the call numbering.

        Collective: every rank must call it, with the same arguments as the low-latency calls that follow, and with
        no low-latency call in flight (it first finishes this rank's queued calls, then waits for every rank). Use it
        to recover after a failed or timed-out low-latency call; unlike upstream it is not needed after normal-mode
        calls, which use a separate region.
        """
        engine = self._low_latency_engine()
        check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
        check_int("hidden", hidden)
        check_num_experts(num_experts, self.group_size)
        engine.ll_clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)

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
                (`scale = max(amax, 1e-4) / 448`, as `mtdeepep.utils.fp8.per_token_cast_to_fp8`).
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
        engine = self._low_latency_engine()
        x, topk_idx = check_ll_dispatch(
            self.group_size, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0,
            async_finish, return_recv_hook, self.device,
        )  # fmt: skip
        recv_x, recv_scales, recv_count, handle, event, hook = engine.ll_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
        )  # fmt: skip
        keep = None
        if async_finish:
            keep = (x, topk_idx, recv_x, recv_count, *handle[:2])
            keep += tuple(t for t in (recv_scales, cumulative_local_expert_recv_stats) if t is not None)
        recv = (recv_x, recv_scales) if use_fp8 else recv_x
        return recv, recv_count, handle, EventOverlap(event, keep), hook

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
        engine = self._low_latency_engine()
        record = record_of(handle, "low_latency", engine.group, "low_latency_combine")
        handle = check_ll_handle(handle, self.group_size)
        x, topk_idx, topk_weights = check_ll_combine(
            self.group_size, handle, x, topk_idx, topk_weights, use_logfmt, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats, self.device,
        )  # fmt: skip
        combined, event, hook = engine.ll_combine(
            x, topk_idx, topk_weights, record, handle, zero_copy, async_finish, return_recv_hook, out,
            combine_wait_recv_cost_stats,
        )  # fmt: skip
        keep = (x, topk_idx, topk_weights, *handle[:2], combined) if async_finish else None
        return combined, EventOverlap(event, keep), hook

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The `[num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden]` bfloat16 area the next
        `low_latency_combine(..., zero_copy=True)` reads: write the expert outputs into it. Two areas alternate between
        zero-copy combines, so one can be filled while the previous combine is still sending."""
        engine = self._low_latency_engine()
        record_of(handle, "low_latency", engine.group, "get_next_low_latency_combine_buffer")
        _, _, num_max_dispatch_tokens_per_rank, hidden, num_experts = check_ll_handle(handle, self.group_size)
        return engine.ll_next_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    # ---------------------------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"mtdeepep.Buffer(rank={self.rank}, group_size={self.group_size}, num_nvl_bytes={self.num_nvl_bytes}, "
            f"engine={type(self._engine).__name__}, timeout_s={self.timeout_s})"
        )


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
