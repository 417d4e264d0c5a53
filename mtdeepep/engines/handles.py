"""Dispatch identity: what a handle carries besides DeepEP's tuple.

DeepEP's handles are plain tuples of tensors, and its clients keep them that way (Megatron stores them on an autograd
context and may pass them to another buffer of the same group; torchtitan smuggles them through custom ops). mtdeepep
keeps the tuple, and attaches to a tensor the dispatch created (never to a user's tensor) a `DispatchRecord`:

- the dispatch's identity `(uid, seq)`: the buffer's id, agreed by the ranks at set-up, and the dispatch's number in
  that buffer. Combine and cached dispatch publish it, so ranks that pass handles of different dispatches (interleaved
  micro-batches in a pipeline) all raise `GroupMismatchError` instead of exchanging rows that do not match;
- the group's identity (its global ranks and this rank), so a handle from a buffer of another group is refused, while
  a handle from any live buffer of the same group is accepted, as upstream does;
- private copies of the tensors the engine reads again later (layout, routing), so that changing the handle's tensors
  in place cannot make the engine read outside its buffers; the engine also checks them.

The record survives rebuilding the tuple (`tuple(handle)`, unpacking and repacking): it lives on the tensor object.

The handle types every engine issues live here too (`InternodeHandle`, `low_latency_handle`), so that the
executors and the facades read them from this one module, below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

_ATTRIBUTE = "_mtdeepep_dispatch"


@dataclass(frozen=True)
class DispatchRecord:
    """What mtdeepep needs to combine (or re-dispatch) a dispatch.

    kind: which engine layout the handle has ('intranode', 'internode', 'low_latency').
    group: `(global ranks of the group, this rank)`. uid, seq: the dispatch's identity.
    num_tokens: tokens this rank dispatched. num_recv: rows it received (the combine's input rows).
    state: the engine's private copies (engine-specific, never handed to users).
    """

    kind: str
    group: tuple[tuple[int, ...], int]
    uid: int
    seq: int
    num_tokens: int
    num_recv: int
    state: Any = field(repr=False)


def attach(carrier: torch.Tensor, record: DispatchRecord) -> None:
    """Attaches `record` to `carrier`, a tensor the dispatch created and put in the handle."""
    setattr(carrier, _ATTRIBUTE, record)


def record_of(handle: Any, kind: str, group: tuple[tuple[int, ...], int], what: str) -> DispatchRecord:
    """The record of `handle` (a tuple from an mtdeepep dispatch), checked against the expected kind and group.

    ValueError, before any communication, if it is not such a handle, or comes from another group or mode.
    """
    elements = handle if isinstance(handle, tuple) else ()
    record = next(
        (r for r in (getattr(e, _ATTRIBUTE, None) for e in elements if isinstance(e, torch.Tensor)) if r is not None),
        None,
    )
    if record is None:
        raise ValueError(
            f"mtdeepep: {what}: the handle must be the tuple returned by an mtdeepep dispatch (its tensors carry the "
            f"dispatch's identity; a copied or hand-made tuple is refused), got {type(handle).__name__}"
        )
    if record.kind != kind:
        raise ValueError(f"mtdeepep: {what}: the handle comes from a {record.kind} dispatch, this call needs {kind}")
    if record.group != group:
        raise ValueError(
            f"mtdeepep: {what}: the handle was issued for group ranks {list(record.group[0])} (this rank "
            f"{record.group[1]}), this buffer serves {list(group[0])} (this rank {group[1]})"
        )
    return record


class InternodeHandle(NamedTuple):
    """The handle of an internode dispatch: a tuple of 8 (pass it to `combine` and to cached `dispatch`).

    Upstream's positions that its tests read are kept: `handle[0]` is `is_token_in_rank` and `handle[-4]` is
    `recv_gbl_rank_prefix_sum`. Everything is on the engine's device.
    """

    is_token_in_rank: torch.Tensor  # [T, R] bool, as given to dispatch
    send_node_prefix: torch.Tensor  # [N] int32, inclusive prefix over nodes of the rows this rank sends
    send_token_idx: torch.Tensor  # [S] int64, token of each network row, grouped by destination node, token order
    fwd_recv_node_prefix: torch.Tensor  # [N] int32, inclusive prefix over nodes of the rows this rank forwards
    recv_gbl_rank_prefix_sum: torch.Tensor  # [R] int32, inclusive prefix over source ranks of the received rows
    recv_src_meta: torch.Tensor  # [N_out, 2] int32, (source rank, token index there) per output row; -1 padding
    recv_perm: torch.Tensor  # [N_recv] int64, output row i is row recv_perm[i] of the node stage's outputs (source
    # nodes in order): the identity, as they come in output order
    node_handle: tuple  # per source node, the node-local stage's handle (forwarded rows -> ranks of this node)


def flatten_handle(handle: tuple) -> list[torch.Tensor]:
    """A dispatch handle as the flat list of its tensors (custom ops take tensor lists): an intranode handle is its
    6 tensors, an internode one its 7 tensors followed by its node-local stage's handle."""
    flat: list[torch.Tensor] = []
    for element in handle:
        if isinstance(element, tuple):
            flat.extend(flatten_handle(element))
        elif isinstance(element, torch.Tensor):
            flat.append(element)
        else:
            raise ValueError(f"mtdeepep: a dispatch handle holds tensors, got {type(element).__name__}")
    return flat


def unflatten_handle(flat: list[torch.Tensor]) -> tuple:
    """The handle tuple of `flatten_handle(handle)`."""
    record = next((getattr(t, _ATTRIBUTE) for t in flat if hasattr(t, _ATTRIBUTE)), None)
    if record is not None and record.kind == "internode":
        # The internode handle's own tensors, then one node-stage handle per chunk of the same length.
        num_own = len(InternodeHandle._fields) - 1
        rest, num_chunks = flat[num_own:], len(record.state.chunks)
        size = len(rest) // num_chunks
        return InternodeHandle(*flat[:num_own], tuple(tuple(rest[i : i + size]) for i in range(0, len(rest), size)))
    return tuple(flat)


def low_latency_handle(engine, src_info: torch.Tensor, layout_range: torch.Tensor, seq: int,
                       x: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int) -> tuple:  # fmt: skip
    """DeepEP's low-latency handle `(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)`
    with the dispatch's identity attached (`engine`: the issuing `Engine`, for its group and uid; every executor
    issues this handle in low-latency mode). The C++ combine checks `src_info` and `layout_range` (bounds) itself."""
    record = DispatchRecord(
        kind="low_latency", group=engine.group, uid=engine.uid, seq=seq, num_tokens=x.size(0),
        num_recv=src_info.numel(), state=None,
    )  # fmt: skip
    attach(src_info, record)
    return src_info, layout_range, num_max_dispatch_tokens_per_rank, x.size(1), num_experts


def intranode_recv_sources(handle: tuple, rank: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source rank and source token (int64 `[n_valid]` each, on the handle's device) of every valid row received by
    `rank`, from an intranode handle `(rank_prefix_matrix [R, R], ..., recv_src_idx [N], ...)`: the rows arrive by
    source rank, and column `rank` of the inclusive prefix over sources says how many came from each."""
    rank_prefix_matrix, _, _, recv_src_idx, _, _ = handle
    column = rank_prefix_matrix[:, rank].long()
    per_source = torch.diff(column, prepend=column.new_zeros(1))
    src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=column.device), per_source)
    return src_rank, recv_src_idx[: src_rank.numel()].long()
