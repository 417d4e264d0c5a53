"""Who the peers of a multi-host group are, and which of them are gone: the rendezvous store's calls bounded by a
deadline, each rank's host, and a heartbeat per rank.

Across machines a peer can vanish without a word: its host SIGKILLed (its sockets reset) or cut off the network
(nothing arrives; a store call to an unreachable host blocks for as long as TCP retries, minutes). So every store
call runs on a daemon thread of its own and the caller waits for it at most a deadline (`BoundedStore`); a store
that missed one is treated as unreachable from then on. The same thread bumps this rank's heartbeat counter in the
store every `HEARTBEAT_S`; a rank whose counter stands still over two periods is lost (`PeerTable.lost_ranks`).
Errors then name the lost ranks, their host and the address gloo reported, rather than an address alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import re
import socket
import struct
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch.distributed as dist

HEARTBEAT_S = 0.5  # a rank's heartbeat period; lost = no beat over 2.5 periods


class StoreUnreachable(RuntimeError):
    """A rendezvous-store call did not finish within its deadline (the store's host is gone or unreachable)."""


class BoundedStore:
    """The calls of `store`, each bounded by a deadline (see the module docstring), and this rank's heartbeat."""

    def __init__(self, store: dist.Store, heartbeat_key: str, name: str) -> None:
        self._store = store
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._unreachable: str | None = None
        self._heartbeat_key = heartbeat_key
        self._closed = threading.Event()
        # A daemon: a call stuck on an unreachable host must not keep the process from exiting.
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        next_beat = 0.0
        while not self._closed.is_set():
            now = time.monotonic()
            if now >= next_beat:
                with contextlib.suppress(Exception):  # a lost store: the peers see the beats stop
                    self._store.add(self._heartbeat_key, 1)
                next_beat = time.monotonic() + HEARTBEAT_S
            try:
                item = self._calls.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                continue
            if item is None:
                return
            future, method, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(getattr(self._store, method)(*args))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                future.set_exception(error)

    def call(self, timeout_s: float, method: str, *args):
        """`store.<method>(*args)`, waited for at most `timeout_s`; raises StoreUnreachable past it (and for every
        later call: the store thread may still be stuck in that one)."""
        if self._unreachable is not None:
            raise StoreUnreachable(self._unreachable)
        future: Future = Future()
        self._calls.put((future, method, args))
        try:
            return future.result(timeout=max(0.01, timeout_s))
        except FutureTimeout:
            future.cancel()
            self._unreachable = f"the rendezvous store did not answer a {method} within {timeout_s:.1f} s"
            raise StoreUnreachable(self._unreachable) from None

    def close(self) -> None:
        self._closed.set()
        self._calls.put(None)


def local_addresses() -> list[str]:
    """This host's IPv4 addresses that peers may see: its hostname's and GLOO_SOCKET_IFNAME's interface's."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.append(info[4][0])
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
            found.append(socket.inet_ntoa(packed[20:24]))
    return sorted(set(found))


class PeerTable:
    """Every rank's host (name and addresses), gathered once over `group` at set-up (collective)."""

    def __init__(self, group: dist.ProcessGroup, store: BoundedStore, heartbeat_prefix: str) -> None:
        mine = (socket.gethostname(), local_addresses())
        everyone: list = [None] * group.size()
        dist.all_gather_object(everyone, mine, group=group)
        self.hostnames = [name for name, _ in everyone]
        self.addresses = [addresses for _, addresses in everyone]
        self.rank = group.rank()
        self._store = store
        self._prefix = heartbeat_prefix

    @property
    def multi_host(self) -> bool:
        return len(set(self.hostnames)) > 1

    def describe(self, ranks: list[int]) -> str:
        """'rank(s) 2, 3 on host host1 (10.77.0.2)', one clause per host."""
        by_host: dict[str, list[int]] = {}
        for r in ranks:
            by_host.setdefault(self.hostnames[r], []).append(r)
        parts = []
        for host, host_ranks in by_host.items():
            addresses = ", ".join(self.addresses[host_ranks[0]])
            noun = "rank" if len(host_ranks) == 1 else "ranks"
            parts.append(
                f"{noun} {', '.join(map(str, host_ranks))} on host {host}" + (f" ({addresses})" if addresses else "")
            )
        return "; ".join(parts)

    def ranks_at(self, address: str) -> list[int]:
        return [r for r, addresses in enumerate(self.addresses) if address in addresses]

    def lost_ranks(self, timeout_s: float) -> list[int] | None:
        """The ranks whose heartbeat stood still over 2.5 periods (None: the store itself is unreachable)."""
        keys = [f"{self._prefix}/{r}" for r in range(len(self.hostnames))]
        deadline = time.monotonic() + timeout_s

        def beats() -> list[int]:
            return [int(self._store.call(deadline - time.monotonic(), "add", key, 0)) for key in keys]

        try:
            first = beats()
            time.sleep(2.5 * HEARTBEAT_S)
            second = beats()
        except (StoreUnreachable, RuntimeError):
            return None
        return [r for r in range(len(keys)) if r != self.rank and second[r] == first[r]]

    def explain(self, error_text: str, timeout_s: float) -> str:
        """What this rank can say about the peers it lost, for an error message ('' when nothing is known)."""
        clauses = []
        lost = self.lost_ranks(timeout_s)
        if lost:
            clauses.append(f"lost {self.describe(lost)} (no heartbeat in the rendezvous store)")
        elif lost is None:
            others = [r for r in range(len(self.hostnames)) if self.hostnames[r] != self.hostnames[self.rank]]
            store_host = os.environ.get("MASTER_ADDR", "")
            clauses.append(
                f"the rendezvous store{f' at {store_host}' if store_host else ''} is unreachable from host "
                f"{self.hostnames[self.rank]}: this host is cut off from the others"
                + (f" ({self.describe(others)})" if others else "")
            )
        for address in sorted(set(re.findall(r"\[([0-9.]+)\]:\d+", error_text))):
            ranks = self.ranks_at(address)
            if ranks and not (lost and set(ranks) <= set(lost)):
                clauses.append(f"the connection to {self.describe(ranks)} broke")
        return "; ".join(clauses)


class GroupWatch:
    """The hosts and heartbeats of a whole group, for code outside the engines whose own collectives (a trainer's
    gradient all-reduce over gloo) fail naming an address at best: `explain(error)` names the lost ranks and their
    hosts instead. Collective to create (one all-gather over `group`); `close` ends its heartbeat thread."""

    _created = 0  # per process: every rank creates its watches in the same order, so the keys agree

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0) -> None:
        group = dist.group.WORLD if group is None else group
        GroupWatch._created += 1
        prefix = f"mtdeepep/watch/{GroupWatch._created}"
        self.timeout_s = timeout_s
        self._store = BoundedStore(dist.distributed_c10d._get_default_store(), f"{prefix}/{group.rank()}",
                                   f"mtdeepep-watch-{group.rank()}")  # fmt: skip
        self.peers = PeerTable(group, self._store, prefix)

    def explain(self, error: BaseException) -> str:
        """The lost ranks and their hosts (or this host's isolation) behind `error`; '' on one host or when every
        peer is alive."""
        if not self.peers.multi_host:
            return ""
        return self.peers.explain(str(error), self.timeout_s)

    def close(self) -> None:
        self._store.close()
