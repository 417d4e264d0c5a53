"""DeepEP 2.1's pipeline-parallel send / receive between ring neighbours (`ElasticBuffer.pp_*`).

Upstream keeps, per ring neighbour, `num_max_inflight_tensors` slots of `num_max_tensor_bytes` for each direction in
the symmetric buffer: `pp_send` copies the tensor into the next free slot of the destination (waiting while all are
taken) and `pp_recv` takes the oldest message of the source. Here each send is a tagged message on the buffer's
group (`peer_link`): the tensor is copied at `pp_send` (the caller may reuse it at once), at most
`num_max_inflight_tensors` sends per neighbour are outstanding (the next one waits for the receiver to take the
oldest, bounded), and messages of one pair arrive in the order sent. A receive checks the message's size against
the output tensor (ValueError on a mismatch, after taking the message so that the pair stays in step).
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from .peer_link import TAG_PP, PeerLink, Transfer

PP_TENSOR_ALIGNMENT = 32  # upstream rounds the tensor size to 32 bytes (LDG.256)
BUFFER_ALIGNMENT = 2 << 20


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"mtdeepep: {message}")


def _check_count(name: str, value, minimum: int) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be an int >= {minimum}, got {value!r}",
    )


def pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
    """Upstream's figure: send and receive areas, each for the previous and the next rank of the ring, of
    `num_max_inflight_tensors` slots of `num_max_tensor_bytes` (rounded to 32), rounded up to 2 MiB."""
    _check_count("num_max_tensor_bytes", num_max_tensor_bytes, 1)
    _check_count("num_max_inflight_tensors", num_max_inflight_tensors, 1)
    slot = _align(num_max_tensor_bytes, PP_TENSOR_ALIGNMENT)
    return _align(slot * num_max_inflight_tensors * 2 * 2, BUFFER_ALIGNMENT)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    num_max_tensor_bytes: int
    num_max_inflight_tensors: int


class PipelineRing:
    """The `pp_*` state of one `ElasticBuffer`: its configuration and the outstanding sends per neighbour."""

    def __init__(self, link: PeerLink, num_bytes: int) -> None:
        self.link = link
        self.num_bytes = num_bytes
        self.config: PipelineConfig | None = None
        self._pending: dict[int, collections.deque[list[Transfer]]] = collections.defaultdict(collections.deque)

    def set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Checks the sizes fit the buffer, finishes the outstanding sends, then waits for every rank (upstream's
        barrier). Collective."""
        needed = pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)
        _require(
            needed <= self.num_bytes,
            f"pp_set_config({num_max_tensor_bytes}, {num_max_inflight_tensors}) needs a buffer of {needed} bytes "
            f"(get_pp_buffer_size_hint), this one has {self.num_bytes}",
        )
        self.flush()
        self.link.barrier(TAG_PP, "pp_set_config barrier")
        self.config = PipelineConfig(num_max_tensor_bytes, num_max_inflight_tensors)

    def _check(self, name: str, tensor: torch.Tensor, peer, num_sms) -> PipelineConfig:
        _require(self.config is not None, f"{name}: call pp_set_config first")
        _require(isinstance(tensor, torch.Tensor), f"{name}: t must be a tensor, got {type(tensor).__name__}")
        _require(tensor.device.type == "cpu", f"{name}: t must be on the CPU, got {tensor.device}")
        _require(tensor.is_contiguous(), f"{name}: t must be contiguous")
        num_bytes = tensor.numel() * tensor.element_size()
        _require(
            num_bytes <= self.config.num_max_tensor_bytes,
            f"{name}: t has {num_bytes} bytes, more than num_max_tensor_bytes={self.config.num_max_tensor_bytes}",
        )
        _check_count("num_sms", num_sms, 0)
        num_ranks, rank = self.link.num_ranks, self.link.rank
        _require(num_ranks > 1, f"{name}: needs a group of 2 ranks or more")
        neighbours = ((rank - 1) % num_ranks, (rank + 1) % num_ranks)
        _require(
            isinstance(peer, int) and not isinstance(peer, bool) and peer in neighbours,
            f"{name}: the peer must be the previous or next rank of the ring {neighbours} of rank {rank}, got {peer!r}",
        )
        return self.config

    def send(self, tensor: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        config = self._check("pp_send", tensor, dst_rank_idx, num_sms)
        pending = self._pending[dst_rank_idx]
        while pending and all(t.done() for t in pending[0]):
            pending.popleft()
        deadline = self.link.deadline()
        while len(pending) >= config.num_max_inflight_tensors:  # every slot taken: wait for the receiver
            self.link.wait_all(pending.popleft(), deadline)
        phase = f"pp_send to rank {dst_rank_idx}"
        pending.append(self.link.send_sized(tensor.clone(), dst_rank_idx, TAG_PP, phase))

    def recv(self, tensor: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        self._check("pp_recv", tensor, src_rank_idx, num_sms)
        phase = f"pp_recv from rank {src_rank_idx}"
        deadline = self.link.deadline()
        size, _ = self.link.recv_header(src_rank_idx, TAG_PP, phase, deadline)
        expected = tensor.numel() * tensor.element_size()
        target = tensor if size == expected else torch.empty(size, dtype=torch.uint8)
        self.link.irecv(target, src_rank_idx, TAG_PP, phase).wait(deadline, self.link.rank)
        _require(size == expected, f"pp_recv: rank {src_rank_idx} sent {size} bytes, t has {expected}")

    def flush(self) -> None:
        """Waits until the receivers took every outstanding send (bounded)."""
        deadline = self.link.deadline()
        for pending in self._pending.values():
            while pending:
                self.link.wait_all(pending.popleft(), deadline)
