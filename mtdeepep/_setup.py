"""Set-up helpers shared by every engine: a bounded all-gather of set-up strings, group identity, node grouping.

The set-up exchange goes through the rendezvous store of the default process group (a TCPStore on torchrun and
tcp:// / env:// initialisation), not through a collective of the group: every rank publishes its string under a key
of its own and polls for the others' with a deadline of `timeout_s`, so every rank (not only rank 0) gives up in time
and names the ranks whose strings never arrived. A collective would leave the other ranks blocked in the backend
with its own (long) timeout and report no rank.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import defaultdict
from datetime import timedelta

import torch.distributed as dist

from . import _C

# Per group (by its ranks), how many exchanges this process started: the ranks of a group create their buffers in the
# same order, so the n-th exchange of every rank meets under the same keys.
_GENERATIONS: defaultdict[str, int] = defaultdict(int)
_POLL_S = 0.002


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of `group`, in group order."""
    return tuple(dist.get_process_group_ranks(group))


def group_key(group: dist.ProcessGroup) -> tuple[tuple[int, ...], int]:
    """What identifies a group for handles: its global ranks and this process's rank in it."""
    return group_ranks(group), group.rank()


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def exchange_strings(group: dist.ProcessGroup, value: str, timeout_s: float, phase: str) -> list[str]:
    """All-gathers one string per rank of `group` through the rendezvous store, waiting at most `timeout_s`.

    Raises `CommTimeoutError` naming the ranks whose strings did not arrive, or `CommError` if the store is lost (its
    host exited). Keys are removed once every rank has read them.
    """
    ranks = group_ranks(group)
    digest = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=8).hexdigest()
    _GENERATIONS[digest] += 1
    prefix = f"mtdeepep/setup/{digest}/{_GENERATIONS[digest]}"
    keys = [f"{prefix}/{r}" for r in range(len(ranks))]
    rank = group.rank()
    store = _store()
    deadline = time.monotonic() + timeout_s
    try:
        store.set(keys[rank], value)
        missing = list(range(len(ranks)))
        while True:
            missing = [r for r in missing if not store.check([keys[r]])]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise _C.CommTimeoutError(
                    f"mtdeepep: rank {rank} timed out after {timeout_s} s in {phase}: group rank(s) {missing} "
                    f"(global {[ranks[r] for r in missing]}) did not arrive (they did not create the buffer, failed "
                    "before it, or exited)"
                )
            time.sleep(_POLL_S)
        values = [store.get(key).decode() for key in keys]
        # The last rank to have read everything removes the keys.
        if store.add(f"{prefix}/read", 1) == len(ranks):
            for key in (*keys, f"{prefix}/read"):
                store.delete_key(key)
    except _C.CommError:
        raise
    except (RuntimeError, dist.DistError) as error:
        raise _C.CommError(
            f"mtdeepep: rank {rank} lost the rendezvous store in {phase} (its host, usually global rank 0, may have "
            f"exited): {error}"
        ) from error
    return values


def buffer_uid(entries: list[str]) -> int:
    """An id every rank derives alike from the set-up strings (they hold rank 0's fresh segment name): it names the
    buffer in dispatch identities. A positive int64."""
    return int.from_bytes(hashlib.blake2b(entries[0].encode(), digest_size=7).digest(), "little")


def new_group(ranks: list[int], timeout_s: float, all_ranks_call: bool) -> dist.ProcessGroup:
    """`dist.new_group` bounded by `timeout_s` (the store-based barrier inside new_group uses the group timeout).
    `all_ranks_call`: every rank of the world calls it (else only `ranks` do: local synchronisation)."""
    return dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), use_local_synchronization=not all_ranks_call)


def resolve_num_ranks_per_node(num_ranks_per_node: int | None, group_size: int) -> int:
    """Ranks per node: the argument, else the `LOCAL_WORLD_SIZE` environment variable, else the whole group.

    A value of at least `group_size` means one node. Otherwise it must divide `group_size` (ValueError).
    """
    source = "num_ranks_per_node"
    if num_ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return group_size
        source = "LOCAL_WORLD_SIZE"
        try:
            num_ranks_per_node = int(env)
        except ValueError:
            raise ValueError(f"mtdeepep: LOCAL_WORLD_SIZE must be an integer, got {env!r}") from None
    if isinstance(num_ranks_per_node, bool) or not isinstance(num_ranks_per_node, int) or num_ranks_per_node < 1:
        raise ValueError(f"mtdeepep: {source} must be a positive int, got {num_ranks_per_node!r}")
    if num_ranks_per_node >= group_size:
        return group_size
    if group_size % num_ranks_per_node:
        raise ValueError(
            f"mtdeepep: the group's {group_size} ranks cannot be split into nodes of {source}={num_ranks_per_node}"
        )
    return num_ranks_per_node


def check_nodes_share_hosts(hosts: list[str], num_ranks_per_node: int) -> None:
    """ValueError unless the ranks of every node (consecutive group ranks) run on one host: the node-local stage
    moves data through shared memory."""
    for node in range(len(hosts) // num_ranks_per_node):
        first = node * num_ranks_per_node
        node_hosts = sorted(set(hosts[first : first + num_ranks_per_node]))
        if len(node_hosts) > 1:
            raise ValueError(
                f"mtdeepep: node {node} (group ranks {first}..{first + num_ranks_per_node - 1}) spans hosts "
                f"{', '.join(node_hosts)}, but the ranks of one node share memory and must run on one host; set "
                "num_ranks_per_node (or LOCAL_WORLD_SIZE) to the number of ranks per host, with each host's ranks "
                "consecutive in the group"
            )
