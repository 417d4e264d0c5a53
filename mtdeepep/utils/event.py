"""What DeepEP's `deep_ep.utils` exports about events and links, for code that imports it from there.

DeepEP V1 (`deep_ep/utils.py`) defines `EventOverlap` and `check_nvlink_connections` and re-exports the C++
`EventHandle`; DeepEP V2 keeps `EventOverlap` and `EventHandle` in `deep_ep/utils/event.py`. Clients such as
Megatron-core build `EventOverlap(EventHandle())` themselves and pass it back as `previous_event`, so these must
be the very classes `mtdeepep.Buffer` accepts: `EventOverlap` is `mtdeepep.EventOverlap` and `EventHandle` is
`mtdeepep.EventHandle` (a default-constructed one is an already completed event: on the CPU executor the
caller's thread is the "current stream").
"""

from __future__ import annotations

import socket

import torch.distributed as dist

from .._C import EventHandle
from ..engines.setup import check_nodes_share_hosts, resolve_num_ranks_per_node
from ..event import EventOverlap

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """Check that the ranks which exchange data directly can reach each other's memory.

    DeepEP checks that every pair of GPUs of a node is linked by NVLink. The CPU executor's direct transport is
    shared memory, so its condition is that the ranks of each node (consecutive group ranks, `LOCAL_WORLD_SIZE`
    per node, else the whole group) run on one host. Collective over `group`; raises ValueError naming the node
    that spans several hosts.
    """
    if group is None:
        group = dist.group.WORLD
    hosts: list[str] = [""] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    check_nodes_share_hosts(hosts, resolve_num_ranks_per_node(None, group.size()))
