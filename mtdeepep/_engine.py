"""The engine seam: what an executor implements under the DeepEP facades (`Buffer`, V1, and `ElasticBuffer`, V2).

The facades check arguments, keep DeepEP's names, defaults and return tuples, and call one engine. An engine moves
the data: set-up exchange, layout, dispatch, combine, low-latency dispatch/combine, destroy, with one event type
(`mtdeepep._C.EventHandle`). Arguments reach it already checked (shapes, dtypes, devices, contiguity, values).

- `CpuEngine` (`mtdeepep._cpu_engine`): the ranks of one host through shared memory (the CPU executor).
- `CudaEngine` (`mtdeepep._cuda_engine`): the ranks of one node through GPU buffers opened with CUDA IPC (the same
  sources built for MUSA).
- `InternodeEngine` (`mtdeepep._internode`): several nodes; composes one node engine (any executor) with a network
  stage over torch.distributed. It never goes through a facade.

`create_engine` chooses the node engine once, from the device (`NODE_ENGINES`): adding an executor (CUDA, MUSA) is
one entry there and one module.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _C
from ._handles import DispatchRecord
from ._setup import (
    SetupRendezvous,
    buffer_uid,
    check_nodes_share_hosts,
    group_key,
    group_ranks,
    resolve_num_ranks_per_node,
)

Event = _C.EventHandle  # the one event type; None stands for "already complete"


@dataclass
class DispatchOutputs:
    """What a (non-cached) dispatch returns: DeepEP's tuple, minus the event, with the handle tuple (its record
    attached, see `mtdeepep._handles`)."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: list[int]
    handle: tuple
    event: Any


class Engine(ABC):
    """One executor's normal and low-latency modes for one group. Arguments are checked by the facade."""

    #: the kind of handle this engine issues and accepts ('intranode' or 'internode'); low-latency: 'low_latency'
    handle_kind: str
    device: torch.device
    rank: int
    num_ranks: int
    num_nodes: int
    num_ranks_per_node: int
    group: tuple[tuple[int, ...], int]  # see mtdeepep._setup.group_key

    # ---- normal mode ----
    @abstractmethod
    def layout(self, topk_idx: torch.Tensor, num_experts: int, previous: Event | None, async_finish: bool) -> tuple:
        """`(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [N] int32 or None, num_tokens_per_expert [E]
        int32, is_token_in_rank [T, R] bool, event)`."""

    @abstractmethod
    def dispatch(
        self, data, scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert, expert_alignment: int,
        num_worst_tokens: int, num_channels: int, previous: Event | None, async_finish: bool,
    ) -> DispatchOutputs:  # fmt: skip
        """Sends each token once to every rank that owns one of its experts (see `Buffer.dispatch`)."""

    @abstractmethod
    def cached_dispatch(
        self, data, scales, record: DispatchRecord, num_worst_tokens: int, num_channels: int, previous: Event | None,
        async_finish: bool, out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
        """The layout of `record`'s dispatch again: `(recv_data, recv_scales, event)`. `out`: placed outputs
        `(recv_data, recv_scales)` from `placed_empty` (engines that return tensors from it), which the peers write
        directly and which are returned."""

    @abstractmethod
    def combine(
        self, x, topk_weights, bias0, bias1, record: DispatchRecord, num_channels: int, previous: Event | None,
        async_finish: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:  # fmt: skip
        """Sums the rows of `record`'s dispatch per source token in FP32: `(combined, combined_weights, event)`."""

    @abstractmethod
    def recv_sources(self, handle: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """Source rank and source token index (int64 `[n_valid]` each) of every valid received row of a dispatch,
        from its handle (the only knowledge of a handle's layout a facade needs, e.g. V2's `recv_src_metadata`)."""

    # ---- low-latency mode ----
    @abstractmethod
    def ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int, cumulative_stats,
                    wait_stats, use_fp8: bool, round_scale: bool, use_ue8m0: bool, async_finish: bool,
                    return_recv_hook: bool) -> tuple:  # fmt: skip
        """`(recv_x, recv_scales, recv_count, handle, event, hook)` (see `Buffer.low_latency_dispatch`)."""

    @abstractmethod
    def ll_combine(self, x, topk_idx, topk_weights, record: DispatchRecord, handle: tuple, zero_copy: bool,
                   async_finish: bool, return_recv_hook: bool, out, wait_stats) -> tuple:  # fmt: skip
        """`(combined, event, hook)` (see `Buffer.low_latency_combine`)."""

    @abstractmethod
    def ll_clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None: ...

    @abstractmethod
    def ll_next_combine_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int): ...

    # ---- buffer and lifetime ----
    @abstractmethod
    def empty(self, sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An output tensor from the executor's allocator (pooled, pre-faulted memory on CPU)."""

    def placed_empty(self, sizes: tuple[int, int], dtype: torch.dtype, num_topk: int) -> torch.Tensor | None:
        """A `[rows, hidden]` output in memory the peers write directly, for `cached_dispatch(out=...)` (saves the
        receiver's copy), keeping room for the combine of such rows with `num_topk` weights while it lives; None when
        the engine has none (or no room left): use `empty`."""
        return None

    @abstractmethod
    def local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor: ...

    @abstractmethod
    def set_timeout(self, timeout_s: float) -> None: ...

    @abstractmethod
    def interrupt(self, reason: str) -> None:
        """Ends every wait of this rank now and tells the peers (Ctrl-C)."""

    @abstractmethod
    def destroy(self) -> None:
        """Finishes the queued work, then releases everything; a no-op in a forked child (the parent's group is not
        touched)."""


# The node engine of each device type: the executor that moves rows between the ranks of one node.
NODE_ENGINES: dict[str, Callable[..., Engine]] = {}


def engine_device(group: dist.ProcessGroup) -> torch.device:
    """The device whose executor serves `group`, chosen once at set-up:

    - `MTDEEPEP_DEVICE` (`cpu`, `cuda` or `musa`), when set: e.g. several processes sharing one GPU, whose control
      group is gloo (NCCL refuses two ranks on one GPU) while the data moves through CUDA IPC;
    - else the group's backend: NCCL means the ranks' tensors live on their current CUDA device, MCCL on their MUSA
      device (torch_musa); gloo (or anything else) means CPU tensors, the CPU executor.
    """
    choice = os.environ.get("MTDEEPEP_DEVICE", "").strip().lower()
    if not choice:
        backend = str(dist.get_backend(group)).lower()
        choice = "cuda" if "nccl" in backend else "musa" if "mccl" in backend else "cpu"
    if choice not in ("cpu", "cuda", "musa"):
        raise ValueError(f"mtdeepep: MTDEEPEP_DEVICE must be cpu, cuda or musa, got {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    module = getattr(torch, choice, None)
    if module is None or not module.is_available():
        raise _C.CommError(f"mtdeepep: the {choice} executor was chosen but no {choice} device is available")
    return torch.device(choice, module.current_device())


# How long a rank whose set-up met an error after the exchange (a peer's segment already gone) waits for that peer's
# published reason: the peer publishes before it releases anything, so it is there at once in practice.
_PEER_FAILURE_GRACE_S = 2.0


def create_engine(
    group: dist.ProcessGroup, *, num_nvl_bytes: int, num_ll_bytes: int, low_latency: bool,
    num_ranks_per_node: int | None, timeout_s: float, phase: str = "Buffer set-up",
) -> Engine:  # fmt: skip
    """Set-up (collective over `group`): the node engine for this device, the exchange of every rank's set-up string
    (bounded by `timeout_s`, naming the ranks that did not arrive), and, when the group spans several nodes, the
    internode engine over it. A rank whose set-up fails publishes why (`SetupRendezvous.fail`): its peers name it
    and its reason ("group rank 0 failed its set-up: ...") at once, instead of a timeout or of a symptom such as a
    segment that no longer exists; a rank whose process is gone is named with its pid at once."""
    from ._cpu_engine import CpuEngine  # noqa: F401  (registers itself in NODE_ENGINES)
    from ._internode import InternodeEngine

    device = engine_device(group)
    if device.type != "cpu":
        from . import _cuda_engine  # noqa: F401  (registers the GPU executor when this build has one)
    if device.type not in NODE_ENGINES:
        raise _C.CommError(f"mtdeepep: this build has no {device.type} executor (mtdeepep._C_cuda is missing)")
    if device.type != "cpu" and resolve_num_ranks_per_node(num_ranks_per_node, group.size()) < group.size():
        raise ValueError(
            f"mtdeepep: the {device.type} executor serves the ranks of one node; groups spanning several nodes run on "
            "the CPU executor only for now"
        )
    num_ranks = group.size()
    per_node = resolve_num_ranks_per_node(num_ranks_per_node, num_ranks)
    node, local_rank = divmod(group.rank(), per_node)
    internode = per_node < num_ranks
    setup = SetupRendezvous(group, timeout_s, phase)  # first, on every rank, whatever fails next
    try:
        node_engine = NODE_ENGINES[device.type](
            rank=local_rank, num_ranks=per_node, num_nvl_bytes=num_nvl_bytes,
            num_ll_bytes=num_ll_bytes if low_latency else 0, timeout_s=timeout_s,
        )  # fmt: skip
    except BaseException as error:
        setup.fail(error)
        raise
    try:
        entries = setup.exchange(f"{socket.gethostname()}\n{node_engine.setup_entry()}")
        check_nodes_share_hosts([e.split("\n", 1)[0] for e in entries], per_node)
        uid = buffer_uid(entries)
        node_entries = [e.split("\n", 1)[1] for e in entries[node * per_node : (node + 1) * per_node]]
        ranks = group_ranks(group)
        node_group = (ranks[node * per_node : (node + 1) * per_node], local_rank)
        # Several nodes: low-latency mode uses the collective transport, which the internode engine sets up.
        try:
            node_engine.connect(node_entries, uid, node_group if internode else group_key(group),
                                low_latency=low_latency and not internode)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - a peer's published failure explains it better, if there is one
            culprit = setup.peer_failure(grace_s=_PEER_FAILURE_GRACE_S)
            if culprit is None:
                raise
            raise _C.CommError(f"{culprit} (here: {error})") from error
        if not internode:
            return node_engine
        return InternodeEngine(group, node_engine, per_node, timeout_s, uid, low_latency=low_latency)
    except BaseException as error:
        setup.fail(error)
        node_engine.destroy()
        raise


def in_creator_process(creator_pid: int) -> bool:
    return os.getpid() == creator_pid
