"""DeepEP 2.1's Engram storage (`ElasticBuffer.engram_*`): each rank holds `num_entries` rows of a table whose
global row `r * num_entries + i` is row i of rank r; `engram_fetch` gathers rows by global index.

Upstream keeps the rows in registered host memory (`num_cpu_bytes`) and fetches them with one-sided RDMA reads, so a
fetch involves only the fetching rank. Here the rows live in host memory of the owning rank and a fetch is served by
the owners over the buffer's group (`peer_link`): **every rank of the group calls `engram_fetch` together** (as
upstream's test does), each with its own indices. The call exchanges the requested indices with every peer and posts
the rows' transfers; the returned hook waits for them (bounded, naming the late rank) and returns the rows. FP8
storage fetches only the FP8 bytes; the scales come from the globally replicated table given at `engram_write`, in
row-major or TMA-aligned column-major layout, as upstream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .peer_link import TAG_ENGRAM, PeerLink, Transfer, as_bytes
from .pp_ring import BUFFER_ALIGNMENT, _align, _check_count, _require

ENTRY_ALIGNMENT = 32  # upstream rounds an entry to 32 bytes (LDG.256)
TMA_SF_ALIGNMENT = 4  # column stride of column-major scales, in 4-byte elements
STORAGE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
SF_DTYPES = (torch.float32, torch.int32)


def engram_storage_size_hint(
    num_entries: int, hidden: int, num_max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[int, int]:
    """Upstream's `(num_gpu_bytes, num_cpu_bytes)`: the fetch area for `num_max_tokens_per_rank` rows and the
    storage of `num_entries` rows, each row rounded to 32 bytes, both rounded up to 2 MiB."""
    _check_count("num_entries", num_entries, 0)
    _check_count("hidden", hidden, 1)
    _check_count("num_max_tokens_per_rank", num_max_tokens_per_rank, 0)
    _require(isinstance(dtype, torch.dtype), f"dtype must be a torch.dtype, got {dtype!r}")
    entry = _align(hidden * dtype.itemsize, ENTRY_ALIGNMENT)
    return _align(entry * num_max_tokens_per_rank, BUFFER_ALIGNMENT), _align(entry * num_entries, BUFFER_ALIGNMENT)


def col_major_tma_aligned(scales: torch.Tensor) -> torch.Tensor:
    """`scales` `[rows, cols]` in column-major storage with the column stride rounded up to 4 rows."""
    rows, cols = scales.shape
    out = torch.empty_strided((rows, cols), (1, _align(max(rows, 1), TMA_SF_ALIGNMENT)), dtype=scales.dtype)
    out.copy_(scales)
    return out


@dataclasses.dataclass
class _Table:
    storage: torch.Tensor  # [num_entries, hidden], this rank's rows
    sf: torch.Tensor | None  # [num_ranks * num_entries, packs], replicated


class EngramStore:
    """The Engram state of one `ElasticBuffer`: this rank's rows and the replicated scales."""

    def __init__(self, link: PeerLink, num_cpu_bytes: int) -> None:
        self.link = link
        self.num_cpu_bytes = num_cpu_bytes
        self.table: _Table | None = None

    def write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        """Keeps a copy of `storage` `[num_entries, hidden]` (bf16 or e4m3) as this rank's rows and `sf`
        `[num_ranks * num_entries, packs]` (float32 or int32; iff FP8) as the scales; every rank must write the
        same shapes (checked, ValueError on every rank). Collective, with a barrier before and after."""
        _require(self.num_cpu_bytes > 0, "engram_write needs a buffer made with num_cpu_bytes > 0")
        _require(isinstance(storage, torch.Tensor) and storage.dim() == 2, "storage must be a 2-D tensor")
        _require(storage.dtype in STORAGE_DTYPES, f"storage must be bfloat16 or float8_e4m3fn, got {storage.dtype}")
        _require(storage.device.type == "cpu", f"storage must be on the CPU, got {storage.device}")
        num_entries, hidden = storage.shape
        is_fp8 = storage.dtype == torch.float8_e4m3fn
        _require((sf is not None) == is_fp8, "sf must be given if and only if the storage is FP8")
        num_ranks = self.link.num_ranks
        if sf is not None:
            _require(
                isinstance(sf, torch.Tensor) and sf.dim() == 2 and sf.dtype in SF_DTYPES,
                "sf must be a 2-D float32 or int32 tensor",
            )
            _require(
                sf.size(0) == num_ranks * num_entries,
                f"sf has {sf.size(0)} rows, expected num_ranks * num_entries = {num_ranks * num_entries}",
            )
        needed = _align(hidden * storage.element_size(), ENTRY_ALIGNMENT) * num_entries
        _require(
            needed <= self.num_cpu_bytes,
            f"the storage needs {needed} bytes (get_engram_storage_size_hint), num_cpu_bytes is {self.num_cpu_bytes}",
        )
        mine = [num_entries, hidden, int(is_fp8), -1 if sf is None else sf.size(1)]
        everyone = self.link.all_gather_words(mine, TAG_ENGRAM, "engram_write: barrier before")
        differ = [r for r, words in enumerate(everyone) if words != mine]
        _require(not differ, f"engram_write: ranks {differ} write other shapes than rank {self.link.rank} ({mine})")
        self.table = _Table(storage.contiguous().clone(), None if sf is None else sf.contiguous().clone())
        self.link.barrier(TAG_ENGRAM, "engram_write: barrier after")

    def fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False) -> Callable:
        """`indices` `[T, E]` int32 global row ids; returns a hook that waits and returns `(data [T, E * hidden],
        sf [T, E * packs] or None)`. Collective (see the module docstring)."""
        _require(self.table is not None, "engram_fetch: call engram_write first")
        _check_count("num_qps", num_qps, 0)
        _require(
            isinstance(indices, torch.Tensor) and indices.dim() == 2 and indices.dtype == torch.int32,
            "indices must be a 2-D int32 tensor [num_tokens, num_entries_per_token]",
        )
        _require(indices.device.type == "cpu", f"indices must be on the CPU, got {indices.device}")
        storage, num_ranks, rank = self.table.storage, self.link.num_ranks, self.link.rank
        num_entries, hidden = storage.shape
        flat = indices.reshape(-1).long()
        if flat.numel():
            low, high = int(flat.min()), int(flat.max())
            _require(
                low >= 0 and high < num_ranks * num_entries,
                f"indices must lie in [0, {num_ranks * num_entries}), found [{low}, {high}]",
            )
        owner = torch.div(flat, max(num_entries, 1), rounding_mode="floor")
        local = flat - owner * num_entries
        positions = [torch.nonzero(owner == r).flatten() for r in range(num_ranks)]
        requests = [local[positions[r]].to(torch.int32) for r in range(num_ranks)]

        phase = "engram_fetch: indices"
        asked = self.link.exchange([as_bytes(requests[r]) for r in range(num_ranks)], TAG_ENGRAM, phase)
        # Rows move as bytes (index_put has no FP8 kernels): `[entries, hidden * itemsize]` uint8 views.
        table = storage.view(torch.uint8)
        out = torch.empty(flat.numel(), table.size(1), dtype=torch.uint8)
        out[positions[rank]] = table[requests[rank].long()]
        transfers: list[Transfer] = []
        received: list[tuple[torch.Tensor, torch.Tensor]] = []
        for peer in range(num_ranks):
            if peer == rank:
                continue
            rows = table[asked[peer].view(torch.int32).long()].contiguous()
            transfers.append(self.link.isend(rows, peer, TAG_ENGRAM, "engram_fetch: rows to peer"))
            landing = torch.empty(positions[peer].numel(), table.size(1), dtype=torch.uint8)
            transfers.append(self.link.irecv(landing, peer, TAG_ENGRAM, "engram_fetch: rows from peer"))
            received.append((positions[peer], landing))
        sf = None
        if self.table.sf is not None:
            sf = self.table.sf[flat].reshape(indices.size(0), -1)
            sf = col_major_tma_aligned(sf) if use_tma_aligned_col_major_sf else sf.contiguous()
        num_tokens = indices.size(0)

        def hook():
            self.link.wait_all(transfers)
            for where, rows in received:
                out[where] = rows
            return out.view(storage.dtype).view(num_tokens, -1), sf

        return hook
