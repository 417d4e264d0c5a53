"""Set-up helpers shared by every engine: a bounded all-gather of set-up strings, group identity, node grouping.

The set-up exchange goes through the rendezvous store of the default process group (a TCPStore on torchrun and
tcp:// / env:// initialisation), not through a collective of the group: every rank publishes its string under a key
of its own and polls for the others' with a deadline of `timeout_s`, so every rank (not only rank 0) gives up in time
and names the ranks whose strings never arrived. A collective would leave the other ranks blocked in the backend
with its own (long) timeout and report no rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections import defaultdict
from datetime import timedelta

import torch.distributed as dist

from .. import _C

# Per group (by its ranks), how many exchanges this process started: the ranks of a group create their buffers in the
# same order, so the n-th exchange of every rank meets under the same keys.
_GENERATIONS: defaultdict[str, int] = defaultdict(int)
_POLL_S = 0.002
_WATCH_S = 0.2  # how often a waiting rank looks for a missing rank's published failure, or its death


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of `group`, in group order."""
    return tuple(dist.get_process_group_ranks(group))


def group_key(group: dist.ProcessGroup) -> tuple[tuple[int, ...], int]:
    """What identifies a group for handles: its global ranks and this process's rank in it."""
    return group_ranks(group), group.rank()


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (a killed child its parent has not reaped yet is a zombie: not
    alive); the same test as the C++ peer group's."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            line = stat.read()
    except OSError:
        return True
    state = line[line.rfind(")") + 2 : line.rfind(")") + 3]
    return state not in ("Z", "X")


class SetupRendezvous:
    """One buffer set-up of a group, through the rendezvous store (see the module docstring).

    Created first thing by every rank of the set-up, whatever happens after: it takes the group's next set-up number
    (so a rank whose set-up fails early stays in step with its peers for the next buffer of the group) and publishes
    this rank's host and pid. Then:

    - `exchange(value)` all-gathers the set-up strings with a deadline. While it waits it watches the ranks that have
      not arrived: one that published a failure is named with its reason at once ("rank 0 failed its set-up: ..."),
      one of this host whose process is gone is named with its pid at once; the others, at the deadline.
    - `fail(error)` publishes this rank's failure, so that its peers report it instead of a timeout or a symptom
      (a segment that no longer exists).
    - `peer_failure(grace_s)`: a failure a peer published (waiting up to `grace_s` for one), for the message of an
      error this rank met after the exchange.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, phase: str) -> None:
        self.ranks = group_ranks(group)
        digest = hashlib.blake2b(",".join(map(str, self.ranks)).encode(), digest_size=8).hexdigest()
        _GENERATIONS[digest] += 1
        self.prefix = f"mtdeepep/setup/{digest}/{_GENERATIONS[digest]}"
        self.rank, self.timeout_s, self.phase = group.rank(), timeout_s, phase
        self.host = socket.gethostname()
        self._store = _store()
        self._guard(lambda: self._store.set(self._key("pid", self.rank), f"{self.host} {os.getpid()}"))

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _guard(self, call):
        """Runs a store call; a lost store (its host, usually global rank 0, exited) is a CommError naming it."""
        try:
            return call()
        except (RuntimeError, dist.DistError) as error:
            raise _C.CommError(
                f"mtdeepep: rank {self.rank} lost the rendezvous store in {self.phase} (its host, usually global rank "
                f"0, may have exited): {error}"
            ) from error

    def exchange(self, value: str) -> list[str]:
        """Every rank's string (this rank's is `value`), by group rank; CommTimeoutError naming the ranks whose
        strings did not arrive in time, CommError naming a rank that failed or exited. Keys are removed once every
        rank has read them."""
        keys = [self._key("value", r) for r in range(len(self.ranks))]
        deadline = time.monotonic() + self.timeout_s
        self._guard(lambda: self._store.set(keys[self.rank], value))
        missing, next_watch = list(range(len(self.ranks))), 0.0
        while True:
            missing = [r for r in missing if not self._guard(lambda r=r: self._store.check([keys[r]]))]
            if not missing:
                break
            now = time.monotonic()
            if now >= next_watch:  # the missing ranks' failures and liveness, a few times a second
                self._stop_for(missing)
                next_watch = now + _WATCH_S
            if now > deadline:
                raise _C.CommTimeoutError(
                    f"mtdeepep: rank {self.rank} timed out after {self.timeout_s} s in {self.phase}: group rank(s) "
                    f"{missing} (global {[self.ranks[r] for r in missing]}) did not arrive (they did not create the "
                    "buffer, failed before it, or exited)"
                )
            time.sleep(_POLL_S)
        values = [self._guard(lambda k=k: self._store.get(k)).decode() for k in keys]
        # The last rank to have read everything removes the keys (the values and the pids).
        if self._guard(lambda: self._store.add(f"{self.prefix}/read", 1)) == len(self.ranks):
            for key in (*keys, *(self._key("pid", r) for r in range(len(self.ranks))), f"{self.prefix}/read"):
                self._guard(lambda key=key: self._store.delete_key(key))
        return values

    def _stop_for(self, missing: list[int]) -> None:
        """Raises for the first of `missing` that published a failure or whose process is gone."""
        for r in missing:
            reason = self._published_failure(r)
            if reason is not None:
                raise _C.CommError(self._failed_message(r, reason))
        for r in missing:
            if self._gone(r):
                pid = self._guard(lambda r=r: self._store.get(self._key("pid", r))).decode().rsplit(" ", 1)[1]
                raise _C.CommError(
                    f"mtdeepep: rank {self.rank} stopped in {self.phase}: group rank {r} (global {self.ranks[r]}, "
                    f"pid {pid}) exited without arriving"
                )

    def _published_failure(self, rank: int) -> str | None:
        key = self._key("failed", rank)
        if not self._guard(lambda: self._store.check([key])):
            return None
        return self._guard(lambda: self._store.get(key)).decode()

    def _failed_message(self, rank: int, reason: str) -> str:
        return (f"mtdeepep: rank {self.rank} stopped in {self.phase}: group rank {rank} (global {self.ranks[rank]}) "
                f"failed its set-up: {reason}")  # fmt: skip

    def fail(self, error: BaseException) -> None:
        """Publishes this rank's failure for its peers (best effort: the store may be gone)."""
        with contextlib.suppress(Exception):  # the original error is what the caller raises
            self._store.set(self._key("failed", self.rank), f"{type(error).__name__}: {error}")

    def peer_failure(self, grace_s: float) -> str | None:
        """The message naming the first peer that published a failure, waiting up to `grace_s` for one; None at once
        when a peer of this host is gone (a dead process publishes nothing, and this rank's own error names it)."""
        deadline = time.monotonic() + grace_s
        peers = [r for r in range(len(self.ranks)) if r != self.rank]
        while True:
            for r in peers:
                reason = self._published_failure(r)
                if reason is not None:
                    return self._failed_message(r, reason)
            if time.monotonic() >= deadline or any(self._gone(r) for r in peers):
                return None
            time.sleep(_WATCH_S / 4)

    def _gone(self, rank: int) -> bool:
        """Whether `rank` published its pid, runs on this host, and its process is gone."""
        key = self._key("pid", rank)
        if not self._guard(lambda: self._store.check([key])):
            return False
        host, pid = self._guard(lambda: self._store.get(key)).decode().rsplit(" ", 1)
        return host == self.host and not process_alive(int(pid))


def exchange_strings(group: dist.ProcessGroup, value: str, timeout_s: float, phase: str) -> list[str]:
    """All-gathers one string per rank of `group` through the rendezvous store, waiting at most `timeout_s` (a
    `SetupRendezvous` of its own). Raises `CommTimeoutError` naming the ranks whose strings did not arrive,
    `CommError` naming a rank that failed or exited, or if the store is lost (its host exited)."""
    return SetupRendezvous(group, timeout_s, phase).exchange(value)


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
