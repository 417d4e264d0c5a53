"""DeepEP's internode ("normal", two-stage) dispatch and combine: a node engine composed with a network stage.

When a buffer's group spans several nodes (node = group rank // `num_ranks_per_node`), `InternodeEngine` moves tokens
in two stages, as upstream's kernels do over RDMA and NVLink:

- network stage, over the "RDMA" group (the ranks with this rank's local index on every node):
  `torch.distributed.all_to_all_single`, counts first. A token crosses it at most once per destination node, to the
  rank with the same local index there (the *forwarder*); a token for this rank's own node goes to this rank itself
  (no bytes leave the process);
- node-local stage, on the node engine (any executor; shared memory on CPU): each forwarded token goes to the ranks of
  the node that own its experts. The node engine is called directly, with checked arguments: no facade, no host sync.

Combine runs the stages backwards: the node engine sums, per forwarded token, the rows of the node's ranks in FP32
(one partial sum per token and node, rounded once to x's dtype), the network stage returns the partials, and the
source rank sums them per token in FP32, adds the bias and rounds once more.

Every operation runs on this engine's worker thread (the counterpart of upstream's comm stream), one at a time in
submission order, so every rank issues its collectives in the same order. The caller waits only for the *notify*
part, as upstream's CPU does for its receive counts: the count and routing-metadata exchanges and the node-local
dispatch of the metadata, after which every output's size is known. The token bytes then move in the background
(`async_finish`), one source node at a time: this node's own rows go through the node-local stage while the other
nodes' rows are on the network, and so on in a shift over the nodes (as DeepEP overlaps its RDMA and NVLink
stages). Per source node, the node stage delivers the rows in output order, so they land in their block of the
outputs without a reordering. `previous_event` is waited for on the worker first.

Identity: combine and cached dispatch first all-gather the (buffer uid, dispatch seq) of their handle over the whole
group; if the ranks disagree (handles of different dispatches), every rank raises `GroupMismatchError` before any row
moves. Waits: every network wait is bounded by the timeout; each operation records its number in the rendezvous store,
so a timeout names the ranks that did not reach it.

Legend: R ranks, N nodes, L ranks per node (R = N * L), E experts, E_r = E / R experts per rank, T tokens on this
rank, K top-k slots, H hidden, S rows this rank sends over the network (one per token and destination node), M rows
it receives there as a forwarder, N_recv rows it finally receives.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _C
from .base import LIVE_WORKER_ENGINES, DispatchOutputs, Engine, Event, WorkerEngine, shutdown_all_engines
from .handles import DispatchRecord, InternodeHandle, attach, low_latency_handle
from .peers import BoundedStore, PeerTable, StoreUnreachable
from .setup import group_key, group_ranks, new_group

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_ROW_ALIGNMENT = 16  # network rows are padded to this many bytes (int64 views, float32 view for the node stage)
_NOTIFY_MARGIN_S = 30.0  # the caller's wait for an operation's outputs: this beyond the timeouts of those ahead
_STORE_REPORT_S = 5.0  # publishing a failure in the store waits at most this (the store may be unreachable)
_WAIT_SLICE_S = 0.05  # network waits check for failures (this rank's, or published by a peer) this often


# ---------------------------------------------------------------------------------------------------------------
# Handle and row format


@dataclass(frozen=True)
class _Chunk:
    """The rows this rank's node forwarded from one source node: one step of the pipelined token movement.

    The node stage delivers them in output order (by forwarder, i.e. by the source node's ranks, each in token order),
    so they are output rows `[out_begin, out_begin + out_rows)` as they are.
    """

    source_node: int
    node_record: DispatchRecord  # the node-local stage's dispatch of these rows
    out_begin: int
    out_rows: int


@dataclass(frozen=True)
class _InternodeState:
    """The private copies an internode record keeps (see mtdeepep.engines.handles)."""

    send_token_idx: torch.Tensor  # [S] int64, token of each network row, grouped by destination node
    send_counts: list[int]  # network rows this rank sends to each node
    recv_counts: list[int]  # network rows this rank forwards from each node
    chunks: list[_Chunk]  # in step order: this node first, then node + 1, node + 2, ... (mod N)
    num_topk: int  # the dispatch's top-k (0: none), for the room its combine needs

    @property
    def num_received(self) -> int:
        return sum(chunk.out_rows for chunk in self.chunks)


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


class _Scratch:
    """Grow-only byte buffers reused across calls for temporaries (never for returned tensors): fresh allocations of
    that size cost more in page faults than the copies themselves. Slots: 0 the rows this rank sends over the network
    (dispatch) or gets back (combine); 1 the rows it receives as a forwarder (dispatch) or the FP32 accumulator
    (combine); 2 combine's x in the node stage's order."""

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
# The engine


class InternodeEngine(WorkerEngine):
    """Two-stage dispatch/combine for a group that spans several nodes (see the module docstring).

    Set-up (collective over the group, after the node engine connected): a node group and an RDMA group per rank
    (`dist.new_group`, gloo, in the same order on every rank, bounded by the timeout) and a private group over all
    ranks for identity checks and the low-latency collective transport. Memory besides the node engine's: the scratch
    buffers keep the largest call's network rows and combine's temporaries until `destroy()`.
    """

    handle_kind = "internode"

    def __init__(self, group: dist.ProcessGroup, node: Engine, num_ranks_per_node: int, timeout_s: float, uid: int,
                 *, low_latency: bool) -> None:  # fmt: skip
        self.node = node
        self.device = node.device
        self.rank, self.num_ranks = group.rank(), group.size()
        self.num_ranks_per_node = num_ranks_per_node
        self.num_nodes = self.num_ranks // num_ranks_per_node
        self.node_index, self.local_rank = divmod(self.rank, num_ranks_per_node)
        self.group = group_key(group)
        self.uid = uid
        self.timeout_s = timeout_s
        self._creator_pid = os.getpid()
        self._dispatches = 0  # dispatches agreed by every rank (the worker's): the next one's number is one more
        self._ops = 0  # operations started on the worker, recorded in the store for timeout reports
        # Every store call is bounded (a host that dropped off the network blocks them for minutes otherwise).
        self._store = BoundedStore(dist.distributed_c10d._get_default_store(), f"mtdeepep/alive/{uid}/{self.rank}",
                                   f"mtdeepep-store-{self.rank}")  # fmt: skip
        self._progress_prefix = f"mtdeepep/progress/{uid}"
        self._failure_key = f"mtdeepep/failed/{uid}"
        self._failure: str | None = None  # set once the ranks may be out of step: no further work
        self._scratch = _Scratch()  # used by the worker only
        self.node_group, self.rdma_group, self.world_group = self._new_groups(group)
        self.peers = PeerTable(self.world_group, self._store, f"mtdeepep/alive/{uid}")  # hosts, for error messages
        weakref.finalize(self, self._store.close)  # its heartbeat thread ends with the engine
        self.low_latency = None
        if low_latency:
            self.low_latency = _C.LowLatencyProtocol(node.host_runtime, self.rank, self.num_ranks, False)
        # Low-latency calls whose exchange may still run on the worker: [event, hook called].
        self._ll_in_flight: deque[list] = deque()
        self._start_worker("internode")

    def _new_groups(self, group: dist.ProcessGroup):
        ranks = group_ranks(group)
        all_ranks_call = len(ranks) == dist.get_world_size()
        L, N = self.num_ranks_per_node, self.num_nodes
        node_groups = [
            new_group([ranks[n * L + i] for i in range(L)], self.timeout_s, all_ranks_call) for n in range(N)
        ]
        rdma_groups = [
            new_group([ranks[n * L + i] for n in range(N)], self.timeout_s, all_ranks_call) for i in range(L)
        ]
        world_group = new_group(list(ranks), self.timeout_s, all_ranks_call)
        node_group, rdma_group = node_groups[self.node_index], rdma_groups[self.local_rank]
        if node_group.rank() != self.local_rank or rdma_group.rank() != self.node_index:
            raise ValueError("mtdeepep: internode mode needs the group's ranks in ascending global order")
        return node_group, rdma_group, world_group

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.node.set_timeout(timeout_s)

    def interrupt(self, reason: str) -> None:
        self._fail(reason)
        self.node.interrupt(reason)

    def destroy(self) -> None:
        """Finishes the queued operations, then releases the worker, the node engine, the scratch buffers and the
        process groups (nothing in a forked child)."""
        if os.getpid() != self._creator_pid:
            return
        LIVE_WORKER_ENGINES.discard(self)
        self._worker.shutdown(wait=True)
        self._store.close()
        self._scratch.clear()
        self.node.destroy()
        for group in (self.node_group, self.rdma_group, self.world_group):
            dist.destroy_process_group(group)
        del self.node_group, self.rdma_group, self.world_group  # tear the groups down now, on every rank alike

    def local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor:
        return self.node.local_buffer_tensor(dtype, offset, use_rdma_buffer)

    def empty(self, sizes, dtype):
        return self.node.empty(sizes, dtype)

    def _new_recv(self, data: torch.Tensor, scales: torch.Tensor | None, num_rows: int, num_topk: int):
        """`(recv_data, recv_scales, placed)`: placed in the node engine's memory, where the node stage's senders
        write the rows directly (see `Engine.placed_empty`), when it has room; else from its allocator, and the
        receiver copies each step's rows in."""
        recv_data = self.node.placed_empty((num_rows, data.size(1)), data.dtype, num_topk)
        recv_scales = None
        if recv_data is not None and scales is not None:
            recv_scales = self.node.placed_empty((num_rows, scales.size(1)), scales.dtype, num_topk)
            if recv_scales is None:
                recv_data = None
        if recv_data is not None:
            return recv_data, recv_scales, True
        recv_data = self.empty((num_rows, data.size(1)), data.dtype)
        return recv_data, None if scales is None else self.empty((num_rows, scales.size(1)), scales.dtype), False

    # -----------------------------------------------------------------------------------------------------------
    # Execution on the worker, waits, identity

    def _task(self, body: Callable[[], None]) -> Callable[[], None]:
        """Wraps an operation for the worker: it records its number in the store (for timeout reports) and, if it
        fails in a way that leaves the ranks out of step, makes this engine refuse further work and tells the peers
        (a GroupMismatchError, which every rank raises alike, does not)."""

        def run() -> None:
            self._check_usable()
            self._ops += 1
            try:
                try:
                    self._store.call(self.timeout_s, "set", f"{self._progress_prefix}/{self.rank}", str(self._ops))
                except StoreUnreachable as error:  # this host is cut off (or the store's host is gone): say which
                    cause = self.peers.explain("", self.timeout_s) or str(error)
                    raise _C.CommError(
                        f"mtdeepep: rank {self.rank}: internode operation #{self._ops}: {cause}"
                    ) from error
                with torch.no_grad():  # communication is not differentiable (see mtdeepep.autograd)
                    body()
            except _C.GroupMismatchError:
                raise
            except Exception as error:  # the peers may be inside this operation: they must not wait for this rank
                # A timeout (the node-local stage's included) is published as one: a peer it stops raises the same
                # CommTimeoutError, naming the ranks this rank waited for.
                self._fail(str(error), timed_out=isinstance(error, _C.CommTimeoutError))
                raise

        return run

    def _await_outputs(self, notified: Future) -> tuple:
        """The worker runs the operations queued before this one first (those `_busy` counts with it), each bounded
        by the timeout, then this one's notify part: waited for at most that long (plus a margin), so a stuck worker
        cannot hang the caller."""
        deadline = self.timeout_s * max(1, self._busy) + _NOTIFY_MARGIN_S
        try:
            return notified.result(timeout=deadline)
        except FutureTimeout:
            if notified.done():  # the operation's own error (a CommTimeoutError is a TimeoutError too)
                raise
            message = (
                f"mtdeepep: rank {self.rank}: internode operation #{self._ops + 1}: its outputs were not ready "
                f"within {deadline:.1f} s (the worker is stuck in an earlier operation)"
            )
            self.interrupt(message)
            raise _C.CommTimeoutError(message) from None

    # ---- failure state ----

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise _C.CommError(
                f"mtdeepep: rank {self.rank}: the internode buffer is unusable after an earlier failure (destroy it): "
                f"{self._failure}"
            )

    def _fail(self, reason: str, timed_out: bool = False) -> None:
        """The ranks are out of step: refuse further work (no collective of this engine's groups may be issued
        again), and publish the reason in the store, where the peers' network waits look for it (the first
        failure published stays: the peers that stop because of it do not replace it)."""
        if self._failure is not None:
            return
        self._failure = reason
        if not reason.startswith("mtdeepep: rank"):
            reason = f"rank {self.rank}: {reason}"
        with contextlib.suppress(Exception):  # the store may be gone (its host exited or is unreachable)
            self._store.call(min(self.timeout_s, _STORE_REPORT_S), "compare_set", self._failure_key, "",
                             ("T|" if timed_out else "E|") + reason)  # fmt: skip

    def _peer_failure(self, timeout_s: float | None = None) -> tuple[str, bool] | None:
        """A failure some rank published, and whether it was a timeout (None if none); each store call waited for at
        most `timeout_s` (default: the buffer's timeout)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            if self._store.call(timeout_s, "check", [self._failure_key]):
                kind, _, reason = self._store.call(timeout_s, "get", self._failure_key).decode().partition("|")
                return reason, kind == "T"
        except StoreUnreachable:
            return self.peers.explain("", self.timeout_s), False
        except (RuntimeError, dist.DistError) as error:
            lost = self.peers.explain(str(error), self.timeout_s)
            return f"the rendezvous store is lost ({lost or error})", False
        return None

    def _exchange(self, output: torch.Tensor, input_: torch.Tensor, output_splits: list[int],
                  input_splits: list[int], phase: str, group=None) -> None:  # fmt: skip
        """One `all_to_all_single` over the RDMA group (or `group`), waited for at most the timeout."""
        group = self.rdma_group if group is None else group
        self._wait(dist.all_to_all_single(output, input_, output_splits, input_splits, group=group, async_op=True),
                   phase)  # fmt: skip

    def _wait(self, work: dist.Work, phase: str) -> None:
        """Waits for a collective of one of this engine's groups, at most the timeout, in short slices: between
        them a failure of this rank (Ctrl-C, exit) or one a peer published ends the wait at once, naming it. A
        timeout names the ranks that did not reach the current operation (from the store)."""
        where = f"mtdeepep: rank {self.rank}: internode {phase} (network stage, operation #{self._ops})"
        deadline = time.monotonic() + self.timeout_s
        failure = stop = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                if work.wait(timeout=timedelta(seconds=max(0.001, min(_WAIT_SLICE_S, remaining)))):
                    return
            except RuntimeError as error:
                if "timed out" not in str(error).lower():
                    failure = str(error)
                    break
            stop = (self._failure, False) if self._failure is not None else self._peer_failure(remaining)
            if stop is not None or remaining <= 0:
                break
        # A pending operation must not outlive this call in the frames of the exception raised below: its process
        # group cannot be torn down while it is pending, and a garbage collection that frees it later would block
        # one rank at a random point.
        del work
        if failure is not None:
            culprit = self._peer_failure()
            if culprit is not None:  # the collective broke because a peer failed: what that peer reported
                reason, timed_out = culprit
                raise (_C.CommTimeoutError if timed_out else _C.CommError)(f"{where} stopped: {reason}")
            lost = self.peers.explain(failure, self.timeout_s)
            message = f"{where} failed: {lost}" if lost else f"{where} failed: {failure}"
            raise _C.CommError(message + (f" (gloo: {failure})" if lost else ""))
        if stop is not None:
            reason, timed_out = stop
            # Another rank already timed out waiting for the same missing rank: the same error, sooner.
            raise (_C.CommTimeoutError if timed_out else _C.CommError)(f"{where} stopped: {reason}")
        missing = self._missing_ranks()
        if self.peers.multi_host or missing.startswith("every rank reached"):
            # Across hosts, a rank behind may only wait for a lost host itself: the ranks whose heartbeat stopped (or
            # this host's own isolation) come first. On one host, ranks that stopped inside the operation.
            lost = self.peers.explain("", self.timeout_s)
            if lost:
                missing = lost if missing.startswith("every rank reached") else f"{lost}; {missing}"
        message = f"{where} did not finish within {self.timeout_s} s: {missing}"
        self._fail(message, timed_out=True)
        raise _C.CommTimeoutError(message)

    def _missing_ranks(self) -> str:
        """Which ranks have not reached this rank's current operation, from the progress each records in the store."""
        behind = []
        try:
            for r in range(self.num_ranks):
                key = f"{self._progress_prefix}/{r}"
                reached = int(self._store.call(self.timeout_s, "get", key)) if self._store.call(
                    self.timeout_s, "check", [key]) else 0  # fmt: skip
                if reached < self._ops:
                    behind.append(f"{r} (at operation #{reached})")
        except (RuntimeError, ValueError) as error:
            return f"the ranks' progress could not be read ({error})"
        if not behind:
            return "every rank reached this operation; one of its peers in this stage stopped inside it"
        return f"rank(s) {', '.join(behind)} did not arrive"

    def _agree(self, operation: str, uid: int, seq: int) -> None:
        """The first exchange of every normal-mode operation, the same for all of them: all-gather (operation, uid,
        seq) over the whole group, so that ranks calling different operations (rank 0 a dispatch, rank 1 a combine)
        or passing handles of different dispatches meet at the same collective and every rank raises
        GroupMismatchError, naming what each rank called, before any row moves (the engine stays usable). For a
        dispatch, seq is the number it will take: the ranks also agree on how many dispatches they made."""
        mine = torch.tensor([_OPERATIONS.index(operation), uid, seq], dtype=torch.int64)
        everyone = torch.empty(3 * self.num_ranks, dtype=torch.int64)
        self._wait(_all_gather_single(everyone, mine, group=self.world_group, async_op=True),
                   f"{operation}: operation check")  # fmt: skip
        calls = [tuple(row) for row in everyone.view(-1, 3).tolist()]
        if len(set(calls)) == 1:
            return
        if len({op for op, _, _ in calls}) > 1:
            described = ", ".join(
                f"rank {r}: {_OPERATIONS[op]}" + (f" of dispatch {u}#{s}" if _OPERATIONS[op] != "dispatch" else "")
                for r, (op, u, s) in enumerate(calls)
            )
            raise _C.GroupMismatchError(
                f"mtdeepep: rank {self.rank}: internode {operation}: the ranks called different operations "
                f"({described}); every rank must make the same calls in the same order"
            )
        described = ", ".join(f"rank {r}: dispatch {u}#{s}" for r, (_, u, s) in enumerate(calls))
        what = (
            "made different numbers of dispatches"
            if operation == "dispatch"
            else "passed handles of different dispatches"
        )
        raise _C.GroupMismatchError(
            f"mtdeepep: rank {self.rank}: internode {operation}: the ranks {what} ({described}); every rank must use "
            "the same dispatch (e.g. the same micro-batch)"
        )

    @contextmanager
    def _node_stage(self, phase: str):
        """Re-raises the node-local stage's errors with the node and the mapping of its local rank numbers."""
        try:
            yield
        except _C.CommError as error:
            first = self.node_index * self.num_ranks_per_node
            # A node peer that stopped (or exited) because of a failure elsewhere published it: say that, too.
            culprit = self._peer_failure(min(self.timeout_s, _STORE_REPORT_S))
            cause = f"; the first failure: {culprit[0]}" if culprit is not None else ""
            if culprit is None and self.peers.multi_host:
                # A node peer may still be waiting in the network stage for a lost host (both time out together):
                # the ranks whose heartbeat stopped are the cause, whichever wait ran out first.
                lost = self.peers.explain("", self.timeout_s)
                cause = f"; {lost}" if lost else ""
            raise type(error)(
                f"mtdeepep: rank {self.rank}: internode {phase}, node-local stage on node {self.node_index} (its local "
                f"rank i is group rank {first} + i): {error}{cause}"
            ) from error

    def _node_of_rank(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """`[T, R]` bool -> `[T, N]` bool: does the token go to some rank of each node."""
        return is_token_in_rank.reshape(-1, self.num_nodes, self.num_ranks_per_node).any(dim=2)

    # -----------------------------------------------------------------------------------------------------------
    # Layout

    def layout(self, topk_idx, num_experts, previous, async_finish):
        """Local computation (the layout kernel over all R ranks), done by the caller after `previous`, as upstream's
        is on its stream; a token counts once per destination node in `num_tokens_per_rdma_rank`."""
        if previous is not None:
            previous.wait()
        per_rank, per_expert, in_rank = _C.get_dispatch_layout(topk_idx, num_experts, self.num_ranks)
        per_node = self._node_of_rank(in_rank).sum(dim=0, dtype=torch.int32)
        return per_rank, per_node, per_expert, in_rank, None

    # -----------------------------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                 expert_alignment, num_worst_tokens, num_channels, previous, async_finish):  # fmt: skip
        """Notify (the caller waits for it): (1) count exchange and (2) metadata exchange over the RDMA group (each
        token once per destination node, with its global top-k ids and weights, source rank and index, and its
        destination ranks in that node); (3) the forwarders' node-local dispatch of that metadata, with node-local
        expert ids (-1 for other nodes' experts), one source node at a time; (4) the outputs are the node stage's
        rows of each source node in turn: grouped by forwarder, i.e. by global source rank, token order. Data (in
        the background with `async_finish`): the token bytes (and scales) take the same two stages as the metadata,
        one source node at a time, landing in their block of the outputs."""

        def full_dispatch(notify: Callable[[tuple], None]) -> None:
            seq = self._dispatches + 1
            self._agree("dispatch", self.uid, seq)  # before any row moves: raised in this call
            self._dispatches = seq
            outputs, placed = self._notify_dispatch(
                data, scales, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                num_worst_tokens, num_channels, seq,
            )  # fmt: skip
            notify(outputs)
            recv, handle = (*_unversioned(*outputs[:2]), placed), outputs[5]
            self._move_tokens(data, scales, _record_of(handle).state, recv, num_channels, "dispatch")

        outputs, event = self._run(full_dispatch, previous, async_finish)
        recv_data, recv_scales, recv_idx, recv_weights, counts, handle = outputs
        return DispatchOutputs(recv_data, recv_scales, recv_idx, recv_weights, counts, handle, event)

    def cached_dispatch(self, data, scales, record, num_worst_tokens, num_channels, previous, async_finish, out=None):
        if out is not None:
            raise ValueError("mtdeepep: the internode engine has no placed outputs (placed_empty returns None)")

        def cached(notify: Callable[[tuple], None]) -> None:
            num_out = self._output_rows(record.state.num_received, num_worst_tokens, "cached dispatch")
            recv_data, recv_scales, placed = self._new_recv(data, scales, num_out, record.state.num_topk)
            notify((recv_data, recv_scales))
            self._agree("cached dispatch", record.uid, record.seq)  # before any row moves; raised by the event if async
            recv = (*_unversioned(recv_data, recv_scales), placed)
            self._move_tokens(data, scales, record.state, recv, num_channels, "cached dispatch")

        (recv_data, recv_scales), event = self._run(cached, previous, async_finish)
        return recv_data, recv_scales, event

    def _send_plan(self, is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Network rows: each token once per destination node. Returns `(send_token_idx [S] int64, node [S])`,
        grouped by node, token order within."""
        node_S, token_S = self._node_of_rank(is_token_in_rank).t().nonzero(as_tuple=True)
        return token_S, node_S

    def _steps(self) -> list[int]:
        """The source nodes in step order: this rank's node first (its rows need no network), then the others."""
        return [(self.node_index + k) % self.num_nodes for k in range(self.num_nodes)]

    def _notify_dispatch(self, data, scales, is_token_in_rank, per_expert, topk_idx, topk_weights, expert_alignment,
                         num_worst_tokens, num_channels, seq) -> tuple:  # fmt: skip
        """Stages (1)-(4) of `dispatch` and the outputs' allocation: `((recv_data (not yet written), recv_scales,
        recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle), placed)` (see `_new_recv`). The
        metadata crosses the network at once; the node-local stage dispatches it one source node at a time, so that
        the token bytes can later move in the same steps."""
        L, N = self.num_ranks_per_node, self.num_nodes
        fmt = _RowFormat(num_topk=0 if topk_idx is None else topk_idx.size(1), has_weights=topk_weights is not None,
                         meta_ranks=L, scale_bytes=0, x_bytes=0)  # fmt: skip
        token_S, node_S = self._send_plan(is_token_in_rank)
        send_counts = torch.bincount(node_S, minlength=N)

        # Stage 1: counts. Per destination node: rows, then this rank's token count of each of its L * E_r experts.
        send_info = torch.cat([send_counts.unsqueeze(1), per_expert.reshape(N, -1).long()], dim=1)
        recv_info = torch.empty_like(send_info)
        self._exchange(recv_info, send_info, [1] * N, [1] * N, "dispatch: count exchange")
        recv_counts = recv_info[:, 0]

        # Stage 2: metadata, grouped by source node.
        rows_S = self._pack(fmt, None, None, topk_idx, topk_weights, is_token_in_rank, token_S, node_S)
        rows_M = self._scratch.get(1, (int(recv_counts.sum()), fmt.row_bytes), torch.uint8)
        self._exchange(rows_M, rows_S, recv_counts.tolist(), send_counts.tolist(), "dispatch: metadata exchange")
        recv_blocks = _blocks(recv_counts.tolist())

        # Stage 3: the node-local stage, one source node at a time (in step order), with node-local expert ids.
        delivered = {}
        for n in self._steps():
            rows_n = rows_M[recv_blocks[n][0] : recv_blocks[n][1]]
            # Copies, never views of the scratch rows (`.contiguous()` returns a block of 0 or 1 rows as the view it
            # is): the node stage's handle keeps `node_in_rank`, and the next call overwrites the scratch rows.
            node_in_rank = _columns(rows_n, fmt.routing_offset, L, torch.bool).clone()
            node_topk_idx = node_weights = None
            if topk_idx is not None:
                node_topk_idx = self._node_local_ids(_columns(rows_n, 0, 8 * fmt.num_topk, torch.int64), per_expert)
            if topk_weights is not None:
                node_weights = _columns(rows_n, fmt.weights_offset, 4 * fmt.num_topk, torch.float32).clone()
            with self._node_stage("dispatch"):
                # The source node's count per expert of this node; aligned once, over all steps, below.
                delivered[n] = self.node.dispatch(
                    rows_n.view(torch.float32), None, node_topk_idx, node_weights, node_in_rank,
                    recv_info[n, 1:].int(), 1, 0, num_channels, None, False,
                )  # fmt: skip

        # Stage 4: the outputs are the steps' rows in source-node order: grouped by global source rank, token order.
        in_order = [delivered[n] for n in range(N)]
        src_rank_token = torch.cat([_columns(d.recv_x.view(torch.uint8), fmt.src_offset, 8, torch.int32)
                                    for d in in_order])  # fmt: skip
        num_recv = src_rank_token.size(0)
        num_out = self._output_rows(num_recv, num_worst_tokens, "dispatch")
        out_begin = dict(zip(range(N), itertools.accumulate([0] + [d.recv_x.size(0) for d in in_order])))
        chunks = [_Chunk(n, _record_of(delivered[n].handle), out_begin[n], delivered[n].recv_x.size(0))
                  for n in self._steps()]  # fmt: skip
        handle = InternodeHandle(
            is_token_in_rank=is_token_in_rank,
            send_node_prefix=send_counts.cumsum(dim=0).int(),
            send_token_idx=token_S,
            fwd_recv_node_prefix=recv_counts.cumsum(dim=0).int(),
            recv_gbl_rank_prefix_sum=torch.bincount(src_rank_token[:, 0], minlength=self.num_ranks).cumsum(0).int(),
            recv_src_meta=_padded(src_rank_token, num_out, -1),
            recv_perm=torch.arange(num_recv, dtype=torch.int64),
            node_handle=tuple(d.handle for d in in_order),
        )
        state = _InternodeState(token_S.clone(), send_counts.tolist(), recv_counts.tolist(), chunks, fmt.num_topk)
        record = DispatchRecord(
            kind=self.handle_kind, group=self.group, uid=self.uid, seq=seq, num_tokens=is_token_in_rank.size(0),
            num_recv=num_out, state=state,
        )  # fmt: skip
        attach(handle.recv_gbl_rank_prefix_sum, record)
        out_idx = out_weights = None
        if topk_idx is not None:
            out_idx = _padded(torch.cat([d.recv_topk_idx for d in in_order]), num_out, -1)
        if topk_weights is not None:
            out_weights = _padded(torch.cat([d.recv_topk_weights for d in in_order]), num_out, 0)
        counts = []
        if num_worst_tokens == 0:
            unaligned = torch.tensor([d.num_recv_tokens_per_expert for d in in_order], dtype=torch.int64).sum(dim=0)
            counts = ((unaligned + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
        recv_data, recv_scales, placed = self._new_recv(data, scales, num_out, fmt.num_topk)
        return (recv_data, recv_scales, out_idx, out_weights, counts, handle), placed

    def _move_tokens(self, data, scales, state: _InternodeState, recv: tuple, num_channels: int, phase: str) -> None:
        """The data part of a dispatch: x (and scales) through both stages, one source node at a time: this node's
        rows go through the node stage while the other nodes' rows are on the network; each step's rows land in
        their block of the outputs: written there by the node stage's senders when `recv` is placed (`_new_recv`),
        else copied in from the node stage's outputs."""
        fmt = _RowFormat(0, False, 0, _row_bytes(scales), _row_bytes(data))
        rows_S = self._pack(fmt, data, scales, None, None, None, state.send_token_idx, None)
        rows_M = self._scratch.get(1, (sum(state.recv_counts), fmt.row_bytes), torch.uint8)
        recv_data, recv_scales, placed = recv
        send_blocks, recv_blocks = _blocks(state.send_counts), _blocks(state.recv_counts)

        def transfer(step: int):
            """Starts step `step`'s exchange (None for this node's rows, already here); returns (work, rows)."""
            n = state.chunks[step].source_node
            if n == self.node_index:
                return None, rows_S[send_blocks[n][0] : send_blocks[n][1]]
            to_node = (2 * self.node_index - n) % self.num_nodes  # the node whose step `step` is this node
            received = rows_M[recv_blocks[n][0] : recv_blocks[n][1]]
            sent = rows_S[send_blocks[to_node][0] : send_blocks[to_node][1]]
            return self._shift(received, sent, n, to_node), received

        def deliver(step: int, rows_n: torch.Tensor) -> None:
            chunk = state.chunks[step]
            out = slice(chunk.out_begin, chunk.out_begin + chunk.out_rows)
            # The network rows' x and scales columns go to the node stage as they are (strided views), whether this
            # rank's outputs are placed or not: the node stage's ranks must agree on the row format, and `placed` is
            # this rank's own (a rank that receives no row, or whose region is full, has no placed outputs).
            x_n = _columns(rows_n, fmt.x_offset, fmt.x_bytes, data.dtype)
            scales_n = None if scales is None else _columns(rows_n, fmt.scales_offset, fmt.scale_bytes, scales.dtype)
            if placed:
                out_scales = None if recv_scales is None else recv_scales[out]
                with self._node_stage(phase):
                    self.node.cached_dispatch(x_n, scales_n, chunk.node_record, 0, num_channels, None, False,
                                              out=(recv_data[out], out_scales))  # fmt: skip
                return
            with self._node_stage(phase):
                node_x, node_scales, _ = self.node.cached_dispatch(x_n, scales_n, chunk.node_record, 0, num_channels,
                                                                   None, False)  # fmt: skip
            recv_data[out].copy_(node_x)
            if recv_scales is not None:
                recv_scales[out].copy_(node_scales)

        self._in_steps(len(state.chunks), transfer, deliver, f"{phase}: token exchange")
        if recv_data.size(0) > state.num_received:  # num_worst_tokens padding
            recv_data[state.num_received :] = 0
            if recv_scales is not None:
                recv_scales[state.num_received :] = 0

    def _shift(self, received: torch.Tensor, sent: torch.Tensor, from_node: int, to_node: int) -> dist.Work:
        """One step of a shift over the RDMA group: `sent` to the rank of `to_node`, `received` from `from_node`."""
        send_splits = [sent.size(0) if n == to_node else 0 for n in range(self.num_nodes)]
        recv_splits = [received.size(0) if n == from_node else 0 for n in range(self.num_nodes)]
        return dist.all_to_all_single(received.view(torch.uint8), sent.contiguous().view(torch.uint8), recv_splits,
                                      send_splits, group=self.rdma_group, async_op=True)  # fmt: skip

    def _in_steps(
        self, num_steps: int, start: Callable[[int], tuple], finish: Callable[[int, torch.Tensor], None], phase: str
    ) -> None:
        """Runs `num_steps` steps: `start(i)` begins step i's transfer and returns `(work or None, its rows)`,
        `finish(i, rows)` runs once they arrived. Step i + 1 is started before step i finishes, so one transfer is
        in flight while the node stage works on the previous rows."""
        pending = {0: start(0)} if num_steps else {}
        for i in range(num_steps):
            if i + 1 < num_steps:
                pending[i + 1] = start(i + 1)
            work, rows = pending.pop(i)
            if work is not None:
                self._wait(work, f"{phase} (step {i + 1} of {num_steps})")
            finish(i, rows)

    def recv_sources(self, handle):
        handle = InternodeHandle(*handle)
        num_valid = int(handle.recv_gbl_rank_prefix_sum[-1])
        return handle.recv_src_meta[:num_valid, 0].long(), handle.recv_src_meta[:num_valid, 1].long()

    def _node_local_ids(self, topk_idx_MK: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> ids among this node's `L * E_r` experts, -1 for experts of other nodes."""
        experts_per_node = per_expert.numel() // self.num_nodes
        local_MK = topk_idx_MK - self.node_index * experts_per_node
        return torch.where((topk_idx_MK >= 0) & (local_MK >= 0) & (local_MK < experts_per_node), local_MK, -1)

    def _output_rows(self, num_recv: int, num_worst_tokens: int, phase: str) -> int:
        """Output rows: `num_recv`, or `num_worst_tokens` when set. Then every rank learns (one small all-reduce over
        the whole group) whether some rank receives more rows than its `num_worst_tokens`, and all raise
        `GroupMismatchError` together, before any token bytes move, so no peer is left waiting and the buffer stays
        usable."""
        if num_worst_tokens == 0:
            return num_recv
        excess = torch.zeros(self.num_ranks, dtype=torch.int64)
        excess[self.rank] = num_recv if num_recv > num_worst_tokens else 0
        self._wait(dist.all_reduce(excess, group=self.world_group, async_op=True), f"{phase}: num_worst_tokens check")
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
            L = self.num_ranks_per_node
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

    def combine(self, x, topk_weights, bias0, bias1, record, num_channels, previous, async_finish):
        """Stages: (1) undo the dispatch's reordering (one copy of x); (2) node-local combine to the forwarders, FP32
        sums rounded once to x's dtype (one partial per token and node); (3) the partials (and the slot-wise weight
        sums, float32) go back over the RDMA group; (4) the source sums each token's node partials in FP32, adds the
        bias and rounds once to x's dtype. The outputs' sizes come from the handle, so the identity check and the four
        stages all run in the background with `async_finish`."""
        num_tokens = record.num_tokens

        def combine(notify: Callable[[tuple], None]) -> None:
            combined = self.empty((num_tokens, x.size(1)), x.dtype)
            combined_w = (
                None if topk_weights is None else torch.empty(num_tokens, topk_weights.size(1), dtype=torch.float32)
            )
            notify((combined, combined_w))
            self._agree("combine", record.uid, record.seq)  # before any row moves; raised by the event if async
            self._combine(
                x, record.state, topk_weights, (bias0, bias1), num_channels, *_unversioned(combined, combined_w)
            )

        (combined, combined_w), event = self._run(combine, previous, async_finish)
        return combined, combined_w, event

    def _combine(self, x, state: _InternodeState, topk_weights, biases, num_channels, combined, combined_w) -> None:
        """The stages of `combine`, one source node at a time: the other nodes' partial sums are computed first and
        sent home while this node's own are computed. Writes `combined` `[T, H]` and `combined_w` `[T, K]`."""
        num_tokens, hidden, N = combined.size(0), x.size(1), self.num_nodes
        partial_S = self._scratch.get(0, (state.send_token_idx.numel(), hidden), x.dtype)
        send_blocks, recv_blocks = _blocks(state.send_counts), _blocks(state.recv_counts)
        partial_w_M = (
            None
            if topk_weights is None
            else torch.empty(sum(state.recv_counts), topk_weights.size(1), dtype=torch.float32)
        )
        acc = self._scratch.get(1, (num_tokens, hidden), torch.float32)
        acc.zero_()
        token_S = state.send_token_idx.int()
        order = [*range(1, len(state.chunks)), 0]  # this node's own partials last: they need no network

        def node_sums(i: int):
            # Stages 1-2: the rows of one source node are a block of x already in the node stage's order; their sums
            # per forwarded token (FP32, rounded once to x's dtype) go home to that node (stage 3).
            chunk = state.chunks[order[i]]
            rows = slice(chunk.out_begin, chunk.out_begin + chunk.out_rows)
            w_node = None if topk_weights is None else topk_weights[rows]
            with self._node_stage("combine"):
                partial, partial_w, _ = self.node.combine(x[rows], w_node, None, None, chunk.node_record, num_channels,
                                                          None, False)  # fmt: skip
            n = chunk.source_node
            if partial_w is not None:
                partial_w_M[recv_blocks[n][0] : recv_blocks[n][1]] = partial_w
            from_node = (2 * self.node_index - n) % N  # the node whose partials for this rank's tokens arrive now
            received = partial_S[send_blocks[from_node][0] : send_blocks[from_node][1]]
            if n == self.node_index:
                received.copy_(partial)
                return None, (received, from_node)
            return self._shift(received, partial, from_node, n), (received, from_node)

        def accumulate(i: int, arrived) -> None:
            # Stage 4: FP32 sum of the node partials as they arrive (a token appears once per node).
            received, from_node = arrived
            _C.accumulate_rows(received, token_S[send_blocks[from_node][0] : send_blocks[from_node][1]], acc)

        self._in_steps(len(order), node_sums, accumulate, "combine: partial-sum return")
        _C.finish_accumulation(acc, biases[0], biases[1], combined)
        if partial_w_M is not None:
            # Each slot's weight comes from the one node that owns its expert (the others sent 0): any order is exact.
            partial_w_S = torch.empty(state.send_token_idx.numel(), partial_w_M.size(1), dtype=torch.float32)
            self._exchange(partial_w_S, partial_w_M, state.send_counts, state.recv_counts, "combine: weight return")
            combined_w.zero_()
            combined_w.index_add_(0, state.send_token_idx, partial_w_S)

    # -----------------------------------------------------------------------------------------------------------
    # Low-latency mode: the collective transport over the whole group

    def _background(self, body: Callable[[], None]) -> Event:
        """Runs `body` on the worker (in order with every other operation of this engine, so every rank issues its
        collectives in the same order); returns the event it completes."""
        self._check_usable()
        done = _C.EventHandle.pending()
        self._queue(body, done.complete)
        return done

    def _ll_launch(self, exchange: Callable[[], None], async_finish: bool, return_recv_hook: bool):
        """(event, hook) of a collective-transport call whose exchange and receive run on the worker: finished now,
        by the event's wait, or by the hook. At most two calls are in flight, as with the shared-memory transport
        (see `_ll_make_room`)."""
        event = self._background(exchange)
        if not (async_finish or return_recv_hook):
            event.wait()
            return None, None
        entry = [event, not return_recv_hook]  # [event, whether its hook was called (True without a hook)]
        self._ll_in_flight.append(entry)
        if return_recv_hook:

            def hook() -> None:
                entry[1] = True
                event.wait()

            return None, hook
        return event, None

    def _ll_make_room(self) -> None:
        """Before a call: the call two back must be finished. Its hook not called yet is refused (ValueError), as the
        shared-memory transport refuses it: that call's results would be overwritten."""
        while len(self._ll_in_flight) >= 2:
            event, hook_called = self._ll_in_flight[0]
            if not hook_called:
                raise ValueError(
                    "mtdeepep: this low-latency call would reuse the buffer half of the call two back, whose receive "
                    "hook was not called yet; call that hook first (at most two low-latency results can be in flight)"
                )
            self._ll_in_flight.popleft()
            with contextlib.suppress(Exception):  # its error belongs to that call: its own wait raises it
                event.wait()

    def ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_stats, wait_stats,
                    use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook):  # fmt: skip
        """The sender packs one message per (token, expert) row per destination (here); sizes and call signatures
        (`[R, 8]` int64), then the rows, cross the private whole-group group on the worker, where the receiver
        unpacks them into its own low-latency area (same layout as the shared-memory transport). `wait_stats` is
        left untouched."""
        self._ll_make_room()
        self.node.host_runtime.set_num_threads(torch.get_num_threads())
        op, messages, send_info, recv_x, recv_scales, recv_count, src_info, layout_range = (
            self.low_latency.collective_dispatch_send(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0
            )
        )

        def exchange() -> None:
            received, recv_info = self._ll_exchange(messages, send_info, "low-latency dispatch: all-to-all")
            self.low_latency.collective_dispatch_recv(op, received, recv_info, cumulative_stats)

        event, hook = self._ll_launch(exchange, async_finish, return_recv_hook)
        handle = low_latency_handle(self, src_info, layout_range, op, x, num_max_dispatch_tokens_per_rank, num_experts)
        return recv_x, recv_scales, recv_count, handle, event, hook

    def ll_combine(self, x, topk_idx, topk_weights, record, handle, zero_copy, async_finish, return_recv_hook, out,
                   wait_stats):  # fmt: skip
        self._ll_make_room()
        self.node.host_runtime.set_num_threads(torch.get_num_threads())
        src_info, layout_range, num_max_dispatch_tokens_per_rank, _, num_experts = handle
        op, messages, send_info, _, combined = self.low_latency.collective_combine_send(
            x, topk_idx, topk_weights, src_info, layout_range, num_max_dispatch_tokens_per_rank, num_experts,
            record.uid, record.seq, zero_copy, out,
        )  # fmt: skip

        def exchange() -> None:
            received, recv_info = self._ll_exchange(messages, send_info, "low-latency combine: all-to-all")
            self.low_latency.collective_combine_recv(op, received, recv_info)

        event, hook = self._ll_launch(exchange, async_finish, return_recv_hook)
        return combined, event, hook

    def _ll_exchange(self, messages: torch.Tensor, send_info: torch.Tensor, phase: str):
        """Sizes and signatures first (`[R, 8]` int64 per destination), then the messages; returns what arrived."""
        recv_info = torch.empty_like(send_info)
        self._wait(dist.all_to_all_single(recv_info, send_info, group=self.world_group, async_op=True),
                   phase + " of the sizes")  # fmt: skip
        recv_bytes, send_bytes = recv_info[:, 0].tolist(), send_info[:, 0].tolist()
        received = torch.empty(sum(recv_bytes), dtype=torch.uint8)
        self._wait(dist.all_to_all_single(received, messages, recv_bytes, send_bytes, group=self.world_group,
                                          async_op=True), phase)  # fmt: skip
        return received, recv_info

    def ll_clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        """Collective: finishes this rank's calls, then zeroes the signalling state between two barriers."""
        while self._ll_in_flight:
            with contextlib.suppress(Exception):
                self._ll_in_flight.popleft()[0].wait()

        def clean() -> None:
            self._wait(dist.barrier(group=self.world_group, async_op=True), "low-latency clean: every rank stopped")
            self.low_latency.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            self._wait(dist.barrier(group=self.world_group, async_op=True), "low-latency clean: every rank zeroed")

        self._background(clean).wait()

    def ll_next_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        return self.low_latency.next_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)


# ---------------------------------------------------------------------------------------------------------------
# Small helpers


_OPERATIONS = ("dispatch", "cached dispatch", "combine")  # the normal-mode operations, as `_agree` numbers them


def _record_of(handle: tuple) -> DispatchRecord:
    for element in handle:
        record = getattr(element, "_mtdeepep_dispatch", None)
        if record is not None:
            return record
    raise AssertionError("mtdeepep internal error: a dispatch handle without its record")


def _row_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.size(1) * tensor.element_size()


def _blocks(counts: list[int]) -> list[tuple[int, int]]:
    """`[begin, end)` of each consecutive block of rows, from the blocks' sizes."""
    ends = list(itertools.accumulate(counts))
    return list(zip([0, *ends[:-1]], ends))


def _unversioned(*outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Aliases of outputs already handed to the caller, for the worker to write their contents through, as a device's
    comm stream writes through pointers: the same memory under a version counter of its own (`Tensor.data`), so that
    autograd never sees an in-place change of what the caller holds. (The caller may have made views of them inside
    an autograd Function before the rows arrived, as moe's dispatcher does: an in-place change of their base makes
    those views unusable, "Output 0 of ... is a view and its base ... has been modified inplace".)"""
    return tuple(None if output is None else output.data for output in outputs)


def _padded(rows: torch.Tensor, num_out: int, fill: float) -> torch.Tensor:
    """`rows` with rows of `fill` appended up to `num_out` rows (num_worst_tokens)."""
    if rows.size(0) == num_out:
        return rows
    return torch.cat([rows, rows.new_full((num_out - rows.size(0), *rows.shape[1:]), fill)])


__all__ = ["InternodeEngine", "shutdown_all_engines"]  # the exit hook lives in .base; mtdeepep imports it here
