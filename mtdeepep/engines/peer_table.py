"""The Triton executor's view of the node: every rank's regions as mapped in this process, and the table of their
base addresses the kernels index (`mtdeepep.kernels`: `tl.load(table + peer)` turned into a pointer).

Two providers of the regions, with one interface (`Regions`):

- `SharedMemoryRegions` (CPU tensors, under Triton's interpreter): the shared-memory segments of the CPU executor's
  `_C.Runtime`, which also does the set-up, the liveness of the peers, the interruption and destroy.
- `IpcRegions` (GPU tensors: CUDA, ROCm): this rank's normal region and low-latency area are device memory of its
  own, shared with the node's other processes through CUDA IPC handles (HIP's on ROCm) by torch's own mechanism,
  `torch.multiprocessing.reductions.reduce_tensor` / `rebuild_cuda_tensor` (the one `torch.multiprocessing` moves
  CUDA tensors between processes with: it keeps the exported memory alive while a peer holds it mapped). The
  handles travel in the set-up entries (`setup_entry`, exchanged by `mtdeepep.engines.setup`). One process is one
  rank here: CUDA IPC cannot open a handle in the process that exported it.

`PeerTable` is the layout the kernels read: per rank the normal region's base (its data area at 0), its control area
at the region's end, that area's poison word, and the low-latency area's base, as int64 tensors on the kernels'
device. The bounded waits report into a status word in pinned host memory on a GPU (`kernels.sync.StatusWord`).

Not covered: MUSA (torch_musa's tensors are not CUDA tensors to `reduce_tensor`; whether torch_musa registers its own
IPC reductions is not verified: `IpcRegions` refuses with a clear error there), and several ranks in one process
(single-process mode, `mtdeepep.utils.local_ranks`, stays with the CUDA executor).
"""

from __future__ import annotations

import base64
import os
import pickle
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from .. import _C
from ..kernels.intranode import ALIGNMENT, NormalLayout


@dataclass(frozen=True)
class PeerTable:
    """The base addresses the kernels index, int64 `[R]` tensors on the kernels' device.

    regions: every rank's normal region (its data area starts there);
    control: every rank's control area, at `control_base` bytes into its region (the region's last whole
    `ALIGNMENT` block that holds `NormalLayout.control_bytes`: the start is where users write through
    `get_local_buffer_tensor`);
    poison: every rank's poison word (`control + layout.poison`);
    low_latency: every rank's low-latency area (None without low-latency mode)."""

    regions: torch.Tensor
    control: torch.Tensor
    poison: torch.Tensor
    low_latency: torch.Tensor | None
    control_base: int

    @staticmethod
    def control_offset(region_bytes: int, layout: NormalLayout) -> int:
        """Where the control area starts in a region of `region_bytes` (0 for a region too small to hold it)."""
        return max(0, (region_bytes - layout.control_bytes) // ALIGNMENT) * ALIGNMENT

    @staticmethod
    def of(region_addresses: list[int], low_latency_addresses: list[int] | None, region_bytes: int,
           layout: NormalLayout, device: torch.device) -> PeerTable:  # fmt: skip
        if len(region_addresses) != layout.num_ranks:
            raise ValueError(f"mtdeepep: {len(region_addresses)} region addresses for {layout.num_ranks} ranks")
        if low_latency_addresses is not None and len(low_latency_addresses) != layout.num_ranks:
            raise ValueError(
                f"mtdeepep: {len(low_latency_addresses)} low-latency addresses for {layout.num_ranks} ranks"
            )
        control_base = PeerTable.control_offset(region_bytes, layout)
        regions = torch.tensor(region_addresses, dtype=torch.int64, device=device)
        control = regions + control_base
        return PeerTable(
            regions=regions, control=control, poison=control + layout.poison,
            low_latency=None if low_latency_addresses is None else torch.tensor(
                low_latency_addresses, dtype=torch.int64, device=device
            ),
            control_base=control_base,
        )  # fmt: skip


class Regions(Protocol):
    """What the Triton executor needs of the memory its ranks share (the subset of `_C.Runtime` it uses; the CPU
    segments and the IPC-shared GPU memory below provide it)."""

    def setup_entry(self) -> str: ...

    def connect(self, entries: list[str], uid: int) -> None: ...

    def region_addresses(self, low_latency_area: bool) -> list[int]: ...

    def get_local_buffer_tensor(self, dtype: torch.dtype, offset: int, use_rdma_buffer: bool) -> torch.Tensor: ...

    def num_ll_bytes(self) -> int: ...

    def timeout_s(self) -> float: ...

    def set_timeout(self, timeout_s: float) -> None: ...

    def interrupt(self, reason: str) -> None: ...

    def destroy(self) -> None: ...


class SharedMemoryRegions(Regions):
    """The CPU executor's shared-memory segments (`_C.Runtime`): the set-up entry is the segment's name and the
    process id, which the runtime's liveness checks use."""

    def __init__(self, rank: int, num_ranks: int, num_nvl_bytes: int, num_ll_bytes: int, timeout_s: float) -> None:
        self.runtime = _C.Runtime(rank, num_ranks, num_nvl_bytes, num_ll_bytes, timeout_s, torch.get_num_threads())

    @property
    def host_runtime(self) -> _C.Runtime:
        """The C++ runtime under these segments (the internode engine runs its low-latency protocol on it)."""
        return self.runtime

    def setup_entry(self) -> str:
        return f"{self.runtime.segment_name()}\t{self.runtime.pid()}"

    def connect(self, entries: list[str], uid: int) -> None:
        fields = [entry.split("\t") for entry in entries]
        self.runtime.connect([name for name, _ in fields], [int(pid) for _, pid in fields], uid)

    def region_addresses(self, low_latency_area: bool) -> list[int]:
        return list(self.runtime.region_addresses(low_latency_area))

    def get_local_buffer_tensor(self, dtype, offset, use_rdma_buffer):
        return self.runtime.get_local_buffer_tensor(dtype, offset, use_rdma_buffer)

    def num_ll_bytes(self) -> int:
        return self.runtime.num_ll_bytes()

    def timeout_s(self) -> float:
        return self.runtime.timeout_s()

    def set_timeout(self, timeout_s: float) -> None:
        self.runtime.set_timeout(timeout_s)

    def interrupt(self, reason: str) -> None:
        self.runtime.interrupt(reason)

    def destroy(self) -> None:
        self.runtime.destroy()


def encode_ipc(tensor: torch.Tensor | None) -> str:
    """A device tensor's IPC description (torch's `reduce_tensor` arguments) as text for a set-up entry ("-": none).
    The entries travel within the group's own set-up exchange (trusted peers of one job)."""
    if tensor is None:
        return "-"
    _, arguments = reduce_tensor(tensor)
    return base64.b64encode(pickle.dumps(arguments)).decode("ascii")


def open_ipc(text: str) -> torch.Tensor | None:
    """The peer's tensor of `encode_ipc`, mapped into this process (None for "-")."""
    if text == "-":
        return None
    return rebuild_cuda_tensor(*pickle.loads(base64.b64decode(text)))


class IpcRegions(Regions):
    """This rank's normal region (`num_nvl_bytes`) and low-latency area (`num_ll_bytes`, or none) in device memory of
    `device`, zeroed, and after `connect` every rank's as mapped in this process (see the module docstring).
    `destroy` waits for the device, then drops the peers' mappings and this rank's memory (torch frees it once
    every peer dropped its mapping too)."""

    def __init__(self, rank: int, num_ranks: int, num_nvl_bytes: int, num_ll_bytes: int, timeout_s: float,
                 device: torch.device) -> None:  # fmt: skip
        if device.type != "cuda":
            raise _C.CommError(
                f"mtdeepep: the triton executor's peer table on {device.type} devices needs their IPC handles, which "
                "torch shares for CUDA / ROCm tensors only; use MTDEEPEP_ENGINE=cuda on this device"
            )
        if not 0 <= rank < num_ranks:
            raise ValueError(f"mtdeepep: invalid rank {rank} of {num_ranks}")
        self.rank, self.num_ranks, self.device = rank, num_ranks, device
        self._timeout_s = float(timeout_s)
        self.region = torch.zeros(max(num_nvl_bytes, 0), dtype=torch.uint8, device=device)
        self.low_latency = torch.zeros(num_ll_bytes, dtype=torch.uint8, device=device) if num_ll_bytes > 0 else None
        torch.cuda.synchronize(device)  # the zeroes are there before a peer can map them
        self.peers: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._creator_pid = os.getpid()
        self.destroyed = False

    def setup_entry(self) -> str:
        return f"{encode_ipc(self.region if self.region.numel() else None)}\t{encode_ipc(self.low_latency)}"

    def connect(self, entries: list[str], uid: int) -> None:
        if len(entries) != self.num_ranks:
            raise ValueError(f"mtdeepep: {len(entries)} set-up entries for {self.num_ranks} ranks")
        peers = []
        for r, entry in enumerate(entries):
            if r == self.rank:
                peers.append((self.region, self.low_latency))
                continue
            region_text, ll_text = entry.split("\t")
            try:
                region, ll = open_ipc(region_text), open_ipc(ll_text)
            except Exception as error:  # noqa: BLE001 - the driver's reason, with the rank it concerns
                raise _C.CommError(f"mtdeepep: opening rank {r}'s IPC handles failed: {error}") from error
            region_bytes = 0 if region is None else region.numel()
            if region_bytes != self.region.numel() or (ll is None) != (self.low_latency is None):
                raise _C.GroupMismatchError(
                    f"mtdeepep: rank {r}'s buffer ({region_bytes} normal bytes, low-latency area: {ll is not None}) "
                    f"differs from rank {self.rank}'s ({self.region.numel()}, {self.low_latency is not None})"
                )
            if ll is not None and ll.numel() != self.low_latency.numel():
                raise _C.GroupMismatchError(
                    f"mtdeepep: rank {r}'s low-latency area has {ll.numel()} bytes, rank {self.rank}'s "
                    f"{self.low_latency.numel()}"
                )
            peers.append((region if region is not None else self.region.new_empty(0), ll))
        self.peers = peers

    def region_addresses(self, low_latency_area: bool) -> list[int]:
        if not self.peers:
            raise _C.CommError("mtdeepep: the buffer is not set up")
        if low_latency_area:
            return [0 if ll is None else ll.data_ptr() for _, ll in self.peers]
        return [region.data_ptr() for region, _ in self.peers]

    def get_local_buffer_tensor(self, dtype, offset, use_rdma_buffer):
        area = self.low_latency if use_rdma_buffer else self.region
        if area is None:
            raise ValueError("mtdeepep: this buffer has no low-latency area")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset % itemsize or offset > area.numel():
            raise ValueError(f"mtdeepep: offset {offset} is outside the buffer or not a multiple of {itemsize}")
        usable = (area.numel() - offset) // itemsize * itemsize
        return area[offset : offset + usable].view(dtype)

    def num_ll_bytes(self) -> int:
        return 0 if self.low_latency is None else self.low_latency.numel()

    def timeout_s(self) -> float:
        return self._timeout_s

    def set_timeout(self, timeout_s: float) -> None:
        self._timeout_s = float(timeout_s)

    def interrupt(self, reason: str) -> None:
        """Nothing to stop on the host: the executor has already written this rank's poison word, which ends its
        device waits at their next spin."""

    def destroy(self) -> None:
        if self.destroyed or os.getpid() != self._creator_pid:
            return  # a forked child never touches the parent's CUDA context
        self.destroyed = True
        torch.cuda.synchronize(self.device)  # no kernel of this rank still reads or writes a peer
        self.peers = []
        self.region = self.region.new_empty(0)
        self.low_latency = None


def open_regions(rank: int, num_ranks: int, num_nvl_bytes: int, num_ll_bytes: int, timeout_s: float,
                 device: torch.device) -> Regions:  # fmt: skip
    """The regions provider for the kernels' device: shared memory on the CPU, IPC-shared device memory on a GPU."""
    if device.type == "cpu":
        return SharedMemoryRegions(rank, num_ranks, num_nvl_bytes, num_ll_bytes, timeout_s)
    return IpcRegions(rank, num_ranks, num_nvl_bytes, num_ll_bytes, timeout_s, device)
