"""Bounded waits, flag signals and the status word: the only place a kernel of `mtdeepep.kernels` may spin.

Protocol (the CUDA executor's, csrc/kernels/cuda/device.cuh, in Triton):

- A flag is an int64 that only grows (an operation number). A writer publishes its data, then `signal_flag` (an
  atomic exchange with release order at system scope); a reader `wait_flag_geq` (atomic loads with acquire order at
  system scope) until the flag reaches the operation's number, then reads the data.
- Every wait is bounded. When it runs out it records `(kind, phase, peer, rank)` in this rank's status word (the
  first failure wins: a compare-and-swap, or a ticket where the backend has none, see `HAS_ATOMIC_CAS`) and poisons
  every other rank except the one it waited for (that one is probably dead; its memory is not written): their
  waits end at once and record `kPeerFailed` with this rank's word as the cause, so every rank's error names the
  rank that did not arrive and the phase. A wait also ends when this
  rank's status is already set (an earlier wait of the same call failed) or its poison word is set (a peer failed,
  or the host interrupted this rank).
- The host reads the status word after the call (`StatusWord.check`) and raises `CommTimeoutError` or `CommError`.

The bound (`WaitBound`): the interpreter has no clock, so on the CPU the bound counts spins, calibrated once per
process from the measured cost of one spin (`timeout_s / seconds_per_spin`; a machine that slows down later makes the
wait last longer, never shorter, than asked for). On a GPU the constexpr `CLOCK` selects a real clock instead:
`%globaltimer` in nanoseconds on CUDA (`CLOCK_CUDA_NS`), `s_memrealtime` at 100 MHz on ROCm (`CLOCK_HIP_100MHZ`).
MUSA has neither in Triton: it counts spins with a fixed conservative rate (`MUSA_SPINS_PER_SECOND`).

Layout of a status word: `[code, cause, tickets]` int64. `code` is kind (bits 56..63), phase (48..55), peer + 1
(24..47), rank + 1 (0..23), as `encode_error` in csrc/kernels/cuda/api.hpp; never 0 for an error. `tickets` counts
the reports of the CAS-free form. On a GPU the word lives in pinned host memory mapped into the device (`StatusWord`):
the host reads it without a copy queued behind a stuck kernel; its atomics come from this rank's device alone, which
mapped memory keeps atomic (only host-side or other-device atomics on it would not be).

Backends without `atomic_cas` (FlagTree's `mthreads`, MUSA: no `AtomicCASOp` lowering): `HAS_ATOMIC_CAS` is false
there (chosen at import from torch's device report) and the first failure is claimed with a ticket instead
(`atomic_add` on `tickets`: the caller that draws 0 publishes its code with a release `atomic_xchg`); a poison word
takes `atomic_max` of the codes (any failure suffices there: every code names a real failure).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as _cuda_extra
from triton.language.extra import hip as _hip_extra

from .. import _C

# ---- kinds and phases (the values of csrc/kernels/cuda/api.hpp's ErrorKind / Phase) ----
KIND_TIMEOUT = 1
KIND_PEER_FAILED = 2
KIND_ABORTED = 3

PHASE_NOTIFY = 1
PHASE_BARRIER = 2
PHASE_DISPATCH_RECEIVE = 3
PHASE_COMBINE_RECEIVE = 4
PHASE_LOW_LATENCY_ENTER = 5
PHASE_LOW_LATENCY_DISPATCH_RECEIVE = 6
PHASE_LOW_LATENCY_COMBINE_RECEIVE = 7

PHASE_NAMES = {
    PHASE_NOTIFY: "dispatch: counts exchanged (notify)",
    PHASE_BARRIER: "every rank entered the operation (barrier)",
    PHASE_DISPATCH_RECEIVE: "dispatch: rows received",
    PHASE_COMBINE_RECEIVE: "combine: rows received",
    PHASE_LOW_LATENCY_ENTER: "low-latency: peer entered the call",
    PHASE_LOW_LATENCY_DISPATCH_RECEIVE: "low-latency dispatch: rows received",
    PHASE_LOW_LATENCY_COMBINE_RECEIVE: "low-latency combine: rows received",
}

# ---- clocks (the constexpr CLOCK of every waiting kernel) ----
CLOCK_SPINS = 0  # the interpreter, MUSA: the bound counts spins
CLOCK_CUDA_NS = 1  # %globaltimer, nanoseconds
CLOCK_HIP_100MHZ = 2  # s_memrealtime, 100 MHz on CDNA
MUSA_SPINS_PER_SECOND = 20_000_000  # no clock in FlagTree's mthreads backend: a fixed, generous spin rate

STATUS_WORDS = 3  # [code, cause, tickets]


def musa_reported() -> bool:
    """Whether torch reports a MUSA device (torch_musa imported and a device present): FlagTree's `mthreads` backend
    compiles the kernels there."""
    musa = getattr(torch, "musa", None)
    return musa is not None and bool(musa.is_available())


# Whether the backend lowers `tl.atomic_cas` (see the module docstring). A constexpr: the kernels' choice is made at
# compile time, and the interpreter and the AOT check compile both forms (`report_kernel`).
HAS_ATOMIC_CAS = tl.constexpr(not musa_reported())


def encode_error(kind: int, phase: int, peer: int, rank: int) -> int:
    """The status code of (kind, phase, peer, rank): the kernels' `_encode`, as a Python int (an int64's bits)."""
    code = (kind << 56) | (phase << 48) | (((peer + 1) & 0xFFFFFF) << 24) | ((rank + 1) & 0xFFFFFF)
    return code - (1 << 64) if code >= 1 << 63 else code


def decode_error(code: int) -> tuple[int, int, int, int]:
    """`(kind, phase, peer, rank)` of a status code (the int64 read back from the device)."""
    bits = code & ((1 << 64) - 1)
    return bits >> 56, (bits >> 48) & 0xFF, ((bits >> 24) & 0xFFFFFF) - 1, (bits & 0xFFFFFF) - 1


def _own_failure(code: int) -> str:
    kind, phase, peer, rank = decode_error(code)
    phase_name = PHASE_NAMES.get(phase, "unknown phase")
    if kind == KIND_TIMEOUT:
        # The CPU executor's wording of the missing ranks ("rank(s) [1] did not arrive"), which tools parse.
        return f"rank {rank} timed out waiting for rank {peer} in phase '{phase_name}': rank(s) [{peer}] did not arrive"
    if kind == KIND_ABORTED:
        return f"rank {rank} was interrupted in phase '{phase_name}'"
    return f"rank {rank} failed with status {code:#x}"


def error_message(code: int, cause: int = 0, operation: str = "") -> str:
    """The sentence of a status word: who failed, waiting for whom, in which phase (of `operation`, e.g. 'combine',
    when given). A rank stopped by a peer's failure (`kPeerFailed`) names that peer's own failure (`cause`): the rank
    that did not arrive."""
    kind, phase, peer, rank = decode_error(code)
    prefix = f"mtdeepep: {operation}: " if operation else "mtdeepep: "
    if kind == KIND_PEER_FAILED:
        head = f"{prefix}rank {rank} stopped in phase '{PHASE_NAMES.get(phase, 'unknown phase')}' because "
        return head + (_own_failure(cause) if cause != 0 else f"rank {peer} failed")
    return prefix + _own_failure(code)


def status_error(code: int, cause: int = 0, operation: str = "") -> Exception | None:
    """The exception of a status word (None for 0): `CommTimeoutError` for a timeout, this rank's or the one that
    stopped it; `CommError` otherwise."""
    if code == 0:
        return None
    kind = decode_error(code)[0]
    timed_out = kind == KIND_TIMEOUT or (
        kind == KIND_PEER_FAILED and cause != 0 and decode_error(cause)[0] == KIND_TIMEOUT
    )
    return (_C.CommTimeoutError if timed_out else _C.CommError)(error_message(code, cause, operation))


class _MappedHostMemory:
    """Pinned host memory as `__cuda_array_interface__` (its device address is its host address under unified
    addressing), so that `torch.as_tensor` gives a device tensor over it; it keeps the pinned tensor alive."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape), "typestr": "<i8", "data": (host.data_ptr(), False), "version": 3,
            "strides": None,
        }  # fmt: skip


def _device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (pinned int64) as a tensor of `device`, for the kernels' pointer arguments; where torch cannot view it so
    (no `__cuda_array_interface__` for the device type), the pinned tensor itself (Triton takes its address)."""
    try:
        return torch.as_tensor(_MappedHostMemory(host), device=device)
    except (RuntimeError, TypeError, ValueError):
        return host


class StatusWord:
    """This rank's `[code, cause, tickets]` int64 status word (see the module docstring). The kernels write it; the
    host reads it after the call. The first failure sticks: the executor is unusable afterwards (as the CUDA
    executor after a device-side failure).

    On a GPU the words are pinned host memory mapped into the device (the kernels take the tensor as a pointer: a
    pinned tensor's address is its device address under unified addressing), so `read()` never queues behind a
    stuck kernel; `check()` first waits for the device's current stream (the kernels that may write it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # `host`: the words as the host reads them; `words`: what the kernels take (on a GPU the same memory, seen as
        # a device tensor through its mapped address).
        self.host = torch.zeros(STATUS_WORDS, dtype=torch.int64, pin_memory=device.type != "cpu")
        self.words = self.host if device.type == "cpu" else _device_alias(self.host, device)
        self._failed: Exception | None = None

    def read(self) -> tuple[int, int]:
        """`(code, cause)` as the device last wrote them (no synchronisation)."""
        code, cause, _ = self.host.tolist()
        return code, cause

    def clear(self) -> None:
        """Clears the word (after every kernel that might write it finished)."""
        self.host.zero_()

    def check(self, operation: str = "") -> None:
        """Raises the recorded failure, if any (on a GPU after the current stream's kernels finished); `operation`
        (e.g. 'combine') goes into the message."""
        if self._failed is not None:
            raise self._failed
        if self.device.type != "cpu":
            getattr(torch, self.device.type).current_stream(self.device).synchronize()
        code, cause = self.read()
        error = status_error(code, cause, operation)
        if error is not None:
            self._failed = error
            raise error

    def fail(self, error: Exception) -> None:
        """Records a failure found on the host (an interrupt): every later `check` raises it."""
        if self._failed is None:
            self._failed = error


# ---- device side ----


@triton.jit
def _encode(kind, phase, peer, rank):
    """The status code of (kind, phase, peer, rank) as an int64 (see `encode_error`)."""
    return (
        (tl.cast(kind, tl.int64) << 56)
        | (tl.cast(phase, tl.int64) << 48)
        | ((tl.cast(peer + 1, tl.int64) & 0xFFFFFF) << 24)
        | (tl.cast(rank + 1, tl.int64) & 0xFFFFFF)
    )


@triton.jit
def _now(CLOCK: tl.constexpr):
    if CLOCK == 1:
        t = _cuda_extra.globaltimer().to(tl.int64)
    elif CLOCK == 2:
        t = _hip_extra.memrealtime().to(tl.int64)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def peer_pointer(table, peer, offset, DTYPE: tl.constexpr):
    """A pointer to `DTYPE` at byte `offset` of rank `peer`'s region (`table`: int64 [R], every rank's base address
    as mapped here). `peer` and `offset` may be scalars or blocks."""
    return (tl.load(table + peer) + offset).to(tl.pointer_type(DTYPE))


@triton.jit
def signal_flag(flag_ptr, value):
    """Publishes `value` in a flag: every write of this program before it is visible (system scope) first."""
    tl.atomic_xchg(flag_ptr, tl.cast(value, tl.int64), sem="release", scope="sys")  # `value`: maybe a constexpr


@triton.jit
def claim_status(status_ptr, code, CAS: tl.constexpr):
    """Writes `code` into the status word at `status_ptr` if no failure is there yet; returns whether this call was
    the first. `CAS`: a compare-and-swap; otherwise a ticket on the word's third int64 (drawn 0: the first), then the
    code published with a release exchange."""
    if CAS:
        previous = tl.atomic_cas(status_ptr, tl.full([], 0, tl.int64), code, sem="acq_rel", scope="sys")
        first = previous == 0
    else:
        ticket = tl.atomic_add(status_ptr + 2, tl.full([], 1, tl.int64), sem="acq_rel", scope="sys")
        first = ticket == 0
        if first:
            tl.atomic_xchg(status_ptr, code, sem="release", scope="sys")
    return first


@triton.jit
def poison_word(poison_ptr, code, CAS: tl.constexpr):
    """Puts a failure `code` into a poison word (release, system scope): with `CAS` only when none is there (the first
    wins); otherwise the largest code wins (`atomic_max`; codes are positive int64, every one a real failure)."""
    if CAS:
        tl.atomic_cas(poison_ptr, tl.full([], 0, tl.int64), code, sem="release", scope="sys")
    else:
        tl.atomic_max(poison_ptr, code, sem="release", scope="sys")


@triton.jit
def report_error(status_ptr, poison_table, code, suspect, rank, num_ranks):
    """Records `code` in this rank's status word if it is the first failure; a first timeout or abort poisons every
    other rank but `suspect` (the rank this one waited for: probably dead, its memory must not be written)."""
    first = claim_status(status_ptr, code, HAS_ATOMIC_CAS)
    kind = (code >> 56) & 0xFF
    if first & ((kind == 1) | (kind == 3)):
        for r in range(num_ranks):
            if (r != rank) & (r != suspect):
                poison_word(peer_pointer(poison_table, r, 0, tl.int64), code, HAS_ATOMIC_CAS)


@triton.jit
def wait_flag_geq(flag_ptr, target, bound, status_ptr, poison_table, phase, peer, rank, num_ranks,
                  CLOCK: tl.constexpr):  # fmt: skip
    """Waits until the int64 at `flag_ptr` is >= `target` (acquire, system scope); returns whether it got there.

    Gives up when `bound` runs out (spins with `CLOCK == 0`, clock ticks otherwise; see `WaitBound`), recording
    (timeout, `phase`, `peer`, `rank`) in `status_ptr` and poisoning the other ranks; ends early, without waiting
    out the bound, when this rank's status is already set or its poison word (`poison_table[rank]`, which peers and
    the host write) is. `peer`: the rank whose flag this is.
    """
    value = tl.atomic_add(flag_ptr, tl.full([], 0, tl.int64), sem="acquire", scope="sys")
    poison_ptr = tl.load(poison_table + rank).to(tl.pointer_type(tl.int64))
    start = _now(CLOCK)
    spins = tl.full([], 0, tl.int64)
    stopped = tl.full([], 0, tl.int32)
    while (value < target) & (stopped == 0):
        spins += 1
        if tl.load(status_ptr, volatile=True) != 0:
            stopped = 1  # an earlier wait of this rank failed: it already reported
        else:
            poison = tl.load(poison_ptr, volatile=True)
            if poison != 0:
                # A peer failed (or the host interrupted this rank): name it, with its own word as the cause.
                cause_kind = (poison >> 56) & 0xFF
                culprit = (poison & 0xFFFFFF) - 1
                if cause_kind == 3:
                    if culprit == rank:
                        report_error(status_ptr, poison_table, poison, -1, rank, num_ranks)
                    else:
                        tl.store(status_ptr + 1, poison)
                        report_error(status_ptr, poison_table, _encode(2, phase, culprit, rank), peer, rank, 0)
                else:
                    tl.store(status_ptr + 1, poison)
                    report_error(status_ptr, poison_table, _encode(2, phase, culprit, rank), peer, rank, 0)
                stopped = 1
            else:
                if CLOCK == 0:
                    elapsed = spins
                else:
                    elapsed = _now(CLOCK) - start
                if elapsed > bound:
                    report_error(status_ptr, poison_table, _encode(1, phase, peer, rank), peer, rank, num_ranks)
                    stopped = 1
                else:
                    value = tl.atomic_add(flag_ptr, tl.full([], 0, tl.int64), sem="acquire", scope="sys")
    return value >= target


@triton.jit
def exchange_kernel(region_table, poison_table, status_ptr, payload_ptr, out_ptr, mailbox_offset, flags_offset,
                    value, bound, phase, rank, num_ranks, n_words, SLOT_BYTES: tl.constexpr, BLOCK: tl.constexpr,
                    CLOCK: tl.constexpr, SEND: tl.constexpr = True, RECEIVE: tl.constexpr = True):  # fmt: skip
    """An all-to-all of small int32 payloads that doubles as a barrier (one program).

    Row j of `payload_ptr` (`[R, n_words]` int32) goes to rank j's mailbox, slot (this rank, `value % 2`); then this
    rank signals its flag `value` at every rank, waits for every rank's flag in its own region (phase `phase`), and
    copies rank i's row for it into row i of `out_ptr` (`[R, n_words]`). The mailbox alternates between two halves
    by `value`: a rank that starts the next exchange has seen every rank enter this one, so the half it writes was
    read by everyone; the one after next needs this exchange complete everywhere, which it is.
    `SEND` / `RECEIVE`: only the first or the second half (the interpreter's host waits in between, see
    `host_wait_flags`).
    """
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n_words
    half = (value % 2) * num_ranks * SLOT_BYTES
    if SEND:
        for j in range(num_ranks):
            row = tl.load(payload_ptr + j * n_words + offsets, mask=mask)
            slot = peer_pointer(region_table, j, mailbox_offset + half + rank * SLOT_BYTES, tl.int32)
            tl.store(slot + offsets, row, mask=mask)
            signal_flag(peer_pointer(region_table, j, flags_offset + rank * 8, tl.int64), value)
    if RECEIVE:
        ok = tl.full([], 1, tl.int1)
        for i in range(num_ranks):
            if ok:
                flag = peer_pointer(region_table, rank, flags_offset + i * 8, tl.int64)
                ok = wait_flag_geq(flag, value, bound, status_ptr, poison_table, phase, i, rank, num_ranks, CLOCK)
                if ok:
                    slot = peer_pointer(region_table, rank, mailbox_offset + half + i * SLOT_BYTES, tl.int32)
                    tl.store(out_ptr + i * n_words + offsets, tl.load(slot + offsets, mask=mask), mask=mask)


@triton.jit
def signal_all_kernel(region_table, flags_offset, value, rank, num_ranks):
    """Signals this rank's flag `value` at every rank (after the rows a previous launch wrote to them)."""
    for j in range(num_ranks):
        signal_flag(peer_pointer(region_table, j, flags_offset + rank * 8, tl.int64), value)


@triton.jit
def wait_all_kernel(region_table, poison_table, status_ptr, flags_offset, value, bound, phase, rank, num_ranks,
                    CLOCK: tl.constexpr):  # fmt: skip
    """Waits until every rank's flag in this rank's region reached `value` (one program)."""
    ok = tl.full([], 1, tl.int1)
    for i in range(num_ranks):
        if ok:
            flag = peer_pointer(region_table, rank, flags_offset + i * 8, tl.int64)
            ok = wait_flag_geq(flag, value, bound, status_ptr, poison_table, phase, i, rank, num_ranks, CLOCK)


@triton.jit
def report_kernel(status_ptr, poison_ptr, codes_ptr, n_codes, CAS: tl.constexpr):
    """Reports `codes_ptr[:n_codes]` one after another into one status word and one poison word, in the form `CAS`
    chooses (both forms are tested in the interpreter and compiled by the AOT check, whatever the backend)."""
    for i in range(n_codes):
        code = tl.load(codes_ptr + i)
        claim_status(status_ptr, code, CAS)
        poison_word(poison_ptr, code, CAS)


@triton.jit
def _spin_kernel(flag_ptr, bound, status_ptr, poison_table):
    # Calibration: a wait on a flag that never arrives, `bound` spins (its timeout is recorded in status_ptr).
    wait_flag_geq(flag_ptr, 1, bound, status_ptr, poison_table, 0, 0, 0, 1, 0)


# ---- host side ----


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, read by Triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_seconds_per_spin: float | None = None


def seconds_per_spin() -> float:
    """The measured cost of one spin of `wait_flag_geq` in the interpreter (once per process)."""
    global _seconds_per_spin
    if _seconds_per_spin is None:
        flag = torch.zeros(1, dtype=torch.int64)
        status = torch.zeros(STATUS_WORDS, dtype=torch.int64)
        poison = torch.zeros(1, dtype=torch.int64)
        table = torch.tensor([poison.data_ptr()], dtype=torch.int64)
        spins = 200
        _spin_kernel[(1,)](flag, 0, status, table)  # warm-up (the interpreter's first launch costs more)
        status.zero_()
        begin = time.perf_counter()
        _spin_kernel[(1,)](flag, spins, status, table)
        _seconds_per_spin = max((time.perf_counter() - begin) / spins, 1e-7)
    return _seconds_per_spin


def host_wait_flags(flags: torch.Tensor, value: int, poison: torch.Tensor, timeout_s: float) -> float:
    """The interpreter only: sleeps (with back-off) until every flag of `flags` (int64, this rank's own memory)
    reached `value`, the poison word is set, or `timeout_s` ran out; returns the seconds left. The kernel's bounded
    wait runs afterwards and does the real (acquire) wait and the reporting; this one only frees the core while the
    peers are late: an interpreted spin costs a core for ~1 ms, which the late peers (the ranks share the cores)
    need. Not used on a GPU, where the kernels wait alone."""
    deadline = time.monotonic() + timeout_s
    delay = 1e-4
    while not bool((flags >= value).all()) and int(poison[0]) == 0:
        left = deadline - time.monotonic()
        if left <= 0:
            return 0.0
        time.sleep(min(delay, left))
        delay = min(2 * delay, 2e-3)
    return max(0.0, deadline - time.monotonic())


@dataclass(frozen=True)
class WaitBound:
    """How a timeout becomes a kernel's `bound` and `CLOCK` (see the module docstring)."""

    bound: int
    clock: int

    @staticmethod
    def for_timeout(timeout_s: float, device: torch.device) -> WaitBound:
        timeout_s = max(float(timeout_s), 0.0)
        if device.type == "cpu":
            if not interpreted():
                raise _C.CommError(
                    "mtdeepep: Triton kernels on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before Triton is imported"
                )
            return WaitBound(max(1, int(timeout_s / seconds_per_spin())), CLOCK_SPINS)
        if device.type == "cuda" and torch.version.hip is not None:
            return WaitBound(int(timeout_s * 1e8), CLOCK_HIP_100MHZ)
        if device.type == "cuda":
            return WaitBound(int(timeout_s * 1e9), CLOCK_CUDA_NS)
        return WaitBound(max(1, int(timeout_s * MUSA_SPINS_PER_SECOND)), CLOCK_SPINS)


def block_size(n: int) -> int:
    """The power-of-two block that covers `n` elements (at least 16: Triton's smallest useful block)."""
    return max(16, triton.next_power_of_2(max(1, n)))


# Ahead-of-time compile specs (mtdeepep.kernels.aot): 8 ranks (the exchange's slot as intranode.NormalLayout.of(8)),
# each backend's clock.
_CLOCKS = {"cuda": {"CLOCK": CLOCK_CUDA_NS}, "hip": {"CLOCK": CLOCK_HIP_100MHZ}}
_TABLES = {"region_table": "*i64", "poison_table": "*i64", "status_ptr": "*i64"}
AOT_SPECS = [
    *(
        {
            "name": f"sync.exchange_{part}",
            "fn": exchange_kernel,
            "signature": {
                **_TABLES,
                "payload_ptr": "*i32",
                "out_ptr": "*i32",
                "mailbox_offset": "i64",
                "flags_offset": "i64",
                "value": "i64",
                "bound": "i64",
                "phase": "i32",
                "rank": "i32",
                "num_ranks": "i32",
                "n_words": "i32",
                "SLOT_BYTES": "constexpr",
                "BLOCK": "constexpr",
                "CLOCK": "constexpr",
                "SEND": "constexpr",
                "RECEIVE": "constexpr",
            },  # fmt: skip
            "constexprs": {"SLOT_BYTES": 4736, "BLOCK": 2048, "CLOCK": CLOCK_SPINS, "SEND": send, "RECEIVE": receive},
            "backend_constexprs": _CLOCKS,
            "flags": True,
        }
        for part, send, receive in (("both", True, True), ("send", True, False), ("receive", False, True))
    ),
    {
        "name": "sync.signal_all",
        "fn": signal_all_kernel,
        "signature": {"region_table": "*i64", "flags_offset": "i64", "value": "i64", "rank": "i32", "num_ranks": "i32"},
        "constexprs": {},
        "flags": True,
    },
    {
        "name": "sync.wait_all",
        "fn": wait_all_kernel,
        "signature": {
            **_TABLES,
            "flags_offset": "i64",
            "value": "i64",
            "bound": "i64",
            "phase": "i32",
            "rank": "i32",
            "num_ranks": "i32",
            "CLOCK": "constexpr",
        },  # fmt: skip
        "constexprs": {"CLOCK": CLOCK_SPINS},
        "backend_constexprs": _CLOCKS,
        "flags": True,
    },
    *(
        {
            "name": f"sync.report_{form}",
            "fn": report_kernel,
            "signature": {
                "status_ptr": "*i64",
                "poison_ptr": "*i64",
                "codes_ptr": "*i64",
                "n_codes": "i32",
                "CAS": "constexpr",
            },  # fmt: skip
            "constexprs": {"CAS": cas},
            "flags": True,
        }
        for form, cas in (("cas", True), ("rmw", False))
    ),
    {
        "name": "sync.spin_calibration",
        "fn": _spin_kernel,
        "signature": {"flag_ptr": "*i64", "bound": "i64", "status_ptr": "*i64", "poison_table": "*i64"},
        "constexprs": {},
        "flags": True,
    },
]
