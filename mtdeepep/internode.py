"""DeepEP's internode ("normal", two-stage) dispatch and combine, on any torch.distributed backend.

A `Buffer` whose group spans several nodes (node = group rank // `num_ranks_per_node`) owns one
`InternodeBuffer`, which moves tokens in two stages, as upstream's kernels do over RDMA and NVLink:

- network stage, over the "RDMA" group (the ranks with this rank's local index on every node):
  `torch.distributed.all_to_all_single`, counts first. A token crosses it at most once per destination node,
  to the rank with the same local index there (the *forwarder*); a token for this rank's own node goes to
  this rank itself (no bytes leave the process).
- node-local stage, over the node group: an intranode `Buffer` (shared memory) takes each forwarded token
  to the ranks of the node that own its experts.

Combine runs the stages backwards: an intranode combine sums, per forwarded token, the rows of the node's ranks
in FP32 (one partial sum per token and node, rounded once to x's dtype), the network stage returns the partials,
and the source rank sums them per token in FP32, adds the bias and rounds once more.

Every operation runs on the buffer's worker thread (the CPU counterpart of upstream's comm stream), one at a time
in submission order, so every rank issues its collectives in the same order. The caller waits only for the
*notify* part, as upstream's CPU does for its receive counts: the count and routing-metadata exchanges and the
node-local dispatch of the metadata, after which every output's size is known and the outputs are allocated. The
token bytes (network stage, node-local stage, reordering) then move in the background: with `async_finish=True`
the call returns at once with an event that completes when they have arrived; `previous_event` is waited for on
the worker before the operation starts.

Network rows are raw bytes, one row per (token, destination node); see `_RowFormat` for the layout. Temporaries
(network rows, x in the node stage's order, the FP32 accumulator) live in grow-only scratch buffers kept between
calls (see `_Scratch`): fresh allocations of that size cost more in page faults than the copies themselves.

Legend: R ranks, N nodes, L ranks per node (R = N * L), E experts, E_r = E / R experts per rank, T tokens on
this rank, K top-k slots, H hidden, S rows this rank sends over the network (one per token and destination
node), M rows it receives there as a forwarder, N_recv rows it finally receives.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from . import _C
from ._checks import COMBINE_DTYPES, check_num_experts, check_tensor, check_topk_idx, split_x
from .config import Config
from .event import EventOverlap

if TYPE_CHECKING:
    from .buffer import Buffer

XLike = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
_ROW_ALIGNMENT = 16  # network rows are padded to this many bytes (int64 views, float32 view for the node stage)


# ---------------------------------------------------------------------------------------------------------------
# Set-up helpers (used by Buffer.__init__)


def resolve_num_ranks_per_node(num_ranks_per_node: int | None, group_size: int) -> int:
    """Ranks per node: the argument, else the `LOCAL_WORLD_SIZE` environment variable, else the whole group.

    A value of at least `group_size` means one node. Otherwise it must divide `group_size` (ValueError).
    """
    source = "num_ranks_per_node"
    if num_ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return group_size
        source = "LOCAL_WORLD_SIZE"
        try:
            num_ranks_per_node = int(env)
        except ValueError:
            raise ValueError(f"mtdeepep: LOCAL_WORLD_SIZE must be an integer, got {env!r}") from None
    if isinstance(num_ranks_per_node, bool) or not isinstance(num_ranks_per_node, int) or num_ranks_per_node < 1:
        raise ValueError(f"mtdeepep: {source} must be a positive int, got {num_ranks_per_node!r}")
    if num_ranks_per_node >= group_size:
        return group_size
    if group_size % num_ranks_per_node:
        raise ValueError(
            f"mtdeepep: the group's {group_size} ranks cannot be split into nodes of {source}={num_ranks_per_node}"
        )
    return num_ranks_per_node


def check_nodes_share_hosts(hosts: list[str], num_ranks_per_node: int) -> None:
    """ValueError unless the ranks of every node (consecutive group ranks) run on one host: the node-local stage
    moves data through shared memory."""
    for node in range(len(hosts) // num_ranks_per_node):
        first = node * num_ranks_per_node
        node_hosts = sorted(set(hosts[first : first + num_ranks_per_node]))
        if len(node_hosts) > 1:
            raise ValueError(
                f"mtdeepep: node {node} (group ranks {first}..{first + num_ranks_per_node - 1}) spans hosts "
                f"{', '.join(node_hosts)}, but the ranks of one node share memory and must run on one host; set "
                "num_ranks_per_node (or LOCAL_WORLD_SIZE) to the number of ranks per host, with each host's ranks "
                "consecutive in the group"
            )


# ---------------------------------------------------------------------------------------------------------------
# Handle and row format


class InternodeHandle(NamedTuple):
    """The handle of an internode dispatch: a tuple of 8 (pass it to `combine` and to cached `dispatch`).

    Upstream's positions that its tests read are kept: `handle[0]` is `is_token_in_rank` and `handle[-4]` is
    `recv_gbl_rank_prefix_sum`. Everything is on CPU.
    """

    is_token_in_rank: torch.Tensor  # [T, R] bool, as given to dispatch
    send_node_prefix: torch.Tensor  # [N] int32, inclusive prefix over nodes of the rows this rank sends
    send_token_idx: torch.Tensor  # [S] int64, token of each network row, grouped by node, token order within
    fwd_recv_node_prefix: torch.Tensor  # [N] int32, inclusive prefix over nodes of the rows this rank forwards
    recv_gbl_rank_prefix_sum: torch.Tensor  # [R] int32, inclusive prefix over source ranks of the received rows
    recv_src_meta: torch.Tensor  # [N_out, 2] int32, (source rank, token index there) per output row; -1 padding
    recv_perm: torch.Tensor  # [N_recv] int64, output row i is row recv_perm[i] of the node stage's output
    node_handle: tuple  # the node-local stage's intranode handle (forwarded rows -> ranks of this node)


@dataclass(frozen=True)
class _RowFormat:
    """Byte layout of one network row, padded to 16 bytes:

    `[topk_idx int64 x K][topk_weights float32 x K][source rank int32, source token int32][is_token_in_rank of
    the destination node's L ranks, one byte each][scales][x]`. Cached dispatch sends only `[scales][x]`: the
    handle knows the rest. Forwarders hand the rows unchanged (viewed as float32) to the node-local stage, so
    the final receiver finds the source of every row in the row itself.
    """

    num_topk: int  # 0: no top-k ids
    has_weights: bool
    meta_ranks: int  # L when the source and routing bytes are present, 0 in cached mode
    scale_bytes: int
    x_bytes: int

    @property
    def weights_offset(self) -> int:
        return 8 * self.num_topk

    @property
    def src_offset(self) -> int:
        return self.weights_offset + (4 * self.num_topk if self.has_weights else 0)

    @property
    def routing_offset(self) -> int:
        return self.src_offset + (8 if self.meta_ranks else 0)

    @property
    def scales_offset(self) -> int:
        return _align(self.routing_offset + self.meta_ranks, 4)

    @property
    def x_offset(self) -> int:
        return self.scales_offset + self.scale_bytes

    @property
    def row_bytes(self) -> int:
        return _align(self.x_offset + self.x_bytes, _ROW_ALIGNMENT)


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _columns(rows: torch.Tensor, offset: int, num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """The byte columns `[offset, offset + num_bytes)` of `[n, row_bytes]` uint8 rows, viewed as `dtype`."""
    return rows[:, offset : offset + num_bytes].view(dtype)


class _WorkerEvent:
    """The completion of an operation queued on the internode worker (what `EventOverlap` wraps)."""

    def __init__(self, finished: Future) -> None:
        self._finished = finished

    def wait(self) -> None:
        """Blocks until the operation finished; re-raises its error."""
        self._finished.result()

    def query(self) -> bool:
        return self._finished.done()


class _Scratch:
    """Grow-only byte buffers reused across calls for temporaries (never for returned tensors).

    Slot 0: the rows this rank sends over the network (dispatch) or gets back (combine); slot 1: the rows it
    receives as a forwarder (dispatch) or the FP32 accumulator (combine); slot 2: combine's x in the node stage's
    order. Each holds the largest size asked so far.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None, None]

    def get(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        num_bytes = max(1, numel) * dtype.itemsize
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < num_bytes:
            self._buffers[slot] = None  # free the old one first
            buffer = self._buffers[slot] = torch.empty(num_bytes, dtype=torch.uint8)
        return buffer[:num_bytes].view(dtype)[:numel].view(shape)

    def clear(self) -> None:
        self._buffers = [None, None, None]


# ---------------------------------------------------------------------------------------------------------------
# The internode buffer


class InternodeBuffer:
    """Two-stage dispatch/combine for a `Buffer` whose group spans several nodes (see the module docstring).

    Set-up (collective over the buffer's group): creates every node group and every RDMA group with
    `dist.new_group`, in the same order on every rank (with `use_local_synchronization` when the buffer's group
    is not the whole world), and an intranode `Buffer` of `num_nvl_bytes` over this rank's node group. Each
    network wait is bounded by the outer buffer's `timeout_s`; after a timeout the buffer must be destroyed.

    Memory besides the node buffer's region: the scratch buffers keep the largest call's network rows (sent and
    forwarded, each about tokens x nodes x row bytes), combine's x and an FP32 `[T, H]` accumulator until
    `destroy()`.
    """

    def __init__(self, buffer: Buffer, num_ranks_per_node: int) -> None:
        from .buffer import Buffer  # buffer.py imports this module

        self._outer = weakref.ref(buffer)
        self.rank = buffer.rank
        self.num_ranks = buffer.group_size
        self.num_local_ranks = num_ranks_per_node
        self.num_nodes = self.num_ranks // num_ranks_per_node
        self.node, self.local_rank = divmod(self.rank, num_ranks_per_node)
        self.node_group, self.rdma_group = self._new_groups(buffer.group)
        self.node_buffer = Buffer(
            self.node_group, buffer.num_nvl_bytes, explicitly_destroy=True, timeout_s=buffer.timeout_s,
            num_ranks_per_node=num_ranks_per_node,
        )  # fmt: skip
        self._issued: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._scratch = _Scratch()  # used by the worker only
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mtdeepep-internode-{self.rank}")

    def _new_groups(self, group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        global_ranks = dist.get_process_group_ranks(group)
        local_sync = len(global_ranks) != dist.get_world_size()
        L, N = self.num_local_ranks, self.num_nodes
        node_groups = [
            dist.new_group([global_ranks[n * L + i] for i in range(L)], use_local_synchronization=local_sync)
            for n in range(N)
        ]
        rdma_groups = [
            dist.new_group([global_ranks[n * L + i] for n in range(N)], use_local_synchronization=local_sync)
            for i in range(L)
        ]
        node_group, rdma_group = node_groups[self.node], rdma_groups[self.local_rank]
        if node_group.rank() != self.local_rank or rdma_group.rank() != self.node:
            raise ValueError("mtdeepep: internode mode needs the group's ranks in ascending global order")
        return node_group, rdma_group

    @property
    def timeout_s(self) -> float:
        outer = self._outer()
        return self.node_buffer.timeout_s if outer is None else outer.timeout_s

    def destroy(self) -> None:
        """Finish the queued operations, then release the worker, the node-local buffer, the scratch buffers and
        the two process groups."""
        self._worker.shutdown(wait=True)
        self._scratch.clear()
        self.node_buffer.destroy()
        for group in (self.node_group, self.rdma_group):
            dist.destroy_process_group(group)
        del self.node_group, self.rdma_group  # tear the groups down now, on every rank alike

    # -----------------------------------------------------------------------------------------------------------
    # Shared pieces

    @staticmethod
    def _prepare(previous_event: EventOverlap | None, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        """Checks the asynchrony arguments as the intranode path does (ValueError)."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("mtdeepep: allocate_on_comm_stream needs previous_event and async_finish")
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise ValueError(f"mtdeepep: previous_event must be an EventOverlap, got {type(previous_event).__name__}")

    def _run(self, operation: Callable[[Callable[[tuple], None]], None], previous_event: EventOverlap | None,
             async_finish: bool) -> tuple[tuple, EventOverlap]:  # fmt: skip
        """Queues `operation(notify)` on the worker (after `previous_event`) and waits until it calls `notify(outputs)`.

        Returns `(outputs, event)`: without `async_finish` the caller also waits for the rest of the operation and
        the event is a completed one. An error before `notify` is raised here, one after it by the event's wait.
        """
        notified: Future = Future()

        def task() -> None:
            try:
                if previous_event is not None:
                    previous_event.current_stream_wait()
                with torch.no_grad():  # communication is not differentiable (see mtdeepep.autograd)
                    operation(notified.set_result)
            except BaseException as error:
                if notified.done():
                    raise
                notified.set_exception(error)
                return
            if not notified.done():
                notified.set_exception(RuntimeError("mtdeepep: internal error: the operation never notified"))

        finished = self._worker.submit(task)
        outputs = notified.result()
        if not async_finish:
            finished.result()
            return outputs, EventOverlap(_C.EventHandle())
        return outputs, EventOverlap(_WorkerEvent(finished))

    def _exchange(self, output: torch.Tensor, input_: torch.Tensor, output_splits: list[int],
                  input_splits: list[int], phase: str) -> None:  # fmt: skip
        """One `all_to_all_single` over the RDMA group, waited for at most `timeout_s`."""
        self._wait(
            dist.all_to_all_single(output, input_, output_splits, input_splits, group=self.rdma_group, async_op=True),
            phase,
        )

    def _wait(self, work: dist.Work, phase: str, node_stage: bool = False) -> None:
        """Waits for a collective of the RDMA group (or of the node group) at most `timeout_s`."""
        timeout_s = self.timeout_s
        if node_stage:
            first = self.node * self.num_local_ranks
            stage, peers = "node-local stage", list(range(first, first + self.num_local_ranks))
        else:
            stage, peers = "network stage", [n * self.num_local_ranks + self.local_rank for n in range(self.num_nodes)]
        where = f"mtdeepep: rank {self.rank}: internode {phase} ({stage}, with group ranks {peers})"
        failure = None
        try:
            finished = work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as error:
            failure, finished = str(error), False
        # A failed operation must not outlive this call in the frames of the exception raised below: its process
        # group cannot be torn down while it is pending, and a garbage collection that frees it later would block
        # one rank at a random point.
        del work
        if failure is not None and "timed out" not in failure.lower():
            raise _C.CommError(f"{where} failed: {failure}")
        if not finished:
            detail = f": {failure}" if failure else ""
            raise _C.CommTimeoutError(f"{where} did not finish within {timeout_s} s{detail}")

    @contextmanager
    def _node_stage(self, phase: str):
        """Re-raises the node-local stage's errors with the node and the mapping of its local rank numbers."""
        try:
            yield
        except _C.CommError as error:
            first = self.node * self.num_local_ranks
            raise type(error)(
                f"mtdeepep: rank {self.rank}: internode {phase}, node-local stage on node {self.node} (its local "
                f"rank i is group rank {first} + i): {error}"
            ) from error

    def _check_handle(self, handle: tuple, num_tokens: int | None = None) -> InternodeHandle:
        if not isinstance(handle, tuple) or len(handle) != len(InternodeHandle._fields):
            raise ValueError("mtdeepep: handle must be the 8-tuple returned by this buffer's (internode) dispatch")
        handle = InternodeHandle(*handle)
        key = handle.recv_gbl_rank_prefix_sum
        if not isinstance(key, torch.Tensor) or self._issued.get(id(key)) is not key:
            raise ValueError("mtdeepep: the handle was not issued by this buffer (or by a dispatch of it)")
        if num_tokens is not None and handle.is_token_in_rank.size(0) != num_tokens:
            raise ValueError(f"mtdeepep: x has {num_tokens} tokens but the handle was made for "
                             f"{handle.is_token_in_rank.size(0)}")  # fmt: skip
        return handle

    def _node_of_rank(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """`[T, R]` bool -> `[T, N]` bool: does the token go to some rank of each node."""
        return is_token_in_rank.reshape(-1, self.num_nodes, self.num_local_ranks).any(dim=2)

    # -----------------------------------------------------------------------------------------------------------
    # Layout

    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int, previous_event: EventOverlap | None = None,
        async_finish: bool = False, allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, EventOverlap]:  # fmt: skip
        """`Buffer.get_dispatch_layout` for several nodes (local computation, no communication).

        Returns `num_tokens_per_rank [R]` int32, `num_tokens_per_rdma_rank [N]` int32 (a token counts once per
        destination node), `num_tokens_per_expert [E]` int32, `is_token_in_rank [T, R]` bool and a completed event.
        """
        check_num_experts(num_experts, self.num_ranks)
        check_topk_idx(topk_idx, num_experts, torch.device("cpu"))
        self._prepare(previous_event, async_finish, allocate_on_comm_stream)
        if previous_event is not None:  # a local computation: done by the caller, as upstream's is on its stream
            previous_event.current_stream_wait()
        num_tokens = topk_idx.size(0)
        valid_TK = topk_idx >= 0
        owner_TK = torch.where(valid_TK, topk_idx // (num_experts // self.num_ranks), self.num_ranks)
        in_rank_TR = torch.zeros(num_tokens, self.num_ranks + 1, dtype=torch.bool)
        in_rank_TR.scatter_(1, owner_TK, True)
        in_rank_TR = in_rank_TR[:, : self.num_ranks].contiguous()
        per_rank = in_rank_TR.sum(dim=0, dtype=torch.int32)
        per_node = self._node_of_rank(in_rank_TR).sum(dim=0, dtype=torch.int32)
        per_expert = torch.bincount(topk_idx[valid_TK], minlength=num_experts).int()
        return per_rank, per_node, per_expert, in_rank_TR, EventOverlap(_C.EventHandle())

    # -----------------------------------------------------------------------------------------------------------
    # Dispatch

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
        """`Buffer.dispatch` for several nodes; same arguments, results and row order as the intranode path.

        Notify (the caller waits for it): (1) count exchange and (2) metadata exchange over the RDMA group (each
        token once per destination node, with its global top-k ids and weights, source rank and index, and its
        destination ranks in that node); (3) the forwarders' intranode dispatch of that metadata, with node-local
        expert ids (-1 for other nodes' experts); (4) the order of the outputs: the node stage delivers rows grouped
        by forwarder, then by source node; the outputs are grouped by global source rank (a stable sort of the
        source ranks). Data (in the background with `async_finish`): the token bytes (and scales) take the same two
        stages as the metadata, then are gathered into output order (one copy of the received bytes). Cached
        dispatch (`handle`) is the data part alone.

        Returns `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)` as the
        intranode path; `handle` is an `InternodeHandle` (an 8-tuple). If a rank receives more rows than
        `num_worst_tokens`, every rank raises `GroupMismatchError` after the metadata exchange.
        """
        data, scales = split_x(x, torch.device("cpu"))
        _check_counts_args(expert_alignment, num_worst_tokens)
        self._prepare(previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("mtdeepep: cached dispatch (with a handle) takes no topk_idx / topk_weights")
            cached = self._check_handle(handle, data.size(0))

            def cached_dispatch(notify: Callable[[tuple], None]) -> None:
                num_out = self._output_rows(cached.recv_perm.numel(), num_worst_tokens, "cached dispatch")
                recv_x = self._new_recv_x(data, scales, num_out)
                notify((recv_x,))
                self._move_tokens(data, scales, cached, recv_x, config, "cached dispatch")

            (recv_x,), event = self._run(cached_dispatch, previous_event, async_finish)
            return recv_x, None, None, None, handle, event
        num_experts = self._check_layout_args(
            data.size(0), num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
            previous_event,
        )  # fmt: skip
        if topk_idx is not None:
            check_topk_idx(topk_idx, num_experts, torch.device("cpu"), data.size(0))
        if topk_weights is not None:
            if topk_idx is None:
                raise ValueError("mtdeepep: topk_weights needs topk_idx")
            check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape),
                         device=torch.device("cpu"))  # fmt: skip

        def full_dispatch(notify: Callable[[tuple], None]) -> None:
            outputs = self._notify_dispatch(data, scales, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                            topk_weights, expert_alignment, num_worst_tokens, config)  # fmt: skip
            notify(outputs)
            recv_x, handle = outputs[0], outputs[4]
            self._move_tokens(data, scales, InternodeHandle(*handle), recv_x, config, "dispatch")

        outputs, event = self._run(full_dispatch, previous_event, async_finish)
        return (*outputs, event)

    def _check_layout_args(self, num_tokens, per_rank, per_node, in_rank, per_expert, previous_event) -> int:
        """The layout tensors' checks (ValueError); returns the number of experts."""
        if per_rank is None or in_rank is None or per_expert is None:
            raise ValueError(
                "mtdeepep: dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                "num_tokens_per_expert (from get_dispatch_layout)"
            )
        cpu = torch.device("cpu")
        check_tensor("num_tokens_per_expert", per_expert, dim=1, dtypes=(torch.int32,), device=cpu)
        num_experts = per_expert.size(0)
        check_num_experts(num_experts, self.num_ranks)
        check_tensor("num_tokens_per_rank", per_rank, dtypes=(torch.int32,), shape=(self.num_ranks,), device=cpu)
        check_tensor("is_token_in_rank", in_rank, dtypes=(torch.bool,), shape=(num_tokens, self.num_ranks), device=cpu)
        if per_node is not None:
            check_tensor("num_tokens_per_rdma_rank", per_node, dtypes=(torch.int32,), shape=(self.num_nodes,),
                         device=cpu)  # fmt: skip
        # The layout may still be in flight (async get_dispatch_layout); then there is nothing to compare yet.
        if previous_event is None or previous_event.query():
            if not torch.equal(in_rank.sum(dim=0, dtype=torch.int32), per_rank):
                raise ValueError("mtdeepep: num_tokens_per_rank does not match is_token_in_rank's column sums")
            if per_node is not None and not torch.equal(
                self._node_of_rank(in_rank).sum(dim=0, dtype=torch.int32), per_node
            ):
                raise ValueError("mtdeepep: num_tokens_per_rdma_rank does not match is_token_in_rank")
        return num_experts

    def _send_plan(self, is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Network rows: each token once per destination node. Returns `(send_token_idx [S] int64, node [S])`,
        grouped by node, token order within."""
        node_S, token_S = self._node_of_rank(is_token_in_rank).t().nonzero(as_tuple=True)
        return token_S, node_S

    def _notify_dispatch(self, data, scales, is_token_in_rank, per_expert, topk_idx, topk_weights, expert_alignment,
                         num_worst_tokens, config) -> tuple:  # fmt: skip
        """Stages (1)-(4) of `dispatch` and the outputs' allocation: `(recv_x (not yet written), recv_topk_idx,
        recv_topk_weights, num_recv_tokens_per_expert_list, handle)`."""
        L, N = self.num_local_ranks, self.num_nodes
        fmt = _RowFormat(num_topk=0 if topk_idx is None else topk_idx.size(1), has_weights=topk_weights is not None,
                         meta_ranks=L, scale_bytes=0, x_bytes=0)  # fmt: skip
        token_S, node_S = self._send_plan(is_token_in_rank)
        send_counts = torch.bincount(node_S, minlength=N)

        # Stage 1: counts. Per destination node: rows, then this rank's token count of each of its L * E_r experts.
        send_info = torch.cat([send_counts.unsqueeze(1), per_expert.reshape(N, -1).long()], dim=1)
        recv_info = torch.empty_like(send_info)
        self._exchange(recv_info, send_info, [1] * N, [1] * N, "dispatch: count exchange")
        recv_counts = recv_info[:, 0]

        # Stage 2: metadata.
        rows_S = self._pack(fmt, None, None, topk_idx, topk_weights, is_token_in_rank, token_S, node_S)
        rows_M = self._scratch.get(1, (int(recv_counts.sum()), fmt.row_bytes), torch.uint8)
        self._exchange(rows_M, rows_S, recv_counts.tolist(), send_counts.tolist(), "dispatch: metadata exchange")

        # Stage 3: the node-local stage, with node-local expert ids.
        node_in_rank = _columns(rows_M, fmt.routing_offset, L, torch.bool)
        node_topk_idx = node_weights = None
        if topk_idx is not None:
            node_topk_idx = self._node_local_ids(_columns(rows_M, 0, 8 * fmt.num_topk, torch.int64), per_expert)
        if topk_weights is not None:
            node_weights = _columns(rows_M, fmt.weights_offset, 4 * fmt.num_topk, torch.float32).contiguous()
        with self._node_stage("dispatch"):
            recv_rows, recv_idx, recv_weights, counts, node_handle, _ = self.node_buffer.dispatch(
                rows_M.view(torch.float32), num_tokens_per_rank=node_in_rank.sum(dim=0, dtype=torch.int32),
                is_token_in_rank=node_in_rank.contiguous(), num_tokens_per_expert=recv_info[:, 1:].sum(dim=0).int(),
                topk_idx=node_topk_idx, topk_weights=node_weights, expert_alignment=expert_alignment, config=config,
            )  # fmt: skip

        # Stage 4: the output order, grouped by global source rank.
        src_rank_token = _columns(recv_rows.view(torch.uint8), fmt.src_offset, 8, torch.int32)
        src_rank = src_rank_token[:, 0]
        perm = torch.sort(src_rank, stable=True).indices
        num_out = self._output_rows(perm.numel(), num_worst_tokens, "dispatch")
        handle = InternodeHandle(
            is_token_in_rank=is_token_in_rank,
            send_node_prefix=send_counts.cumsum(dim=0).int(),
            send_token_idx=token_S,
            fwd_recv_node_prefix=recv_counts.cumsum(dim=0).int(),
            recv_gbl_rank_prefix_sum=torch.bincount(src_rank, minlength=self.num_ranks).cumsum(dim=0).int(),
            recv_src_meta=_gather_rows(src_rank_token, perm, num_out, -1),
            recv_perm=perm,
            node_handle=node_handle,
        )
        self._issued[id(handle.recv_gbl_rank_prefix_sum)] = handle.recv_gbl_rank_prefix_sum
        out_idx = None if recv_idx is None else _gather_rows(recv_idx, perm, num_out, -1)
        out_weights = None if recv_weights is None else _gather_rows(recv_weights, perm, num_out, 0)
        counts = [] if num_worst_tokens > 0 else counts
        return self._new_recv_x(data, scales, num_out), out_idx, out_weights, counts, handle

    @staticmethod
    def _new_recv_x(data: torch.Tensor, scales: torch.Tensor | None, num_rows: int) -> XLike:
        recv_data = data.new_empty(num_rows, data.size(1))
        return recv_data if scales is None else (recv_data, scales.new_empty(num_rows, scales.size(1)))

    def _move_tokens(self, data, scales, handle: InternodeHandle, recv_x: XLike, config, phase: str) -> None:
        """The data part of a dispatch: x (and scales) through both stages, gathered into `recv_x` in output order."""
        fmt = _RowFormat(0, False, 0, _row_bytes(scales), _row_bytes(data))
        send_counts = _counts(handle.send_node_prefix)
        recv_counts = _counts(handle.fwd_recv_node_prefix)
        rows_S = self._pack(fmt, data, scales, None, None, None, handle.send_token_idx, None)
        rows_M = self._scratch.get(1, (sum(recv_counts), fmt.row_bytes), torch.uint8)
        self._exchange(rows_M, rows_S, recv_counts, send_counts, f"{phase}: token exchange")
        with self._node_stage(phase):
            recv_rows, *_ = self.node_buffer.dispatch(rows_M.view(torch.float32), handle=handle.node_handle,
                                                      config=config)  # fmt: skip
        recv_rows = recv_rows.view(torch.uint8)
        recv_data, recv_scales = (recv_x, None) if scales is None else recv_x
        x_cols = recv_rows[:, fmt.x_offset : fmt.x_offset + fmt.x_bytes]
        _gather_rows_into(recv_data.view(torch.uint8), x_cols, handle.recv_perm, 0)
        if recv_scales is not None:
            scale_cols = recv_rows[:, fmt.scales_offset : fmt.scales_offset + fmt.scale_bytes]
            _gather_rows_into(recv_scales.view(torch.uint8), scale_cols, handle.recv_perm, 0)

    def _node_local_ids(self, topk_idx_MK: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> ids among this node's `L * E_r` experts, -1 for experts of other nodes."""
        experts_per_node = per_expert.numel() // self.num_nodes
        local_MK = topk_idx_MK - self.node * experts_per_node
        return torch.where((topk_idx_MK >= 0) & (local_MK >= 0) & (local_MK < experts_per_node), local_MK, -1)

    def _output_rows(self, num_recv: int, num_worst_tokens: int, phase: str) -> int:
        """Output rows: `num_recv`, or `num_worst_tokens` when set. Then every rank learns (two small all-reduces,
        node group then RDMA group) whether some rank receives more rows than its `num_worst_tokens`, and all raise
        `GroupMismatchError` together, before any token bytes move, so no peer is left waiting and the buffer stays
        usable."""
        if num_worst_tokens == 0:
            return num_recv
        excess = torch.zeros(self.num_ranks, dtype=torch.int64)
        excess[self.rank] = num_recv if num_recv > num_worst_tokens else 0
        self._wait(dist.all_reduce(excess, group=self.node_group, async_op=True), f"{phase}: num_worst_tokens check",
                   node_stage=True)  # fmt: skip
        self._wait(dist.all_reduce(excess, group=self.rdma_group, async_op=True), f"{phase}: num_worst_tokens check")
        over = excess.nonzero().flatten().tolist()
        if over:
            received = ", ".join(f"rank {r}: {excess[r].item()}" for r in over)
            raise _C.GroupMismatchError(
                f"mtdeepep: rank {self.rank}: internode {phase}: some ranks receive more tokens than "
                f"num_worst_tokens={num_worst_tokens} ({received})"
            )
        return num_worst_tokens

    def _pack(self, fmt: _RowFormat, data, scales, topk_idx, topk_weights, is_token_in_rank, token_S, node_S):
        """`[S, row_bytes]` uint8 network rows (see `_RowFormat`)."""
        rows_S = self._scratch.get(0, (token_S.numel(), fmt.row_bytes), torch.uint8)
        if fmt.num_topk:
            torch.index_select(topk_idx, 0, token_S, out=_columns(rows_S, 0, 8 * fmt.num_topk, torch.int64))
        if fmt.has_weights:
            weights = _columns(rows_S, fmt.weights_offset, 4 * fmt.num_topk, torch.float32)
            torch.index_select(topk_weights, 0, token_S, out=weights)
        if fmt.meta_ranks:
            src = _columns(rows_S, fmt.src_offset, 8, torch.int32)
            src[:, 0] = self.rank
            src[:, 1] = token_S
            L = self.num_local_ranks
            routing_TNL = is_token_in_rank.reshape(-1, self.num_nodes, L)
            routing = _columns(rows_S, fmt.routing_offset, L, torch.bool)
            routing.copy_(routing_TNL[token_S, node_S])
            rows_S[:, fmt.routing_offset + L : fmt.scales_offset] = 0
        if scales is not None:
            scale_cols = _columns(rows_S, fmt.scales_offset, fmt.scale_bytes, scales.dtype)
            torch.index_select(scales, 0, token_S, out=scale_cols)
        if data is not None:
            x_cols = rows_S[:, fmt.x_offset : fmt.x_offset + fmt.x_bytes]
            torch.index_select(data.view(torch.uint8), 0, token_S, out=x_cols)
        rows_S[:, fmt.x_offset + fmt.x_bytes :] = 0  # padding: keeps the bytes that travel deterministic
        return rows_S

    # -----------------------------------------------------------------------------------------------------------
    # Combine

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
        """`Buffer.combine` for several nodes: same arguments and results as the intranode path.

        Stages: (1) undo the dispatch's reordering (one copy of x); (2) intranode combine to the forwarders, FP32
        sums rounded once to x's dtype (one partial per token and node); (3) the partials (and the slot-wise
        weight sums, float32) go back over the RDMA group; (4) the source sums each token's node partials in
        FP32, adds the bias and rounds once to x's dtype. The outputs' sizes are known from the handle, so with
        `async_finish` all four stages run in the background.
        """
        h = self._check_handle(handle)
        num_tokens = h.is_token_in_rank.size(0)
        cpu = torch.device("cpu")
        check_tensor("x", x, dim=2, dtypes=COMBINE_DTYPES, device=cpu)
        if x.size(0) != h.recv_src_meta.size(0):
            raise ValueError(f"mtdeepep: x has {x.size(0)} rows but the handle's dispatch received "
                             f"{h.recv_src_meta.size(0)}")  # fmt: skip
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dim=2, dtypes=(torch.float32,), device=cpu)
            if topk_weights.size(0) != x.size(0):
                raise ValueError(f"mtdeepep: topk_weights has {topk_weights.size(0)} rows, x has {x.size(0)}")
        biases = _check_biases(bias, num_tokens, x)
        self._prepare(previous_event, async_finish, allocate_on_comm_stream)

        def combine(notify: Callable[[tuple], None]) -> None:
            combined = x.new_empty(num_tokens, x.size(1))
            combined_w = None if topk_weights is None else torch.empty(num_tokens, topk_weights.size(1))
            notify((combined, combined_w))
            self._combine(x, h, topk_weights, biases, config, combined, combined_w)

        (combined, combined_w), event = self._run(combine, previous_event, async_finish)
        return combined, combined_w, event

    def _combine(self, x, h: InternodeHandle, topk_weights, biases, config, combined, combined_w) -> None:
        """The four stages of `combine`, writing `combined` `[T, H]` and `combined_w` `[T, K]` (or None)."""
        num_tokens = combined.size(0)
        # Stage 1: back to the node stage's row order.
        num_recv = h.recv_perm.numel()
        node_order = torch.empty_like(h.recv_perm)
        node_order[h.recv_perm] = torch.arange(num_recv)
        x_node = self._scratch.get(2, (num_recv, x.size(1)), x.dtype)
        torch.index_select(x, 0, node_order, out=x_node)
        w_node = None if topk_weights is None else topk_weights.index_select(0, node_order)

        # Stage 2: partial sums per node, at the forwarders.
        with self._node_stage("combine"):
            partial_M, partial_w_M, _ = self.node_buffer.combine(x_node, h.node_handle, topk_weights=w_node,
                                                                 config=config)  # fmt: skip

        # Stage 3: the partials go home.
        send_counts, recv_counts = _counts(h.fwd_recv_node_prefix), _counts(h.send_node_prefix)
        partial_S = self._scratch.get(0, (sum(recv_counts), x.size(1)), x.dtype)
        self._send_back(partial_S, partial_M, recv_counts, send_counts, "combine: partial-sum return")
        partial_w_S = None
        if partial_w_M is not None:
            partial_w_S = partial_w_M.new_empty(sum(recv_counts), partial_w_M.size(1))
            self._send_back(partial_w_S, partial_w_M, recv_counts, send_counts, "combine: weight return")

        # Stage 4: FP32 sum of the node partials, bias, one rounding.
        acc = _sum_rows(self._scratch.get(1, (num_tokens, x.size(1)), torch.float32), partial_S, h.send_token_idx,
                        recv_counts)  # fmt: skip
        for b in biases:
            if b is not None:
                acc += b
        combined.copy_(acc)
        if combined_w is not None:
            _sum_rows(combined_w, partial_w_S, h.send_token_idx, recv_counts)

    def _send_back(self, rows_S: torch.Tensor, rows_M: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], phase: str) -> None:  # fmt: skip
        """Forwarded rows `rows_M` back to their source ranks, into `rows_S` (bytes over the RDMA group)."""
        self._exchange(rows_S.view(torch.uint8), rows_M.contiguous().view(torch.uint8), output_splits, input_splits,
                       phase)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Small helpers


def _check_counts_args(expert_alignment: int, num_worst_tokens: int) -> None:
    if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise ValueError(f"mtdeepep: expert_alignment must be a positive int, got {expert_alignment}")
    if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        raise ValueError(f"mtdeepep: num_worst_tokens must be a non-negative int, got {num_worst_tokens}")


def _check_biases(bias, num_tokens: int, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    biases = bias if isinstance(bias, tuple) else (bias, None)
    if len(biases) != 2:
        raise ValueError(f"mtdeepep: bias must be a tensor or a pair of tensors, got {len(biases)} items")
    return tuple(
        None if b is None else check_tensor(
            "bias", b, dtypes=(x.dtype,), shape=(num_tokens, x.size(1)), device=torch.device("cpu")
        )
        for b in biases
    )  # fmt: skip


def _row_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.size(1) * tensor.element_size()


def _counts(prefix: torch.Tensor) -> list[int]:
    """Inclusive prefix sums -> the counts."""
    return torch.diff(prefix, prepend=prefix.new_zeros(1)).tolist()


def _gather_rows(rows: torch.Tensor, perm: torch.Tensor, num_out: int, fill: float) -> torch.Tensor:
    """`rows[perm]` (rows may be a strided view), padded with `fill` up to `num_out` rows."""
    return _gather_rows_into(rows.new_empty((num_out, *rows.shape[1:])), rows, perm, fill)


def _gather_rows_into(out: torch.Tensor, rows: torch.Tensor, perm: torch.Tensor, fill: float) -> torch.Tensor:
    """Writes `rows[perm]` into the first rows of `out` and `fill` into the others; returns `out`."""
    torch.index_select(rows, 0, perm, out=out[: perm.numel()])
    out[perm.numel() :] = fill
    return out


_SUM_CHUNK_ROWS = 256  # rows converted to float32 at a time (a small temporary instead of a [S, H] one)


def _sum_rows(out: torch.Tensor, rows_S: torch.Tensor, token_S: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Writes into `out` `[T, C]` float32 the FP32 sum of each token's rows (one per node that received it), node by
    node in ascending order; tokens without rows get 0. Returns `out`."""
    out.zero_()
    begin = 0
    for count in counts:
        for start in range(begin, begin + count, _SUM_CHUNK_ROWS):
            end = min(start + _SUM_CHUNK_ROWS, begin + count)
            out.index_add_(0, token_S[start:end], rows_S[start:end].float())
        begin += count
    return out
