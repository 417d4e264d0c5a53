"""DeepEP V2's `ElasticBuffer` and `EPHandle`: a thin facade over an engine (see `mtdeepep.engines`), as `Buffer` is.

DeepEP V2 (`deep_ep/buffers/elastic.py`) merges V1's normal and low-latency modes into one `dispatch`/`combine`
pair on an `ElasticBuffer`, returning an `EPHandle` object instead of V1's handle tuple. torchtitan's DeepEP
backend (`torchtitan/distributed/deepep/deepep.py`) calls exactly this interface. Every call checks its arguments,
then goes to the same engine calls as `Buffer` (layout, dispatch, cached dispatch, combine), plus plain PyTorch for
what the engine has no counterpart for (the expanded layout, the handle's metadata).

Design note: V2's arguments and fields, what they mean upstream, and what this facade does with them.

Constructor `ElasticBuffer(group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0,
num_topk=0, use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True, allow_multiple_reduction=True,
prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0, num_cpu_timeout_secs=300,
num_gpu_timeout_secs=100, explicitly_destroy=False)`:

Each entry: the V2 argument; what it means in DeepEP V2; what mtdeepep does with it.

- `group`: the EP process group. The engine's group (construction is collective).
- `num_bytes`: symmetric buffer bytes, None: computed from the MoE settings. The shared region (V1's `num_nvl_bytes`);
  None: `get_buffer_size_hint(...)`, which needs `num_max_tokens_per_rank` and `hidden` > 0 (else ValueError). Any
  size works (larger payloads move in rounds); V2's 2 MiB alignment is not required.
- `num_cpu_bytes`: host memory for Engram storage (part of `num_bytes`). Served: the Engram rows are host memory
  of up to `num_cpu_bytes` (needs `num_bytes`, `num_cpu_bytes <= num_bytes`); the engine's region gets the rest.
- `num_max_tokens_per_rank`: the most tokens any rank dispatches; also the stride of the global token index
  `rank * C + i`. Stored; the default of `dispatch`, which checks `T <= C`.
- `hidden`, `num_topk`, `use_fp8_dispatch`: buffer sizing. Sizing only (through the hint).
- `deterministic`: sort received rows so they do not depend on arrival order. Accepted: rows are always in
  source-rank then token order (the order V2's deterministic sort produces).
- `allow_hybrid_mode`: several nodes use the two-level RDMA + NVLink transfer. Accepted; several nodes
  (`LOCAL_WORLD_SIZE` / `num_ranks_per_node`) use V1's two-stage internode mode.
- `allow_multiple_reduction`: expanded combine may reduce a token's rows on the expert's rank first (rounded to
  x's dtype). True: the slots of a received row are summed in FP32 and rounded to x's dtype before they travel
  (as V2). False: the partial sums travel in FP32 and the result is rounded once; expanded combine with
  `topk_weights` is then a ValueError, as V2 refuses it.
- `prefer_overlap_with_compute`: use fewer SMs. Accepted, ignored (GPU only).
- `sl_idx`, `num_allocated_qps`: RDMA service level, QPs to allocate. Accepted, ignored (GPU network only); must be
  non-negative ints.
- `num_cpu_timeout_secs`: bound of the host-side waits. The engine's timeout (every wait is bounded and raises
  `mtdeepep.CommTimeoutError`; a finite number > 0).
- `num_gpu_timeout_secs`: bound of the device-side waits. Accepted, ignored (no device).
- `explicitly_destroy`: resources are freed only by `destroy()` (else when the buffer is collected, or at exit).

Keyword-only extra: `num_ranks_per_node` (as `Buffer`'s).

Attributes: `group`, `rank_idx`, `num_ranks`, `num_bytes`, `num_max_tokens_per_rank`, `deterministic`,
`allow_hybrid_mode`, `allow_multiple_reduction`, `prefer_overlap_with_compute`, `num_allocated_qps`,
`explicitly_destroy`, `num_scaleout_ranks`/`num_scaleup_ranks` (nodes / ranks per node), `scaleout_rank_idx`,
`scaleup_rank_idx`, `num_rdma_ranks`, `num_nvlink_ranks` (the same two counts).

`dispatch(x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None,
previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None,
do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False, use_tma_aligned_col_major_sf=False)`:

- `x`: bf16 `[T, H]` or the FP8 pair (e4m3, scales). Any float dtype and hidden size (V1's rule), or the FP8 pair
  with float32 scales `[T, H / 128]`.
- `topk_idx`, `topk_weights`: int64 `[T, K]` (-1: no expert; no expert twice for one token), float32 `[T, K]`. The
  same rules, checked (ValueError).
- `cumulative_local_expert_recv_stats`: int32 `[E / R]`, += the received (unaligned) count per local expert. Same.
- `num_experts`, `num_max_tokens_per_rank`, `expert_alignment`: taken from the handle in cached mode (given values
  must agree). Same (ValueError on disagreement).
- `num_sms`: SMs, 0: `get_theoretical_num_sms`. The V1 config's `num_sms` (CPU channels = num_sms / 2); stored on
  the handle and reused by combine.
- `num_qps`: RDMA QPs. Accepted, ignored.
- `previous_event`, `previous_event_before_epilogue`: events to wait for first. Waited for on the caller's thread
  (`EventHandle` or `EventOverlap`).
- `async_with_compute_stream`: do not make the current stream wait. Dispatch: accepted, but the handle's metadata is
  built from the received rows, so dispatch finishes before it returns and its event is already complete. Combine:
  V1's `async_finish` (the transfer runs in the background; wait on the event).
- `allocate_on_comm_stream`: tensor ownership on the comm stream. Accepted, ignored (no streams).
- `handle`: cached mode, reuse the layout; `topk_idx` must be None. V1 cached dispatch with the V1 handle kept in the
  `EPHandle`; `topk_weights` may be given (they are dispatched as a second payload).
- `do_handle_copy`: clone `topk_idx` into the handle. Same.
- `do_cpu_sync`: wait for exact counts (None: True, False with a handle); without it outputs are sized for the worst
  case. Same: rows padded to `R * C` (V1's `num_worst_tokens`), or in expanded mode to `R * C * min(K, E / R)` plus
  alignment; `num_recv_tokens_per_expert_list` is empty; `psum_num_recv_tokens_per_scaleup_rank[-1]` is the number
  of valid rows.
- `do_expand`: the expanded layout: one row per (token, local expert), grouped by expert, each expert's first row
  aligned to `expert_alignment`; `recv_topk_idx` is None and `recv_topk_weights` is 1-D. Built with plain PyTorch
  from the non-expanded rows (an expert's rows in source-rank then token order).
- `do_zero_padding`: zero the alignment gaps (expanded only). Gaps are always zero; `do_zero_padding` without
  `do_expand` is a ValueError.
- `use_tma_aligned_col_major_sf`: FP8 scales column-major, column stride aligned to 4. Same layout.

Returns `(recv_x, recv_topk_idx, recv_topk_weights, handle, event)`. Non-expanded: `recv_x [N, H]` (or the FP8
pair), rows grouped by source rank (ascending), each source's rows in its token order; `recv_topk_idx [N, K]`
int64 local expert ids, -1 where the expert lives elsewhere; `recv_topk_weights [N, K]` float32 with 0 in the -1
slots (V2 leaves the sender's value there; its tests mask those slots).

`combine(x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
previous_event_before_epilogue=None, async_with_compute_stream=False, allocate_on_comm_stream=False)`: sums, per
original token, the rows of `x` that came from it (no weighting), plus `bias` (a tensor or a pair), accumulating in
FP32 and rounding once to x's dtype (bf16, fp16 or fp32; V2 takes bf16 only). `topk_weights` are reduced slot by
slot: each slot takes the value from the rank that owns its expert, so combining the dispatched weights returns the
original ones. Returns `(combined_x [T, H], combined_topk_weights [T, K] float32 or None, event)`.

`EPHandle` fields (V2 names): see the class. `token_metadata_at_forward` and `channel_linked_list` (V2's hybrid
kernels) are None. `EPHandle.deterministic_sort` sorts as upstream (an identity on this executor's outputs, which
are already in that order).

DeepEP 2.1's pipeline (`pp_*`), all-gather session (`agrs_*`, `all_gather`) and Engram (`engram_*`) methods keep
upstream's signatures; they move bytes as tagged, bounded point-to-point messages on the buffer's group
(`peer_link.py`; `pp_ring.py`, `agrs.py`, `engram.py` say what differs: `all_gather` and `engram_fetch` wait for
every rank to issue the same call, and `engram_fetch` is collective where upstream's is a one-sided read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys

import torch
import torch.distributed as dist

from ._C import EventHandle
from ._checks import COMBINE_DTYPES, check_tensor, check_timeout, split_x
from .agrs import AllGatherSessions, agrs_buffer_size_hint, session_bytes
from .buffer import Buffer
from .config import Config
from .engines import Engine, create_engine
from .engines.handles import record_of
from .engram import EngramStore, engram_storage_size_hint
from .event import EventOverlap
from .peer_link import PeerLink
from .pp_ring import PipelineRing, pp_buffer_size_hint

BUFFER_ALIGNMENT = 2 << 20  # V2 sizes its buffers in 2 MiB units; the hint keeps that granularity
SF_BLOCK = 128  # hidden channels per FP8 scale
TMA_SF_ALIGNMENT = 4  # V2 aligns the column stride of column-major scales to 16 bytes (4 float32)

XLike = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"mtdeepep: {message}")


def _check_non_negative_int(name: str, value) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        f"{name} must be a non-negative int, got {value!r}",
    )


def _check_positive_int(name: str, value) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        f"{name} must be a positive int, got {value!r}",
    )


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows` (itself when it has them already)."""
    if tensor.size(0) == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.size(0), *tensor.shape[1:]))])


def _wait(event, name: str) -> None:
    """V2 events are `EventHandle`s (or `EventOverlap`s); on CPU "the stream waits" means this thread waits."""
    if event is None:
        return
    if isinstance(event, EventOverlap):
        event.current_stream_wait()
    elif isinstance(event, EventHandle):
        event.wait()
    else:
        raise ValueError(f"mtdeepep: {name} must be an EventHandle or EventOverlap, got {type(event).__name__}")


def _completed_event() -> EventOverlap:
    return EventOverlap(EventHandle())


@dataclasses.dataclass(eq=False)
class EPHandle:
    """The handle `ElasticBuffer.dispatch` returns: pass it to `combine` and to cached `dispatch`.

    Legend: T tokens of this rank, K top-k slots, R ranks, L = num_experts / R local experts, C =
    num_max_tokens_per_rank, N rows of the (non-expanded) receive layout, X rows of the expanded one.

    Fields with V2's names and meaning:
        do_expand: whether the dispatch used the expanded layout.
        num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: the dispatch's settings.
        topk_idx: `[T, K]` int64, the ids dispatched (a clone with `do_handle_copy`).
        num_recv_tokens: N (the worst case `R * C` without CPU sync).
        num_expanded_tokens: X with CPU sync (the sum of the aligned counts), the worst case without.
        num_recv_tokens_per_expert_list: per local expert, received rows aligned to `expert_alignment` (empty
            without CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: `[num_scaleup_ranks]` int32, inclusive prefix sum over scale-up
            peers (ranks of a node) of the received rows (a row counts once however many local experts it has);
            rows from rank r count for peer `r % num_scaleup_ranks`. The last value is the number of valid rows.
        psum_num_recv_tokens_per_expert: `[L]` int32. Non-expanded: inclusive prefix sum of the aligned counts.
            Expanded: `psum[i] = align(psum[i - 1]) + count[i]`, i.e. expert i's first row plus its real count.
        num_unaligned_recv_tokens_per_expert: `[L]` int32, the real counts.
        recv_src_metadata: `[N, K + 2]` int32 per received row: `[0]` the source's global token index
            `src_rank * C + token`, `[1]` `src_rank * K + ` the first slot whose expert is on this rank, `[2:]` in
            expanded mode the row of each slot in the expanded layout (-1: expert elsewhere), else -1.
        dst_buffer_slot_idx: `[T, K]` int32, for each slot the token's position among the tokens this rank sends to
            the slot expert's rank (-1: no expert).
        token_metadata_at_forward, channel_linked_list: None (V2's hybrid kernels only).

    `legacy_handle` is the engine's handle the work goes through (V1's tuple); `recv_topk_idx` the `[N, K]` local
    ids (-1 elsewhere, and on padding rows).
    """

    do_expand: bool
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int]
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor
    recv_src_metadata: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    token_metadata_at_forward: torch.Tensor | None
    channel_linked_list: torch.Tensor | None
    legacy_handle: tuple
    recv_topk_idx: torch.Tensor
    cached_recv_src_metadata_before_sort: torch.Tensor | None = None

    def deterministic_sort(
        self,
        do_cpu_sync: bool,
        is_cached_dispatch: bool,
        recv_x: torch.Tensor,
        recv_sf: torch.Tensor | None,
        recv_topk_idx: torch.Tensor | None,
        recv_topk_weights: torch.Tensor | None,
        channel_linked_list: torch.Tensor | None = None,
    ) -> None:
        """Sorts a dispatch's received rows in place so that their order does not depend on arrival (upstream's
        semantics). Non-expanded: rows by source global token index (`recv_src_metadata[:, 0]`), padding rows last;
        `recv_x`, `recv_sf`, `recv_topk_idx`, `recv_topk_weights` permuted, and `recv_src_metadata` too unless
        `is_cached_dispatch` (a cached dispatch sorts with the metadata kept from the dispatch that made the handle).
        Expanded (not cached): within each expert's block, rows by source global token index, alignment padding
        last; `recv_x`, `recv_sf`, `recv_topk_weights` permuted and the expanded slots of `recv_src_metadata[:, 2:]`
        updated. mtdeepep's dispatch already returns rows in this order, so on its outputs the sort changes nothing.
        `channel_linked_list` is upstream's hybrid-kernel list: None here (refused otherwise)."""
        _require(channel_linked_list is None, "channel_linked_list must be None (no hybrid kernels here)")
        if not is_cached_dispatch:
            self.cached_recv_src_metadata_before_sort = self.recv_src_metadata.clone()
        before = self.cached_recv_src_metadata_before_sort
        _require(before is not None, "a cached deterministic_sort needs the sort of the dispatch that made the handle")
        num_valid = self.num_valid_recv_tokens
        never = torch.iinfo(torch.int64).max

        def permute(tensor: torch.Tensor | None, order: torch.Tensor) -> None:
            if tensor is not None:
                tensor.copy_(tensor[order])

        if not self.do_expand:
            keys = before[:, 0].long().clone()
            keys[num_valid:] = never
            order = torch.sort(keys, stable=True).indices
            for tensor in (recv_x, recv_sf, recv_topk_idx, recv_topk_weights):
                permute(tensor, order)
            if not is_cached_dispatch:
                permute(self.recv_src_metadata, order)
        elif not is_cached_dispatch:
            num_rows = recv_x.size(0)
            counts = self.num_unaligned_recv_tokens_per_expert.long()
            starts = self.psum_num_recv_tokens_per_expert.long() - counts
            expert_of_row = torch.bucketize(torch.arange(num_rows, device=starts.device), starts[1:], right=True)
            span = int(before[:num_valid, 0].max()) + 2 if num_valid else 1  # source indices, then padding
            keys = expert_of_row * span + (span - 1)
            slots = before[:num_valid, 2:].long()
            valid = slots >= 0
            sources = before[:num_valid, 0].long().unsqueeze(1).expand_as(slots)
            keys[slots[valid]] = expert_of_row[slots[valid]] * span + sources[valid]
            order = torch.sort(keys, stable=True).indices
            for tensor in (recv_x, recv_sf, recv_topk_weights):
                permute(tensor, order)
            moved_to = torch.empty_like(order)
            moved_to[order] = torch.arange(num_rows, dtype=order.dtype, device=order.device)
            current = self.recv_src_metadata[:num_valid, 2:]
            current[valid] = moved_to[slots[valid]].to(current.dtype)

    @property
    def num_valid_recv_tokens(self) -> int:
        """Rows of the receive layout that carry tokens (N with CPU sync; fewer than the padded N without)."""
        return int(self.psum_num_recv_tokens_per_scaleup_rank[-1])

    @property
    def expanded_slots(self) -> torch.Tensor:
        """`[num_valid_recv_tokens, K]` int64: row of each (received row, slot) in the expanded layout, -1 if none."""
        return self.recv_src_metadata[: self.num_valid_recv_tokens, 2:].long()


class ElasticBuffer:
    """DeepEP V2's elastic expert-parallel buffer on mtdeepep (see the module docstring for every argument)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        num_ranks_per_node: int | None = None,
    ) -> None:
        if group is None:
            group = dist.group.WORLD
        for name, value in (
            ("num_cpu_bytes", num_cpu_bytes),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
            ("hidden", hidden),
            ("num_topk", num_topk),
            ("sl_idx", sl_idx),
            ("num_allocated_qps", num_allocated_qps),
        ):
            _check_non_negative_int(name, value)
        if num_cpu_bytes > 0:
            _require(num_bytes is not None, "num_cpu_bytes > 0 needs num_bytes (which includes it), as upstream")
            _require(num_cpu_bytes <= num_bytes, f"num_cpu_bytes={num_cpu_bytes} exceeds num_bytes={num_bytes}")
        timeout_s = check_timeout(num_cpu_timeout_secs)
        if num_bytes is None:
            _require(
                num_max_tokens_per_rank > 0 and hidden > 0,
                "without num_bytes, num_max_tokens_per_rank and hidden must be positive (they size the buffer)",
            )
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        _check_non_negative_int("num_bytes", num_bytes)

        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.explicitly_destroy = explicitly_destroy
        self.num_cpu_bytes = num_cpu_bytes
        self._engine: Engine | None = create_engine(
            group, num_nvl_bytes=num_bytes - num_cpu_bytes, num_ll_bytes=0, low_latency=False,
            num_ranks_per_node=num_ranks_per_node, timeout_s=timeout_s, phase="ElasticBuffer set-up",
        )  # fmt: skip
        self.device = self._engine.device
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()
        # DeepEP 2.1's pipeline, all-gather and Engram primitives: tagged messages on this group (see peer_link.py).
        self._link = PeerLink(group, timeout_s)
        self._pp = PipelineRing(self._link, num_bytes)
        self._agrs = AllGatherSessions(self._link, num_bytes)
        self._engram = EngramStore(self._link, num_cpu_bytes)

    # ---------------------------------------------------------------------------------------------------------
    # Sizes, domains, lifetime

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Bytes of `num_bytes` that let a dispatch and a combine of these sizes move in one round.

        The worst case of both: a rank receives every rank's `num_max_tokens_per_rank` tokens once each. A dispatch
        row carries `hidden` bf16 values (FP8: bytes plus float32 scales per 128 channels), `num_topk` ids (int64)
        and weights (float32) and the source index (int32); a combine row `hidden` bf16 values. Rounded up to 2 MiB.
        `allow_hybrid_mode` and `allow_multiple_reduction` do not change it on this executor.
        """
        _check_positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
        _check_positive_int("hidden", hidden)
        _check_non_negative_int("num_topk", num_topk)
        num_ranks = (dist.group.WORLD if group is None else group).size()
        value_bytes = hidden if use_fp8_dispatch else 2 * hidden
        scale_bytes = 4 * math.ceil(hidden / SF_BLOCK) if use_fp8_dispatch else 0
        dispatch_row = _align(value_bytes + scale_bytes + num_topk * (8 + 4) + 4, 16)
        combine_row = _align(2 * hidden, 16)
        rows = num_ranks * num_max_tokens_per_rank
        return _align(rows * max(dispatch_row, combine_row), BUFFER_ALIGNMENT)

    def _live(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("mtdeepep: this ElasticBuffer was destroyed")
        return self._engine

    def destroy(self) -> None:
        """Finish the queued work and release the buffer. Needs `explicitly_destroy=True`, as upstream; the buffer
        is unusable afterwards (tensors that view its region stay valid while held)."""
        if not self.explicitly_destroy:
            raise RuntimeError("mtdeepep: `explicitly_destroy` must be set to call destroy()")
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.destroy()

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None and not sys.is_finalizing():
            with contextlib.suppress(Exception):  # a destructor must not raise
                engine.destroy()

    def get_logical_domain_size(self) -> tuple[int, int]:
        """`(num_scaleout_ranks, num_scaleup_ranks)`: nodes, ranks per node."""
        engine = self._live()
        return engine.num_nodes, engine.num_ranks_per_node

    def get_physical_domain_size(self) -> tuple[int, int]:
        """`(num_rdma_ranks, num_nvlink_ranks)`: the same two counts (the host is the shared-memory domain)."""
        return self.get_logical_domain_size()

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream: on CPU the caller's thread, so it is already complete."""
        return EventHandle()

    def get_comm_stream(self):
        """The CUDA stream of GPU executors; the CPU executor's comm thread has no stream object: None."""
        return getattr(self._engine, "comm_stream", None)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait for every rank of the group (the stream and ordering options concern GPUs only)."""
        self._live()
        dist.barrier(group=self.group)

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """The SM count dispatch uses when given `num_sms=0`: the V1 default `Buffer.num_sms` (CPU channels are
        `num_sms / 2`). V2 derives it from link bandwidths, which have no meaning here; the arguments are checked as
        upstream (`num_experts` divisible by the group size, `num_scaleout_topk == 0`)."""
        _check_positive_int("num_experts", num_experts)
        _require(
            num_experts % self.num_ranks == 0,
            f"num_experts={num_experts} is not divisible by the {self.num_ranks} ranks",
        )
        _require(
            isinstance(num_topk, int) and 0 < num_topk <= num_experts,
            f"num_topk must be in [1, num_experts={num_experts}], got {num_topk!r}",
        )
        _require(num_scaleout_topk == 0, "num_scaleout_topk must be 0 (as upstream)")
        return Buffer.num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's QP count formula (meaningless without RDMA, kept so callers get the value they expect)."""
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 8 + 1)
        return min(num_qps, self.num_allocated_qps)

    def _config(self, table_config: Config, num_sms: int) -> Config:
        _require(
            isinstance(num_sms, int) and num_sms > 0 and num_sms % 2 == 0,
            f"num_sms must be a positive even int, got {num_sms!r}",
        )
        return dataclasses.replace(table_config, num_sms=num_sms)

    # ---------------------------------------------------------------------------------------------------------
    # DeepEP 2.1: pipeline send / receive, all-gather sessions, Engram (mtdeepep/pp_ring.py, agrs.py, engram.py)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Bytes of `num_bytes` for `pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)`: upstream's
        figure (send and receive slots for both ring neighbours, each rounded to 32 bytes), rounded up to 2 MiB."""
        return pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Sets the largest tensor and the sends each neighbour may have outstanding; finishes the outstanding sends
        and waits for every rank (collective). ValueError if the buffer is smaller than the size hint."""
        self._live()
        self._pp.set_config(num_max_tensor_bytes, num_max_inflight_tensors)

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Sends a copy of `t` (contiguous CPU tensor of at most `num_max_tensor_bytes`) to the previous or next rank
        of the ring; returns at once unless `num_max_inflight_tensors` sends to that rank are still not received
        (then waits, bounded). `num_sms` is accepted (GPU only)."""
        self._live()
        self._pp.send(t, dst_rank_idx, num_sms)

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Receives into `t` the oldest message of the previous or next rank of the ring, bitwise (its size must be
        `t`'s, else ValueError); waits, bounded, naming the rank."""
        self._live()
        self._pp.recv(t, src_rank_idx, num_sms)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup, shapes, dtype: torch.dtype) -> int:
        """Bytes one session needs for gathering tensors of `shapes` (one shape or a sequence) in `dtype`:
        `sum(align(num_ranks * numel * itemsize, 32))`."""
        return session_bytes((dist.group.WORLD if group is None else group).size(), shapes, dtype)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        """`num_max_session_bytes` rounded up to 2 MiB."""
        return agrs_buffer_size_hint(num_max_session_bytes)

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Sets the session's byte and gather limits (`num_max_session_bytes <= num_bytes`) and waits for every rank
        (collective). Outside a session only."""
        self._live()
        self._agrs.set_config(num_max_session_bytes, num_max_all_gathers_per_session)

    def create_agrs_session(self) -> None:
        """Opens a session: its gathers take the session area from the start. Pair with `destroy_agrs_session`."""
        self._live()
        self._agrs.create()

    def destroy_agrs_session(self) -> None:
        """Closes the session after its outstanding transfers finished (bounded); its outputs stay readable until the
        next session's gathers overwrite the area."""
        self._live()
        self._agrs.destroy()

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True):
        """`create_agrs_session` ... `destroy_agrs_session` around the block (a no-op when not `enabled`)."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        finally:
            self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        """This rank's slot of the next gathers' output, for one shape (a tensor) or a sequence (a tuple): fill it,
        then `all_gather` it without a copy. Inside a session."""
        self._live()
        return self._agrs.inplace_tensor(shapes, dtype)

    def all_gather(self, t):
        """Gathers `t` (a tensor, or a sequence of tensors) from every rank, inside a session: returns
        `(gathered, handle)` or `(*gathered, handle)`, `gathered` `[num_ranks, *t.shape]`; call `handle()` before
        reading it. Every rank issues the same gathers in the same order; the call waits until every rank has issued
        it (bounded) and checks that the shapes and dtypes agree (ValueError on every rank)."""
        self._live()
        return self._agrs.all_gather(t)

    @staticmethod
    def get_engram_storage_size_hint(
        num_entries: int, hidden: int, num_max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16
    ) -> tuple[int, int]:
        """`(num_gpu_bytes, num_cpu_bytes)` as upstream: rows rounded to 32 bytes, both rounded up to 2 MiB. Build
        the buffer with `num_bytes=num_gpu_bytes + num_cpu_bytes, num_cpu_bytes=num_cpu_bytes`."""
        return engram_storage_size_hint(num_entries, hidden, num_max_tokens_per_rank, dtype)

    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        """Stores this rank's rows `storage` `[num_entries, hidden]` (bfloat16 or float8_e4m3fn) and, for FP8, the
        replicated scales `sf` `[num_ranks * num_entries, packs]` (float32 or int32). Collective."""
        self._live()
        self._engram.write(storage, sf)

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        """Rows by global index (`indices` `[T, E]` int32, row i of rank r is `r * num_entries + i`): returns a hook
        whose call waits and returns `(data [T, E * hidden], sf [T, E * packs] or None)`. Collective on this
        executor (upstream's is a one-sided read): every rank calls it together, each with its own indices."""
        self._live()
        return self._engram.fetch(indices, num_qps, use_tma_aligned_col_major_sf)

    # ---------------------------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(
        self,
        x: XLike,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[XLike, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """Send each token to the ranks of its experts (see the module docstring for arguments and results).

        Shapes (T tokens, K slots, R ranks, L local experts, C = num_max_tokens_per_rank):
            x: `[T, H]`, or `(float8_e4m3fn [T, H], float32 scales [T, H / 128])`; `T <= C`.
            topk_idx: `[T, K]` int64; topk_weights: `[T, K]` float32.
        Returns:
            recv_x: `[N, H]` (non-expanded) or `[X, H]` (expanded), x's dtype (or the FP8 pair).
            recv_topk_idx: `[N, K]` int64 local ids (-1: elsewhere); None when expanded.
            recv_topk_weights: `[N, K]` float32 (0 where the id is -1), `[X]` float32 when expanded, or None
                without `topk_weights`.
            handle: an `EPHandle` (the given one in cached mode).
            event: an `EventOverlap`, already complete.
        """
        engine = self._live()
        data, scales = split_x(x, self.device)
        num_tokens = data.size(0)
        cached = handle is not None
        if cached:
            _require(isinstance(handle, EPHandle), f"handle must be an EPHandle, got {type(handle).__name__}")
            _require(topk_idx is None, "cached dispatch (with a handle) takes no topk_idx")
            _require(not do_cpu_sync, "cannot do CPU sync with a cached handle (as upstream)")
            _require(
                do_expand == handle.do_expand,
                f"do_expand={do_expand} but the handle was made with do_expand={handle.do_expand}",
            )
            settings = (num_experts, expert_alignment, num_max_tokens_per_rank)
            expected = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            for name, given, value in zip(
                ("num_experts", "expert_alignment", "num_max_tokens_per_rank"), settings, expected
            ):
                _require(given is None or given == value, f"{name}={given} differs from the handle's {value}")
            num_experts, expert_alignment, num_max_tokens_per_rank = expected
            topk_idx = handle.topk_idx
            do_cpu_sync = False
            _require(
                num_tokens == topk_idx.size(0),
                f"x has {num_tokens} tokens but the handle was made for {topk_idx.size(0)}",
            )
        else:
            _require(topk_idx is not None, "dispatch without a handle needs topk_idx")
            _require(num_experts is not None, "dispatch without a handle needs num_experts")
        if num_max_tokens_per_rank is None:
            num_max_tokens_per_rank = self.num_max_tokens_per_rank
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        _check_positive_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
        _check_positive_int("expert_alignment", expert_alignment)
        _check_non_negative_int("num_qps", num_qps)
        _require(
            num_tokens <= num_max_tokens_per_rank,
            f"x has {num_tokens} tokens, more than num_max_tokens_per_rank={num_max_tokens_per_rank}",
        )
        _require(not do_zero_padding or do_expand, "do_zero_padding needs do_expand")
        if not cached:
            self._check_routing(topk_idx, topk_weights, num_tokens, num_experts)
        elif topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape))
        num_sms = self.get_theoretical_num_sms(num_experts, topk_idx.size(1)) if num_sms == 0 else num_sms
        config = self._config(Buffer.get_dispatch_config(self.num_ranks), num_sms)
        num_local_experts = num_experts // self.num_ranks
        if cumulative_local_expert_recv_stats is not None:
            check_tensor(
                "cumulative_local_expert_recv_stats",
                cumulative_local_expert_recv_stats,
                dtypes=(torch.int32,),
                shape=(num_local_experts,),
            )
        _wait(previous_event, "previous_event")
        _wait(previous_event_before_epilogue, "previous_event_before_epilogue")

        if cached:
            recv_x, recv_weights = self._cached_dispatch(engine, data, scales, topk_weights, handle, config)
        else:
            recv_x, recv_weights, handle = self._fresh_dispatch(
                engine,
                data,
                scales,
                topk_idx,
                topk_weights,
                num_experts,
                num_max_tokens_per_rank,
                expert_alignment,
                num_sms,
                config,
                do_cpu_sync,
                do_expand,
                do_handle_copy,
            )
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += handle.num_unaligned_recv_tokens_per_expert
        recv_topk_idx = None if do_expand else handle.recv_topk_idx.clone()
        if do_expand:
            recv_x, recv_weights = self._expand(recv_x, recv_weights, handle)
        if isinstance(recv_x, tuple) and use_tma_aligned_col_major_sf:
            recv_x = (recv_x[0], self._col_major(recv_x[1]))
        return recv_x, recv_topk_idx, recv_weights, handle, _completed_event()

    def _check_routing(self, topk_idx, topk_weights, num_tokens: int, num_experts: int) -> None:
        check_tensor("topk_idx", topk_idx, dim=2, dtypes=(torch.int64,))
        _require(topk_idx.size(0) == num_tokens, f"topk_idx has {topk_idx.size(0)} rows but x has {num_tokens}")
        _require(
            isinstance(num_experts, int) and num_experts > 0 and num_experts % self.num_ranks == 0,
            f"num_experts={num_experts!r} must be a positive multiple of the {self.num_ranks} ranks",
        )
        if topk_idx.numel():
            low, high = int(topk_idx.min()), int(topk_idx.max())
            _require(
                low >= -1 and high < num_experts,
                f"topk_idx values must lie in [-1, {num_experts}), found [{low}, {high}]",
            )
            ordered = topk_idx.sort(dim=1).values
            repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
            _require(not bool(repeated.any()), "topk_idx selects the same expert twice for one token")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape))

    def _fresh_dispatch(
        self,
        engine: Engine,
        data,
        scales,
        topk_idx,
        topk_weights,
        num_experts: int,
        num_max_tokens_per_rank: int,
        expert_alignment: int,
        num_sms: int,
        config: Config,
        do_cpu_sync: bool,
        do_expand: bool,
        do_handle_copy: bool,
    ):
        num_ranks, num_topk = self.num_ranks, topk_idx.size(1)
        num_local_experts = num_experts // num_ranks
        topk_idx = topk_idx.contiguous()
        _, _, per_expert, in_rank, _ = engine.layout(topk_idx, num_experts, None, False)
        # Without CPU sync V2 sizes the outputs for the worst case: V1's num_worst_tokens does exactly that.
        worst_rows = num_ranks * num_max_tokens_per_rank
        out = engine.dispatch(
            data, scales, topk_idx, None if topk_weights is None else topk_weights.contiguous(), in_rank, per_expert,
            expert_alignment, 0 if do_cpu_sync else worst_rows, config.num_channels, None, False,
        )  # fmt: skip
        recv_x = out.recv_x if scales is None else (out.recv_x, out.recv_scales)
        recv_idx, recv_weights, legacy_handle = out.recv_topk_idx, out.recv_topk_weights, out.handle
        num_rows = recv_idx.size(0)

        # Per received row: source rank and token, and the first slot whose expert is local.
        src_rank, src_idx = engine.recv_sources(legacy_handle)
        num_valid = src_rank.numel()
        valid_idx = recv_idx[:num_valid]
        is_local = valid_idx >= 0
        metadata = torch.full((num_rows, num_topk + 2), -1, dtype=torch.int32, device=recv_idx.device)
        metadata[:num_valid, 0] = (src_rank * num_max_tokens_per_rank + src_idx).int()
        first_local_slot = is_local.int().argmax(dim=1)
        metadata[:num_valid, 1] = (src_rank * num_topk + first_local_slot).int()

        unaligned = torch.zeros(num_local_experts, dtype=torch.int64, device=recv_idx.device)
        unaligned.scatter_add_(0, valid_idx[is_local], torch.ones_like(valid_idx[is_local]))
        aligned = (unaligned + expert_alignment - 1) // expert_alignment * expert_alignment
        if do_expand:
            starts = torch.cumsum(aligned, 0) - aligned
            psum_per_expert = starts + unaligned
            metadata[:num_valid, 2:] = self._expanded_slots(valid_idx, unaligned, starts)
        else:
            psum_per_expert = torch.cumsum(aligned, 0)
        if do_cpu_sync:
            num_expanded = int(aligned.sum())
        else:
            num_expanded = _align(
                worst_rows * min(num_topk, num_local_experts) + (expert_alignment - 1) * num_local_experts,
                expert_alignment,
            )

        per_source = torch.bincount(src_rank, minlength=num_ranks)
        per_scaleup_peer = per_source.view(-1, self.num_scaleup_ranks).sum(dim=0)

        dst_rank = torch.where(topk_idx >= 0, topk_idx // num_local_experts, torch.zeros_like(topk_idx))
        position = torch.cumsum(in_rank.long(), dim=0) - 1
        dst_slot = torch.where(topk_idx >= 0, position.gather(1, dst_rank), torch.full_like(topk_idx, -1))

        handle = EPHandle(
            do_expand=do_expand,
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_sms=num_sms,
            topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
            num_recv_tokens=num_rows,
            num_expanded_tokens=num_expanded,
            num_recv_tokens_per_expert_list=aligned.tolist() if do_cpu_sync else [],
            psum_num_recv_tokens_per_scaleup_rank=torch.cumsum(per_scaleup_peer, 0).int(),
            psum_num_recv_tokens_per_expert=psum_per_expert.int(),
            num_unaligned_recv_tokens_per_expert=unaligned.int(),
            recv_src_metadata=metadata,
            dst_buffer_slot_idx=dst_slot.int(),
            token_metadata_at_forward=None,
            channel_linked_list=None,
            legacy_handle=legacy_handle,
            recv_topk_idx=recv_idx,
        )
        return recv_x, recv_weights, handle

    @staticmethod
    def _expanded_slots(valid_idx: torch.Tensor, unaligned: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """`[n_valid, K]` int32: the expanded row of each (row, local slot): expert e's rows start at `starts[e]`
        and hold its (row, slot) pairs in row order (source rank, then token); -1 where the expert is elsewhere."""
        rows, slots = (valid_idx >= 0).nonzero(as_tuple=True)  # row-major: ordered by row
        experts = valid_idx[rows, slots]
        order = torch.argsort(experts, stable=True)  # by expert, rows ascending within one
        first_of_expert = torch.cumsum(unaligned, 0) - unaligned
        rank_in_expert = torch.arange(order.numel(), device=order.device) - first_of_expert[experts[order]]
        expanded = torch.full_like(valid_idx, -1)
        expanded[rows[order], slots[order]] = starts[experts[order]] + rank_in_expert
        return expanded.int()

    def _cached_dispatch(self, engine: Engine, data, scales, topk_weights, handle: EPHandle, config: Config):
        """Cached dispatch, its rows padded to the handle's `num_recv_tokens` (the engine returns only the valid rows
        of a worst-case handle; V2 sizes cached outputs like the dispatch that made the handle)."""
        record = record_of(handle.legacy_handle, engine.handle_kind, engine.group, "cached dispatch")
        recv_data, recv_scales, _ = engine.cached_dispatch(data, scales, record, 0, config.num_channels, None, False)
        rows = handle.num_recv_tokens
        recv_x = (
            _pad_rows(recv_data, rows) if scales is None else (_pad_rows(recv_data, rows), _pad_rows(recv_scales, rows))
        )
        recv_weights = None
        if topk_weights is not None:
            # A cached dispatch moves one payload: the weights travel as a second one ([T, K] float32 rows).
            recv_weights, _, _ = engine.cached_dispatch(
                topk_weights.contiguous(), None, record, 0, config.num_channels, None, False
            )
            recv_weights = _pad_rows(recv_weights, rows).masked_fill(handle.recv_topk_idx < 0, 0.0)
        return recv_x, recv_weights

    @staticmethod
    def _expand(recv_x: XLike, recv_weights: torch.Tensor | None, handle: EPHandle):
        """The expanded layout from the non-expanded rows: row `slot` of expert e is a copy of its (row, slot)."""
        slots = handle.expanded_slots
        rows, topk_slots = (slots >= 0).nonzero(as_tuple=True)
        targets = slots[rows, topk_slots]

        def expand_rows(tensor: torch.Tensor) -> torch.Tensor:
            out = tensor.new_zeros((handle.num_expanded_tokens, tensor.size(1)))
            out[targets] = tensor[rows]
            return out

        expanded_x = tuple(expand_rows(t) for t in recv_x) if isinstance(recv_x, tuple) else expand_rows(recv_x)
        expanded_weights = None
        if recv_weights is not None:
            expanded_weights = recv_weights.new_zeros(handle.num_expanded_tokens)
            expanded_weights[targets] = recv_weights[rows, topk_slots]
        return expanded_x, expanded_weights

    @staticmethod
    def _col_major(scales: torch.Tensor) -> torch.Tensor:
        """V2's TMA-aligned layout: column-major, the column stride rounded up to 4 rows."""
        rows, cols = scales.shape
        out = torch.empty_strided((rows, cols), (1, _align(max(rows, 1), TMA_SF_ALIGNMENT)), dtype=scales.dtype)
        out.copy_(scales)
        return out

    # ---------------------------------------------------------------------------------------------------------
    # Combine

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event=None,
        previous_event_before_epilogue=None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Sum, per original token, the rows that its dispatch sent out (see the module docstring).

        Arguments:
            x: `[N, H]` (non-expanded handle: `handle.num_recv_tokens` rows) or `[X, H]` (expanded:
                `handle.num_expanded_tokens` rows), bfloat16/float16/float32.
            topk_weights: `[N, K]` float32, or `[X]` float32 for an expanded handle.
            bias: `[T, H]` in x's dtype, or a pair of them (either may be None).
        Returns:
            combined_x: `[T, H]` in x's dtype; combined_topk_weights: `[T, K]` float32 or None; event: complete
            unless `async_with_compute_stream` (then wait on it before reading the outputs).
        """
        engine = self._live()
        _require(isinstance(handle, EPHandle), f"handle must be an EPHandle, got {type(handle).__name__}")
        record = record_of(handle.legacy_handle, engine.handle_kind, engine.group, "combine")
        check_tensor("x", x, dim=2, dtypes=COMBINE_DTYPES)
        expected_rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        _require(
            x.size(0) == expected_rows, f"x has {x.size(0)} rows but the handle's dispatch returned {expected_rows}"
        )
        _check_non_negative_int("num_qps", num_qps)
        config = self._config(Buffer.get_combine_config(self.num_ranks), handle.num_sms if num_sms == 0 else num_sms)
        num_topk = handle.topk_idx.size(1)
        if topk_weights is not None:
            shape = (expected_rows,) if handle.do_expand else (expected_rows, num_topk)
            check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=shape)
            _require(
                not handle.do_expand or self.allow_multiple_reduction,
                "expanded combine with topk_weights needs allow_multiple_reduction=True (as upstream)",
            )
        biases = bias if isinstance(bias, tuple) else (bias, None)
        _require(len(biases) == 2, f"bias must be a tensor or a pair of tensors, got {len(biases)} items")
        biases = tuple(
            None if b is None else check_tensor(
                "bias", b, dtypes=(x.dtype,), shape=(handle.topk_idx.size(0), x.size(1)), device=self.device
            ).contiguous()
            for b in biases
        )  # fmt: skip
        _wait(previous_event, "previous_event")
        _wait(previous_event_before_epilogue, "previous_event_before_epilogue")

        out_dtype = x.dtype
        if handle.do_expand:
            x, topk_weights = self._reduce_expanded(x, topk_weights, handle)
            if x.dtype != out_dtype:
                biases = tuple(None if b is None else b.float() for b in biases)
        elif topk_weights is not None:
            # Each slot keeps the value of the rank that owns its expert: zero the others before the sum.
            topk_weights = topk_weights.masked_fill(handle.recv_topk_idx < 0, 0.0)
        needs_cast = x.dtype != out_dtype
        bias0, bias1 = biases
        x = x.contiguous()
        async_finish = async_with_compute_stream and not needs_cast
        combined, combined_weights, event = engine.combine(
            x, topk_weights, bias0, bias1, record, config.num_channels, None, async_finish
        )
        if needs_cast:
            combined = combined.to(out_dtype)
        keep = tuple(t for t in (x, topk_weights, bias0, bias1) if t is not None) if async_finish else None
        return combined, combined_weights, EventOverlap(event, keep)

    def _reduce_expanded(self, x: torch.Tensor, topk_weights: torch.Tensor | None, handle: EPHandle):
        """Fold the expanded rows back to one row per received token: the FP32 sum of its slots, rounded to x's
        dtype with `allow_multiple_reduction` (V2's on-rank reduction), else kept in FP32 so the result is rounded
        once. Returns rows for V1's combine (`handle.num_recv_tokens`, padding rows zero) and the `[N, K]` weights."""
        slots = handle.expanded_slots
        rows, topk_slots = (slots >= 0).nonzero(as_tuple=True)
        reduced = torch.zeros(handle.num_recv_tokens, x.size(1), dtype=torch.float32, device=x.device)
        reduced.index_add_(0, rows, x[slots[rows, topk_slots]].float())
        if self.allow_multiple_reduction:
            reduced = reduced.to(x.dtype)
        weights = None
        if topk_weights is not None:
            weights = torch.zeros(handle.num_recv_tokens, slots.size(1), dtype=torch.float32, device=x.device)
            weights[rows, topk_slots] = topk_weights[slots[rows, topk_slots]]
        return reduced, weights

    def __repr__(self) -> str:
        return (
            f"mtdeepep.ElasticBuffer(rank_idx={self.rank_idx}, num_ranks={self.num_ranks}, "
            f"num_bytes={self.num_bytes}, num_max_tokens_per_rank={self.num_max_tokens_per_rank})"
        )
