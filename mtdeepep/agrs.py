"""DeepEP 2.1's all-gather sessions (`ElasticBuffer.agrs_*`, `all_gather`).

Upstream: within a session (`create_agrs_session` ... `destroy_agrs_session`), each `all_gather` takes the next
`align(num_ranks * nbytes, 32)` bytes of the session area of the symmetric buffer, every rank writes its tensor into
its slot of every peer's copy, and the result is a `[num_ranks, *shape]` view of that area, valid until the session
area is reused; `agrs_get_inplace_tensor` hands out this rank's slot beforehand, so that gathering it copies
nothing. A session holds at most `num_max_session_bytes` and `num_max_all_gathers_per_session` gathers; the call
returns a handle to wait on, and handles may be waited on in any order.

Here the session area is host memory of `num_max_session_bytes` owned by the buffer; an `all_gather` checks its
tensors (shapes, dtypes, room left in the session), exchanges a small header with every peer (so that gathers whose
sizes differ between ranks raise ValueError on every rank instead of corrupting memory; the call waits until every
rank has issued the same gather, bounded), then posts the transfers of this rank's slot to every peer and of every
peer's slot from it; the handle waits for them (bounded, naming the late rank). `destroy_agrs_session` waits for the
transfers the session still has outstanding. Every rank must issue the same gathers in the same order, as upstream.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import torch

from .peer_link import TAG_AGRS, PeerLink, Transfer, as_bytes
from .pp_ring import BUFFER_ALIGNMENT, _align, _check_count, _require

AGRS_ALIGNMENT = 32

Shape = tuple[int, ...] | torch.Size


def _is_batched(shapes) -> bool:
    return len(shapes) > 0 and isinstance(shapes[0], (tuple, list, torch.Size))


def _check_shapes(shapes) -> tuple[tuple[int, ...], ...]:
    _require(
        isinstance(shapes, (tuple, list, torch.Size)), f"shapes must be a shape or a sequence of shapes, got {shapes!r}"
    )
    batch = shapes if _is_batched(shapes) else (shapes,)
    _require(len(batch) > 0, "shapes must not be empty")
    for shape in batch:
        _require(
            all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape),
            f"a shape must be a tuple of non-negative ints, got {shape!r}",
        )
    return tuple(tuple(shape) for shape in batch)


def session_bytes(num_ranks: int, shapes, dtype: torch.dtype) -> int:
    """Upstream's `get_agrs_num_max_session_bytes`: the sum over the gathered tensors of their gathered size
    (`num_ranks` copies), each rounded up to 32 bytes."""
    _require(isinstance(dtype, torch.dtype), f"dtype must be a torch.dtype, got {dtype!r}")
    return sum(_align(num_ranks * math.prod(s) * dtype.itemsize, AGRS_ALIGNMENT) for s in _check_shapes(shapes))


def agrs_buffer_size_hint(num_max_session_bytes: int) -> int:
    _check_count("num_max_session_bytes", num_max_session_bytes, 0)
    return _align(num_max_session_bytes, BUFFER_ALIGNMENT)


class _Session:
    def __init__(self) -> None:
        self.cursor = 0  # bytes of the session area taken
        self.num_gathers = 0
        self.inplace: dict[int, torch.Tensor] = {}  # data_ptr of a handed-out slot -> its gathered region
        self.outstanding: list[Transfer] = []


class AllGatherSessions:
    """The `agrs_*` state of one `ElasticBuffer`."""

    def __init__(self, link: PeerLink, num_bytes: int) -> None:
        self.link = link
        self.num_bytes = num_bytes
        self.num_max_session_bytes = 0
        self.num_max_all_gathers_per_session = 0
        self._area: torch.Tensor | None = None
        self._session: _Session | None = None

    def set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Checks the session fits the buffer, then waits for every rank (upstream's barrier). Collective."""
        _check_count("num_max_session_bytes", num_max_session_bytes, 1)
        _check_count("num_max_all_gathers_per_session", num_max_all_gathers_per_session, 1)
        _require(self._session is None, "agrs_set_config inside a session: destroy the session first")
        _require(
            num_max_session_bytes <= self.num_bytes,
            f"num_max_session_bytes={num_max_session_bytes} exceeds the buffer's {self.num_bytes} bytes "
            "(get_agrs_buffer_size_hint)",
        )
        self.link.barrier(TAG_AGRS, "agrs_set_config barrier")
        self.num_max_session_bytes = num_max_session_bytes
        self.num_max_all_gathers_per_session = num_max_all_gathers_per_session
        self._area = torch.empty(num_max_session_bytes, dtype=torch.uint8)

    def create(self) -> None:
        _require(self._area is not None, "create_agrs_session: call agrs_set_config first")
        _require(self._session is None, "create_agrs_session: a session is already open")
        self._session = _Session()

    def destroy(self) -> None:
        _require(self._session is not None, "destroy_agrs_session: no session is open")
        session, self._session = self._session, None
        self.link.wait_all(session.outstanding)

    def _open(self, name: str) -> _Session:
        _require(self._session is not None, f"{name}: needs an open session (create_agrs_session)")
        return self._session

    def _take(self, session: _Session, num_bytes: int, name: str) -> torch.Tensor:
        """The next `num_bytes` of the session area (the cursor moves by the 32-byte aligned size)."""
        end = session.cursor + num_bytes
        _require(
            end <= self.num_max_session_bytes,
            f"{name}: the session needs {end} bytes, more than num_max_session_bytes={self.num_max_session_bytes}",
        )
        region = self._area[session.cursor : end]
        session.cursor = _align(end, AGRS_ALIGNMENT)
        return region

    def inplace_tensor(self, shapes, dtype: torch.dtype):
        """This rank's slot of the next gathers' regions, `shapes` (one shape, or a sequence: a tuple back)."""
        session = self._open("agrs_get_inplace_tensor")
        batch = _check_shapes(shapes)
        _require(isinstance(dtype, torch.dtype), f"dtype must be a torch.dtype, got {dtype!r}")
        total = session.cursor + session_bytes(self.link.num_ranks, batch, dtype)
        _require(
            total <= self.num_max_session_bytes,
            f"agrs_get_inplace_tensor: the session needs {total} bytes, more than "
            f"num_max_session_bytes={self.num_max_session_bytes}",
        )
        out = []
        for shape in batch:
            num_bytes = math.prod(shape) * dtype.itemsize
            region = self._take(session, self.link.num_ranks * num_bytes, "agrs_get_inplace_tensor")
            slot = region[self.link.rank * num_bytes : (self.link.rank + 1) * num_bytes].view(dtype).view(shape)
            if num_bytes:
                session.inplace[slot.data_ptr()] = region
            out.append(slot)
        return tuple(out) if _is_batched(shapes) else out[0]

    def all_gather(self, tensors: torch.Tensor | Sequence[torch.Tensor]):
        """`(gathered, handle)` for one tensor, `(*gathered, handle)` for a sequence; `gathered` is
        `[num_ranks, *t.shape]` in t's dtype (a view of the session area) and `handle()` waits for it."""
        session = self._open("all_gather")
        batched = not isinstance(tensors, torch.Tensor)
        batch = tuple(tensors) if batched else (tensors,)
        _require(len(batch) > 0, "all_gather: no tensors given")
        for t in batch:
            _require(isinstance(t, torch.Tensor), f"all_gather: expected tensors, got {type(t).__name__}")
            _require(t.device.type == "cpu" and t.is_contiguous(), "all_gather: tensors must be contiguous CPU tensors")
        _require(
            session.num_gathers + len(batch) <= self.num_max_all_gathers_per_session,
            f"all_gather: {session.num_gathers + len(batch)} gathers in this session, more than "
            f"num_max_all_gathers_per_session={self.num_max_all_gathers_per_session}",
        )
        fresh = [t for t in batch if t.data_ptr() not in session.inplace or t.numel() == 0]
        needed = session.cursor + sum(
            _align(self.link.num_ranks * t.numel() * t.element_size(), AGRS_ALIGNMENT) for t in fresh
        )
        _require(
            needed <= self.num_max_session_bytes,
            f"all_gather: the session needs {needed} bytes, more than "
            f"num_max_session_bytes={self.num_max_session_bytes}",
        )
        # Every rank gathers the same shapes and dtypes: compare a fingerprint of them with every peer first.
        fingerprint = zlib.crc32(repr([(tuple(t.shape), str(t.dtype)) for t in batch]).encode())
        words = self.link.all_gather_words([fingerprint], TAG_AGRS, "all_gather: header")
        late = [r for r, w in enumerate(words) if w[0] != fingerprint]
        _require(not late, f"all_gather: ranks {late} gather other shapes or dtypes than rank {self.link.rank}")

        outputs, transfers = [], []
        num_ranks, rank = self.link.num_ranks, self.link.rank
        for t in batch:
            num_bytes = t.numel() * t.element_size()
            region = session.inplace.pop(t.data_ptr(), None) if num_bytes else None
            if region is None or region.numel() != num_ranks * num_bytes:
                region = self._take(session, num_ranks * num_bytes, "all_gather")
                region[rank * num_bytes : (rank + 1) * num_bytes].copy_(as_bytes(t))
            slots = region.view(num_ranks, num_bytes)
            for peer in range(num_ranks):
                if peer != rank:
                    transfers.append(self.link.isend(slots[rank], peer, TAG_AGRS, "all_gather: slot to peer"))
                    transfers.append(self.link.irecv(slots[peer], peer, TAG_AGRS, "all_gather: slot from peer"))
            outputs.append(slots.view(t.dtype).view(num_ranks, *t.shape))
        session.num_gathers += len(batch)
        session.outstanding += transfers
        handle = self._handle(transfers)
        return (*outputs, handle) if batched else (outputs[0], handle)

    def _handle(self, transfers: list[Transfer]) -> Callable[[], None]:
        def wait() -> None:
            self.link.wait_all(transfers)

        return wait
