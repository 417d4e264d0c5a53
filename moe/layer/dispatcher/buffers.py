"""`EPBuffers`: the `mtdeepep.Buffer`s that the MoE layers of one owner share, one per (process group, mode).

A buffer costs shared memory and a comm thread per rank (DeepSeek-V3 at EP 8, hidden 7168: ~585 MiB of normal-mode
region per rank), so the 'flex' and 'flex_ll' dispatchers do not each build one: they ask an `EPBuffers` for the
buffer of their group and mode (normal / low-latency) with at least the bytes they need. The first request creates
it; a request for more replaces it by a buffer of the larger size (as Megatron's `fused_a2a.get_buffer` and
torchtitan's `get_buffer` do, without their process-global variable).

Collective: creating or growing a buffer is a set-up exchange over the group, so every rank of the group must make
the same requests in the same order. Layers built from the same config on every rank, called in the same order, do.

Lifetime:
- The owner (a model or trainer) creates an `EPBuffers` and passes it to its layers (`MoELayer(..., ep_buffers=)`).
  `destroy()`, or the owner being garbage-collected, destroys every buffer it created that is still alive. Run the
  backward of the last forward before that: the backward communicates on the forward's buffer.
- A replaced (smaller) buffer is only dropped: what still uses it keeps it alive (the handle of a dispatch in flight,
  the autograd graph of a forward, which holds its buffer until the backward ran), and it is released when the last
  of them goes. mtdeepep also accepts a handle on any live buffer of the same group.
- Dispatchers given no `EPBuffers` use `default_ep_buffers(group)`: one per process group, shared by every such
  dispatcher and owned by them (a weak map from the group to it), so it goes, with its buffers, when the last of those
  dispatchers is collected. It is not a global buffer: it holds nothing once no layer uses it, and an owner that wants
  explicit control passes its own.
"""

from __future__ import annotations

import contextlib
import weakref
from abc import abstractmethod
from typing import Any

import torch.distributed as dist

import mtdeepep as deep_ep
from moe.layer.dispatcher.base import TokenDispatcher
from moe.layer.dispatcher.comm import group_rank, group_size
from mtdeepep.utils.fp8 import FP8_BLOCK


def _destroy_buffers(current: dict, created: weakref.WeakSet) -> None:
    """Finalizer of an `EPBuffers`: destroy every buffer it created that is still alive (the current ones and the
    replaced ones something still holds). Errors are ignored: a buffer whose peers failed may refuse."""
    current.clear()
    for buffer in list(created):
        with contextlib.suppress(Exception):
            buffer.destroy()


class EPBuffers:
    """Shared `mtdeepep.Buffer`s, one per (process group, mode), created on first use and grown on demand.

    Args:
        timeout_s: bound on every wait of the buffers it creates (None: mtdeepep's default, `MTDEEPEP_TIMEOUT_S`).

    Attributes: `num_created`, the buffers created so far (growth included).
    """

    def __init__(self, *, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.num_created = 0
        self._current: dict[tuple[dist.ProcessGroup, bool], deep_ep.Buffer] = {}
        self._created: weakref.WeakSet[deep_ep.Buffer] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _destroy_buffers, self._current, self._created)

    def get(
        self,
        group: dist.ProcessGroup,
        *,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
    ) -> deep_ep.Buffer:
        """The buffer of `group` in this mode with at least `num_nvl_bytes` (normal region) and `num_rdma_bytes`
        (low-latency area). Collective when it creates one: on first use, or to replace the current buffer by one
        of the larger of its sizes and these (see the module docstring)."""
        if not self._finalizer.alive:
            raise RuntimeError("these EPBuffers were destroyed")
        key = (group, bool(low_latency_mode))
        buffer = self._current.get(key)
        if buffer is not None and buffer.num_nvl_bytes >= num_nvl_bytes and buffer.num_rdma_bytes >= num_rdma_bytes:
            return buffer
        if buffer is not None:
            num_nvl_bytes = max(num_nvl_bytes, buffer.num_nvl_bytes)
            num_rdma_bytes = max(num_rdma_bytes, buffer.num_rdma_bytes)
        buffer = deep_ep.Buffer(
            group,
            num_nvl_bytes=num_nvl_bytes,
            num_rdma_bytes=num_rdma_bytes,
            low_latency_mode=bool(low_latency_mode),
            explicitly_destroy=True,
            timeout_s=self.timeout_s,
        )
        self._current[key] = buffer  # the replaced one lives on while a handle or a graph still holds it
        self._created.add(buffer)
        self.num_created += 1
        return buffer

    def buffers(self) -> list[deep_ep.Buffer]:
        """The current buffers (one per group and mode in use)."""
        return list(self._current.values())

    def destroy(self) -> None:
        """Destroy every buffer created here that is still alive; later `get` calls raise. Idempotent."""
        self._finalizer()


_DEFAULTS: weakref.WeakValueDictionary[dist.ProcessGroup, EPBuffers] = weakref.WeakValueDictionary()


def default_ep_buffers(group: dist.ProcessGroup) -> EPBuffers:
    """The `EPBuffers` of `group` shared by the dispatchers given none: created here on first use, kept alive only by
    the dispatchers that hold it (see the module docstring)."""
    buffers = _DEFAULTS.get(group)
    if buffers is None:
        buffers = _DEFAULTS[group] = EPBuffers()
    return buffers


# ---------------------------------------------------------------------------------------------------------------
# Where a dispatcher's buffer comes from


def buffer_group(buffer: deep_ep.Buffer | None, ep_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The EP group of a dispatcher given `buffer` and/or `ep_group`: the buffer's group when only the buffer is
    given; ValueError if both are given and this rank's position or the size differ."""
    if buffer is None:
        return ep_group
    if ep_group is None:
        return buffer.group
    if (buffer.group_size, buffer.rank) != (group_size(ep_group), group_rank(ep_group)):
        raise ValueError(
            f"the buffer spans {buffer.group_size} ranks (this one {buffer.rank}) but ep_group has "
            f"{group_size(ep_group)} (this one {group_rank(ep_group)})"
        )
    return ep_group


def buffer_source(
    buffer: deep_ep.Buffer | None, ep_buffers: EPBuffers | None, ep_group: dist.ProcessGroup | None
) -> EPBuffers | None:
    """Where a dispatcher gets its buffer: None when it was given one (`buffer`) or has no group, else `ep_buffers`,
    or the group's default `EPBuffers` when that is None too."""
    if buffer is not None and ep_buffers is not None:
        raise ValueError("give the dispatcher a buffer or ep_buffers, not both")
    if buffer is not None or ep_group is None:
        return None
    return ep_buffers if ep_buffers is not None else default_ep_buffers(ep_group)


class BufferDispatcher(TokenDispatcher):
    """A dispatcher on an `mtdeepep.Buffer` ('flex', 'flex_ll'), with the arguments they share (their docstrings say
    what each means for them): the buffer given (`buffer`), else the one of its group taken from `ep_buffers` (or the
    group's default, see `buffer_source`) with the sizes `_buffer_request` names. `use_fp8` needs `hidden_size` to be
    a multiple of 128 (ValueError otherwise)."""

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        ep_group: dist.ProcessGroup | None = None,
        buffer: deep_ep.Buffer | None = None,
        ep_buffers: EPBuffers | None = None,
        use_fp8: bool = False,
    ) -> None:
        if use_fp8 and hidden_size % FP8_BLOCK:
            raise ValueError(f"use_fp8 needs hidden_size % {FP8_BLOCK} == 0, got hidden_size={hidden_size}")
        ep_group = buffer_group(buffer, ep_group)
        super().__init__(num_experts=num_experts, ep_group=ep_group)
        self.hidden_size = hidden_size
        self.use_fp8 = bool(use_fp8)
        self._buffer = buffer
        self.ep_buffers = buffer_source(buffer, ep_buffers, ep_group)

    @abstractmethod
    def _buffer_request(self) -> dict[str, Any]:
        """The keyword arguments of `EPBuffers.get` for the buffer this dispatcher needs (its mode and bytes)."""

    @property
    def buffer(self) -> deep_ep.Buffer | None:
        """The `mtdeepep.Buffer` the next dispatch uses: the given one, else the `ep_buffers` one (created or grown on
        first use; collective). None when there is no EP group."""
        if self.ep_buffers is None:
            return self._buffer
        return self.ep_buffers.get(self.ep_group, **self._buffer_request())
