"""Point-to-point byte transfers over a buffer's torch.distributed group, every wait bounded and naming the peer.

DeepEP 2.1's pipeline (`pp_*`), all-gather (`agrs_*`, `all_gather`) and Engram (`engram_*`) primitives move bytes
between ranks outside the expert-parallel dispatch/combine. On this executor they go through the buffer's own process
group (gloo on CPU, so they work in every logical domain, one node or several), as tagged `isend` / `irecv` pairs:

- one tag per primitive, so that the pipeline's, the all-gather's and Engram's messages never match each other, nor
  the collectives the engines run on the same group (those use gloo's collective slots);
- messages of one tag between one pair of ranks match in the order they were posted (gloo's guarantee), which is
  what "in order per pair" means for `pp_send` / `pp_recv`;
- a receive whose size differs from the message aborts gloo's process, so a message whose size the receiver cannot
  know is preceded by a fixed-size header (`send_sized` / `recv_sized`), and a size mismatch becomes a ValueError;
- every wait has the buffer's timeout and raises `CommTimeoutError` naming the peer rank and the phase (a gloo send
  completes when the receiver has posted its receive, so a send's wait names a late receiver).
"""

from __future__ import annotations

import dataclasses
import datetime
import time

import torch
import torch.distributed as dist

from ._C import CommError, CommTimeoutError

TAG_PP = 0x5050
TAG_AGRS = 0x4147
TAG_ENGRAM = 0x454E
HEADER_WORDS = 2  # int64: (payload bytes, a check word the receiver compares)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


@dataclasses.dataclass
class Transfer:
    """One posted send or receive; keeps its tensor alive until waited."""

    work: object | None  # None: nothing to move (0 bytes)
    peer: int
    is_send: bool
    phase: str
    tensor: torch.Tensor

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, deadline: float, rank: int) -> None:
        if self.work is None:
            return
        remaining = max(deadline - time.monotonic(), 1e-3)
        try:
            self.work.wait(timeout=datetime.timedelta(seconds=remaining))
        except RuntimeError as error:
            action = "receive" if self.is_send else "send"
            message = f"mtdeepep: {self.phase}: rank {self.peer} did not {action} (waited on rank {rank}): {error}"
            if "imed out" in str(error):
                raise CommTimeoutError(message) from error
            raise CommError(message) from error
        self.work = None


class PeerLink:
    """Tagged, bounded point-to-point transfers between the ranks of `group` (ranks are group ranks)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.timeout_s = timeout_s

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, phase: str) -> Transfer:
        data = as_bytes(tensor)
        work = dist.isend(data, group=self.group, group_dst=peer, tag=tag) if data.numel() else None
        return Transfer(work, peer, True, phase, data)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, phase: str) -> Transfer:
        data = as_bytes(tensor)
        work = dist.irecv(data, group=self.group, group_src=peer, tag=tag) if data.numel() else None
        return Transfer(work, peer, False, phase, data)

    def wait_all(self, transfers: list[Transfer], deadline: float | None = None) -> None:
        deadline = self.deadline() if deadline is None else deadline
        for transfer in transfers:
            transfer.wait(deadline, self.rank)

    # ---- sized messages: a header first, so that the receiver checks the size before posting the payload ----

    def send_sized(self, tensor: torch.Tensor, peer: int, tag: int, phase: str, check: int = 0) -> list[Transfer]:
        header = torch.tensor([tensor.numel() * tensor.element_size(), check], dtype=torch.int64)
        return [self.isend(header, peer, tag, phase), self.isend(tensor, peer, tag, phase)]

    def recv_header(self, peer: int, tag: int, phase: str, deadline: float) -> tuple[int, int]:
        header = torch.empty(HEADER_WORDS, dtype=torch.int64)
        self.irecv(header, peer, tag, phase).wait(deadline, self.rank)
        return int(header[0]), int(header[1])

    def exchange(self, payloads: list[torch.Tensor | None], tag: int, phase: str) -> list[torch.Tensor | None]:
        """All-to-all of byte blobs of any size: `payloads[p]` (uint8, or None for nothing) goes to rank p, and the
        result's entry p is what rank p sent here (None for this rank's own entry). Every rank must call it."""
        deadline = self.deadline()
        peers = [p for p in range(self.num_ranks) if p != self.rank]
        sends: list[Transfer] = []
        for peer in peers:
            blob = payloads[peer] if payloads[peer] is not None else torch.empty(0, dtype=torch.uint8)
            sends += self.send_sized(as_bytes(blob.contiguous()), peer, tag, phase)
        received: list[torch.Tensor | None] = [None] * self.num_ranks
        for peer in peers:
            size, _ = self.recv_header(peer, tag, phase, deadline)
            received[peer] = torch.empty(size, dtype=torch.uint8)
            self.irecv(received[peer], peer, tag, phase).wait(deadline, self.rank)
        self.wait_all(sends, deadline)
        return received

    def all_gather_words(self, words: list[int], tag: int, phase: str) -> list[list[int]]:
        """Every rank's list of int64 `words` (the same length on every rank), ordered by rank."""
        mine = torch.tensor(words, dtype=torch.int64)
        received = self.exchange([as_bytes(mine)] * self.num_ranks, tag, phase)
        return [words if r == self.rank else received[r].view(torch.int64).tolist() for r in range(self.num_ranks)]

    def barrier(self, tag: int, phase: str) -> None:
        """Every rank reached this point (bounded, naming the late rank)."""
        self.all_gather_words([0], tag, phase)
