"""Set-up helpers shared by every engine: a bounded all-gather of set-up strings, group identity, node grouping.

The set-up exchange goes through the rendezvous store of the default process group (a TCPStore on torchrun and
tcp:// / env:// initialisation), not through a collective of the group: every rank publishes its string under a key
of its own and polls for the others' with a deadline of `timeout_s`, so every rank (not only rank 0) gives up in time
and names the ranks whose strings never arrived. A collective would leave the other ranks blocked in the backend
with its own (long) timeout and report no rank.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import secrets
import socket
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .. import _C

# Per group (by its ranks), how many exchanges this process started: the ranks of a group create their buffers in the
# same order, so the n-th exchange of every rank meets under the same keys.
_GENERATIONS: defaultdict[str, int] = defaultdict(int)
# Per group, the incarnation of the group this process belongs to, once known: a random id that group rank 0 (the
# leader) draws at its first set-up of the group and hands to every other rank (see `SetupRendezvous`). The set-up
# exchange's keys live under it, so a job restarted in the same store (same group, same generations) never reads
# the entries a killed job left; records carry it, so a record of another incarnation is known to be stale.
_INCARNATIONS: dict[str, str] = {}
# Per group, on a non-leader before it learns the incarnation: the nonce it asks the leader to echo with it.
_JOIN_NONCES: dict[str, str] = {}
# Per group, on the leader: the join nonce of each rank it welcomed last, and the ranks known to hold the
# incarnation (their set-up strings arrived under it: no join of theirs is read again).
_WELCOMED: defaultdict[str, dict[int, str]] = defaultdict(dict)
_SETTLED: defaultdict[str, set[int]] = defaultdict(set)
_UNKNOWN = "-"  # the incarnation of a record written before its writer learnt it
_POLL_S = 0.002
_WATCH_S = 0.2  # how often a waiting rank looks for a missing rank's published failure, or its death
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# A record of this host written this long before this process started is from an earlier job (see `_stale`): the
# margin covers /proc's start time, counted in clock ticks.
_STALE_MARGIN_S = 0.05


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of `group`, in group order."""
    return tuple(dist.get_process_group_ranks(group))


def group_key(group: dist.ProcessGroup) -> tuple[tuple[int, ...], int]:
    """What identifies a group for handles: its global ranks and this process's rank in it."""
    return group_ranks(group), group.rank()


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def setup_prefix(ranks: tuple[int, ...]) -> str:
    """Where the set-up records of the group of these global ranks live in the store."""
    return f"mtdeepep/setup/{hashlib.blake2b(','.join(map(str, ranks)).encode(), digest_size=8).hexdigest()}"


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat, field 22), or None if there is no such
    process. With the pid it names one process: a pid the kernel reuses gets another start time."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            line = stat.read()
    except OSError:
        return None
    return int(line[line.rfind(")") + 2 :].split()[19])


def _since_boot_s() -> float:
    """Now, on the clock /proc's start times count on (seconds since boot, suspend included)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process `pid` of this host still runs (a killed child its parent has not reaped yet is a zombie: not
    alive); the same test as the C++ peer group's. With `start_ticks` (see `_start_ticks`), a process that reuses
    the pid of an exited one is not taken for it."""
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
    fields = line[line.rfind(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and (start_ticks is None or int(fields[19]) == start_ticks)


@functools.cache
def _process_start_s(pid: int) -> float:
    """When process `pid` started, in seconds since boot (this process's: by pid, so that a forked child has its
    own)."""
    return _start_ticks(pid) / _CLOCK_TICKS


@dataclass(frozen=True)
class LiveRecord:
    """What a rank publishes about itself for a group at each of its set-ups (`mtdeepep/setup/<group>/live/<rank>`),
    kept between set-ups, so that its peers can tell that it exited whichever set-up they are in: its host, pid and
    the pid's start time (`_start_ticks`), when it wrote the record (seconds since boot) and the group's set-up it
    was building then (its generation, from 1), and the group's incarnation it belongs to (`_UNKNOWN` before
    its writer learnt it, in its first set-up of the group)."""

    host: str
    pid: int
    start_ticks: int
    written_s: float
    generation: int
    incarnation: str = _UNKNOWN

    def encode(self) -> str:
        return f"{self.host} {self.pid} {self.start_ticks} {self.written_s!r} {self.generation} {self.incarnation}"

    @classmethod
    def decode(cls, text: str) -> LiveRecord:
        host, pid, start_ticks, written_s, generation, incarnation = text.rsplit(" ", 5)
        return cls(host, int(pid), int(start_ticks), float(written_s), int(generation), incarnation)

    def stale(self, host: str, incarnation: str) -> bool:
        """Whether this record was left by a process of an earlier job in the same store: one of another
        incarnation of the group than `incarnation` (this process's, when both are known: on any host), or else
        one written on this host before this process started, by a process that is gone. No rank of this job can
        have written it then (a peer sets up buffers only once every rank joined the process group, this one
        included)."""
        if _UNKNOWN not in (self.incarnation, incarnation):
            return self.incarnation != incarnation
        return (
            self.host == host
            and self.written_s < _process_start_s(os.getpid()) - _STALE_MARGIN_S
            and not process_alive(self.pid, self.start_ticks)
        )

    def gone(self, host: str) -> bool:
        """Whether the process of this record runs on `host` (this one: pids of other hosts cannot be checked) and
        has exited."""
        return self.host == host and not process_alive(self.pid, self.start_ticks)


class SetupRendezvous:
    """One buffer set-up of a group, through the rendezvous store (see the module docstring).

    Created first thing by every rank of the set-up, whatever happens after: it takes the group's next set-up number
    (its generation: so a rank whose set-up fails early stays in step with its peers for the next buffer of the
    group) and publishes this rank's `LiveRecord` for the group (host, pid, generation). The record outlives the
    set-up: a peer killed between two set-ups (after its destroy(), before its next Buffer) published nothing for
    the next one, and its record of the last one is what names it. Then:

    - `exchange(value)` all-gathers the set-up strings with a deadline. While it waits it watches the ranks that have
      not arrived: one that published a failure is named with its reason at once ("rank 0 failed its set-up: ..."),
      one of this host whose process is gone is named with its pid and host at once, one already building a later
      buffer of the group (the ranks' generations diverged: a rank skipped a buffer) is named with both generations
      at once; the others, at the deadline.
    - `fail(error)` publishes this rank's failure, so that its peers report it instead of a timeout or a symptom
      (a segment that no longer exists).
    - `peer_failure(grace_s)`: a failure a peer published (waiting up to `grace_s` for one), for the message of an
      error this rank met after the exchange.

    A job restarted in the same store (same group, same generations) never reads the set-up strings of the killed
    one: they live under the group's incarnation (`_INCARNATIONS`, handed out in the first exchange). Records of
    the killed job (its live records, its failures) are cleared by the first rank that reads them
    (`LiveRecord.stale`: of another incarnation, on any host; or, for a record written before its writer learnt
    the incarnation, of an exited process of this host older than this one), so a restarted job never reports
    them.
    """

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, phase: str) -> None:
        self.ranks = group_ranks(group)
        self.group_prefix = setup_prefix(self.ranks)
        _GENERATIONS[self.group_prefix] += 1
        self.generation = _GENERATIONS[self.group_prefix]
        self.rank, self.timeout_s, self.phase = group.rank(), timeout_s, phase
        self.host = socket.gethostname()
        self._store = _store()
        if self.rank == 0 and self.group_prefix not in _INCARNATIONS:
            _INCARNATIONS[self.group_prefix] = secrets.token_hex(8)
        self._publish_live()
        if self.group_prefix not in _INCARNATIONS and self.group_prefix not in _JOIN_NONCES:
            nonce = _JOIN_NONCES[self.group_prefix] = secrets.token_hex(8)
            self._guard(lambda: self._store.set(f"{self.group_prefix}/join/{self.rank}", nonce))

    @property
    def incarnation(self) -> str:
        """The group's incarnation, as far as this process knows it (`_UNKNOWN` before the leader welcomed it)."""
        return _INCARNATIONS.get(self.group_prefix, _UNKNOWN)

    def _record(self) -> LiveRecord:
        pid = os.getpid()
        return LiveRecord(self.host, pid, _start_ticks(pid), _since_boot_s(), self.generation, self.incarnation)

    def _publish_live(self) -> None:
        record = self._record()
        self._guard(lambda: self._store.set(self._live_key(self.rank), record.encode()))

    def _exchange_key(self, kind: str, rank: int | None = None) -> str:
        """A key of this set-up's exchange: under the group's incarnation, which a restarted job never shares."""
        return f"{self.group_prefix}/{self.incarnation}/{self.generation}/{kind}" + ("" if rank is None else f"/{rank}")

    def _live_key(self, rank: int) -> str:
        return f"{self.group_prefix}/live/{rank}"

    def _guard(self, call):
        """Runs a store call; a lost store (its host, usually global rank 0, exited) is a CommError naming it."""
        try:
            return call()
        except (RuntimeError, dist.DistError) as error:
            raise _C.CommError(
                f"mtdeepep: rank {self.rank} lost the rendezvous store in {self.phase} (its host, usually global rank "
                f"0, may have exited): {error}"
            ) from error

    def _read(self, key: str) -> str | None:
        """The text under `key`, or None when there is none or it is cleared (empty)."""
        if not self._guard(lambda: self._store.check([key])):
            return None
        return self._guard(lambda: self._store.get(key)).decode() or None

    def _clear_if_stale(self, key: str, text: str, writer: LiveRecord) -> bool:
        """Clears `key` (atomically, only if it still holds `text`) when its writer's record is stale."""
        if not writer.stale(self.host, self.incarnation):
            return False
        self._guard(lambda: self._store.compare_set(key, text, ""))
        return True

    def _live(self, rank: int) -> LiveRecord | None:
        """`rank`'s live record for this group, or None (not published yet, or a stale one, then cleared)."""
        key = self._live_key(rank)
        text = self._read(key)
        if text is None:
            return None
        record = LiveRecord.decode(text)
        return None if self._clear_if_stale(key, text, record) else record

    def exchange(self, value: str) -> list[str]:
        """Every rank's string (this rank's is `value`), by group rank; CommTimeoutError naming the ranks whose
        strings did not arrive in time, CommError naming a rank that failed, exited, or builds another buffer of the
        group. The set-up's keys are removed once every rank has read them (the live records stay).

        In its first exchange of the group, a rank other than the leader (group rank 0) first learns the group's
        incarnation: it published a fresh nonce at `join/<rank>` and waits until the leader echoes that nonce with
        the incarnation at `welcome/<rank>` (the leader echoes every missing rank's join while it waits): an echo or
        an incarnation a killed job left in the store never carries this process's nonce."""
        deadline = time.monotonic() + self.timeout_s
        if self.incarnation == _UNKNOWN:
            self._wait(deadline, [0], self._welcomed)
            self._publish_live()  # now with the incarnation: peers can tell it from a killed job's record
        keys = [self._exchange_key("value", r) for r in range(len(self.ranks))]
        self._guard(lambda: self._store.set(keys[self.rank], value))
        self._wait(deadline, list(range(len(self.ranks))), lambda r: self._guard(lambda: self._store.check([keys[r]])))
        values = [self._guard(lambda k=k: self._store.get(k)).decode() for k in keys]
        _SETTLED[self.group_prefix].update(range(len(self.ranks)))
        # The last rank to have read everything removes the set-up's keys.
        read = self._exchange_key("read")
        if self._guard(lambda: self._store.add(read, 1)) == len(self.ranks):
            for key in (*keys, read):
                self._guard(lambda key=key: self._store.delete_key(key))
        return values

    def _wait(self, deadline: float, missing: list[int], arrived) -> None:
        """Polls until `arrived(r)` for every rank of `missing`, watching the missing ones (`_stop_for`), welcoming
        their joins if this rank leads the group, and raising at `deadline`."""
        next_watch = 0.0
        while True:
            missing = [r for r in missing if not arrived(r)]
            if not missing:
                return
            if self.rank == 0:
                self._welcome(missing)
            now = time.monotonic()
            if now >= next_watch:  # the missing ranks' failures, liveness and generations, a few times a second
                self._stop_for(missing)
                next_watch = now + _WATCH_S
            if now > deadline:
                raise _C.CommTimeoutError(
                    f"mtdeepep: rank {self.rank} timed out after {self.timeout_s} s in {self.phase}: group rank(s) "
                    f"{missing} (global {[self.ranks[r] for r in missing]}) did not arrive (they did not create the "
                    "buffer, failed before it, or exited)"
                )
            time.sleep(_POLL_S)

    def _welcomed(self, leader: int) -> bool:
        """Whether the leader echoed this process's join nonce with the incarnation (then known)."""
        nonce = _JOIN_NONCES[self.group_prefix]
        echo = self._read(f"{self.group_prefix}/welcome/{self.rank}")
        if echo is None or not echo.startswith(f"{nonce} "):
            return False
        _INCARNATIONS[self.group_prefix] = echo.removeprefix(f"{nonce} ")
        del _JOIN_NONCES[self.group_prefix]
        return True

    def _welcome(self, missing: list[int]) -> None:
        """The leader: echoes the join nonce of each missing rank with the incarnation (a join a killed job left is
        echoed too, harmlessly: the restarted rank's own nonce replaces it, and is echoed in turn)."""
        welcomed, settled = _WELCOMED[self.group_prefix], _SETTLED[self.group_prefix]
        for r in missing:
            if r in settled:
                continue
            nonce = self._read(f"{self.group_prefix}/join/{r}")
            if nonce is not None and welcomed.get(r) != nonce:
                echo = f"{nonce} {self.incarnation}"
                self._guard(lambda r=r, echo=echo: self._store.set(f"{self.group_prefix}/welcome/{r}", echo))
                welcomed[r] = nonce

    def _stop_for(self, missing: list[int]) -> None:
        """Raises for the first of `missing` that builds a later buffer of the group than this rank (the ranks'
        generations diverged), published a failure, or whose process is gone."""
        records = {r: self._live(r) for r in missing}
        for r, record in records.items():
            message = self._failure_of(r, record, missing=True)
            if message is not None:
                raise _C.CommError(message)
        for r, record in records.items():
            if record is not None and record.gone(self.host):
                raise _C.CommError(self._exited_message(r, record, "without arriving"))

    def _failure_of(self, rank: int, record: LiveRecord | None, missing: bool) -> str | None:
        """The message for `rank` (its live record `record`) when it published a failure of this set-up or, while
        `missing` from this set-up's exchange, builds a later buffer of the group than this rank; else None."""
        reason = self._published_failure(rank)
        ahead = record is not None and record.generation > self.generation
        # A peer that timed out in this set-up and went on to its next buffer gave up on this one before this rank
        # arrived: its timeout is old news, the divergence is the problem. A peer missing here that moved on without
        # a failure skipped this buffer. (A peer that failed here for another reason, or completed the exchange, may
        # legitimately be at its next buffer already.)
        gave_up = reason is not None and reason.startswith(f"{_C.CommTimeoutError.__name__}:")
        if ahead and (gave_up or (missing and reason is None)):
            return self._diverged_message(rank, record, reason)
        return None if reason is None else self._failed_message(rank, reason)

    def _diverged_message(self, rank: int, record: LiveRecord, earlier: str | None) -> str:
        """Rank `rank` already builds buffer #`record.generation` of the group, this rank #`self.generation`: it
        will never arrive at this one."""
        message = (
            f"mtdeepep: rank {self.rank} stopped in {self.phase}: the ranks are at different buffer generations of "
            f"this group: this rank is building the group's buffer #{self.generation}, group rank {rank} (global "
            f"{self.ranks[rank]}, pid {record.pid}, host {record.host}) is building #{record.generation} (a rank "
            "created fewer buffers of the group than its peers, e.g. it skipped one, or came to one after its peers "
            "had given up on it; every rank must create the group's buffers in the same order)"
        )
        current = self._published_failure(rank, record.generation)
        if current is not None:
            message += f"; its set-up of #{record.generation} failed: {current}"
        if earlier is not None:
            message += f"; it had given up on #{self.generation}: {earlier}"
        return message

    def _published_failure(self, rank: int, generation: int | None = None) -> str | None:
        """The failure `rank` published for this set-up (or for its set-up #`generation` of the group), or None."""
        key = f"{self.group_prefix}/{generation or self.generation}/failed/{rank}"
        text = self._read(key)
        if text is None:
            return None
        writer, _, reason = text.partition("\n")
        return None if self._clear_if_stale(key, text, LiveRecord.decode(writer)) else reason

    def _failed_message(self, rank: int, reason: str) -> str:
        return (f"mtdeepep: rank {self.rank} stopped in {self.phase}: group rank {rank} (global {self.ranks[rank]}) "
                f"failed its set-up: {reason}")  # fmt: skip

    def fail(self, error: BaseException) -> None:
        """Publishes this rank's failure for its peers (best effort: the store may be gone), with this process's
        record (so that a job restarted in the same store can tell it is not its own)."""
        writer = self._record()
        key = f"{self.group_prefix}/{self.generation}/failed/{self.rank}"
        with contextlib.suppress(Exception):  # the original error is what the caller raises
            self._store.set(key, f"{writer.encode()}\n{type(error).__name__}: {error}")

    def peer_failure(self, grace_s: float) -> str | None:
        """The message naming the first peer that published a failure (or builds a later buffer of the group),
        waiting up to `grace_s` for one, or at once the first peer of this host whose process is gone (a dead process
        publishes nothing), with its pid and host; None if neither."""
        deadline = time.monotonic() + grace_s
        peers = [r for r in range(len(self.ranks)) if r != self.rank]
        while True:
            records = {r: self._live(r) for r in peers}
            for r, record in records.items():
                message = self._failure_of(r, record, missing=False)
                if message is not None:
                    return message
            for r, record in records.items():
                if record is not None and record.gone(self.host):
                    return self._exited_message(r, record, "during the set-up")
            if time.monotonic() >= deadline:
                return None
            time.sleep(_WATCH_S / 4)

    def _exited_message(self, rank: int, record: LiveRecord, when: str) -> str:
        return (
            f"mtdeepep: rank {self.rank} stopped in {self.phase}: group rank {rank} (global {self.ranks[rank]}, pid "
            f"{record.pid}, host {record.host}) exited {when} (at the group's buffer set-up #{record.generation}; "
            f"this rank is at #{self.generation})"
        )


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
