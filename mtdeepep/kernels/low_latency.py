"""DeepEP's low-latency mode in Triton: dispatch (BF16, or FP8 with per-1x128 scales cast in the kernel) and the
weighted combine, between the ranks of one node that map each other's low-latency areas.

A rank reaches every rank's area (its own included) through a table of base addresses (`peer_table`, int64 `[R]`):
on the CPU the shared-memory segments `_C.Runtime.region_addresses(low_latency_area=True)` maps, on a GPU the
IPC-opened buffers. The area has the place and size of the CPU executor's (`csrc/runtime/cpu/low_latency_layout.hpp`),
so `Buffer.get_low_latency_rdma_size_hint` sizes it, but its control part is this module's (`ControlLayout`):

    [control: entered, poison, barrier [R], signals [2][R], counters [2][MAX_LOCAL_EXPERTS]]  [half 0]  [half 1]

Call n (dispatch or combine) uses half n % 2 of every area (the double buffer: two results alive at once). Before
writing call n into a peer's half a sender waits until the peer *entered* call n (it gave up the results of call n - 2
there). A dispatch, per destination expert (one program each): find its tokens, reserve rows in the receiver with one
atomic add on the receiver's counter, write the rows (cast to E4M3 on the way), the token indices and its
`layout_range` entry; the last program for a receiver publishes the call's signal (signature, then the call number,
release at system scope). The receiver waits for every source's signal (acquire), then copies out the layout, counts
and resets its counters. The combine writes each expert output row into its source's `combine_recv[expert, token]`
and signals; the receiver reduces over its top-k in FP32.

Waits: only in one-program kernels, through `sync.wait_flag_geq` (bounded by the timeout: the GPU clock; in the
interpreter the host first sleeps on the flags until the timeout, `sync.host_wait_flags`, then the kernel spins);
heavy kernels never wait (a wide grid that spun would hold the SMs a late peer needs). A wait that runs out records
(kind, phase, peer, rank) in this mode's own status word and poisons the other ranks' low-latency waits (the poison
words of their areas); the host raises `CommTimeoutError` naming the rank that did not arrive. `clean` clears both,
so low-latency mode recovers without touching normal mode. A destroyed rank poisons its peers (`destroy`): their
waits end at once naming it. With wait statistics, each peer is waited for in its own launch, timed on the host (the
kernels have no clock in the interpreter).

The calls are synchronous on the caller's thread (and the device's current stream): a hook-mode call sends in the
call and receives in the hook. Under the interpreter a hook-mode call's send phase (the entry wait and the send
kernel) runs on this rank's sender thread instead, in call order, so that the caller's work until the hook overlaps
the transfer as it does a GPU's kernel; the hook first joins it (and raises its error).

Wait statistics (`wait_stats`, nanoseconds per rank): the time the receiving side waited for each rank, counted from
the start of the receiving side (the call's start without a hook, as upstream's receiving warps poll from the
kernel's launch alongside the senders; the hook's start with one) until that rank's signal was there, the peers
waited for in rank order, each stretch counted once; a hook-mode call's entry wait counts as well.

The FP8 sender casts once per (token, expert) row it writes, i.e. up to top-k times per token (simple, one launch;
the CUDA executor casts once per token).

Interpreter traps avoided (see `/work/shared/reference/triton_notes.md`): bfloat16 is upcast before arithmetic and
rounded back to bfloat16 with integer operations (the interpreter truncates `.to(tl.bfloat16)`); E4M3 is cast with
`mtdeepep.kernels.fp8`'s integer operations (the interpreter's `.to(tl.float8e4nv)` rounds wrongly); divisions are
`div_rn` (a GPU's `/` is approximate).

Legend: T tokens, K top-k, H hidden, S = H / 128 scale blocks, R ranks, E experts, L = E / R local experts,
RT = R * T_max rows per local expert.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import _C
from . import fp8, sync

# ---------------------------------------------------------------------------------------------------------------
# Layout (mirrors csrc/runtime/cpu/low_latency_layout.hpp for the halves; the control part is this module's)

PAGE = 4096
LINE = 64
SCALE_BLOCK = 128
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)  # as the kernels see it
SCALES_PER_PACK = 4
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
MAX_LOCAL_EXPERTS = 1 << 15  # counters per half (the C++ control part reserves 1 << 16)
_CPP_MAX_EXPERTS = 1 << 16
SIGNAL_BYTES = 64  # seq (int64), then the call's signature (7 int64)
SIGNATURE_FIELDS = 7  # kind, hidden, num_max_dispatch_tokens_per_rank, num_experts, flags, dispatch uid, dispatch seq
FLAG_FP8, FLAG_ROUND_SCALE, FLAG_UE8M0 = 1, 2, 4
KIND_DISPATCH, KIND_COMBINE = 1, 2
DESTROYED_PHASE = 0xFF  # the phase of the poison code a destroyed rank leaves in its peers (see `destroy`)


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def cpu_control_bytes(num_ranks: int) -> int:
    """The C++ executor's control part (`ll::ControlLayout::bytes`): where half 0 starts in every area."""
    signals = LINE  # sizeof(Progress)
    counters = _align(signals + 2 * SIGNAL_BYTES * num_ranks, LINE)
    return _align(counters + 2 * 4 * _CPP_MAX_EXPERTS, PAGE)


@dataclass(frozen=True)
class ControlLayout:
    """Offsets of this module's signalling state in an area (they depend on the rank count only)."""

    num_ranks: int

    @property
    def entered(self) -> int:  # int64: the last call whose send phase started on this rank
        return 0

    @property
    def poison(self) -> int:  # int64: a failed peer's status code (ends this rank's waits; see `sync`)
        return 8

    @property
    def barrier(self) -> int:  # int64 [R]: barrier count each rank reached (never zeroed by clean)
        return LINE

    @property
    def signals(self) -> int:  # [2][R] signals of SIGNAL_BYTES
        return _align(self.barrier + 8 * self.num_ranks, LINE)

    @property
    def counters(self) -> int:  # int32 [2][MAX_LOCAL_EXPERTS]: rows reserved per local expert
        return _align(self.signals + 2 * SIGNAL_BYTES * self.num_ranks, LINE)

    @property
    def end(self) -> int:
        return self.counters + 2 * 4 * MAX_LOCAL_EXPERTS

    @property
    def halves(self) -> int:  # where half 0 starts: the C++ control size, so that both executors size areas alike
        return cpu_control_bytes(self.num_ranks)

    def signal(self, seq: int, source: int) -> int:
        return self.signals + SIGNAL_BYTES * ((seq % 2) * self.num_ranks + source)


@dataclass(frozen=True)
class HalfLayout:
    """Offsets of one call's arrays inside a half (as `ll::HalfLayout`)."""

    num_max_tokens: int
    hidden: int
    num_ranks: int
    num_experts: int

    def __post_init__(self) -> None:
        offset = 0
        fields = {}
        for name, nbytes, alignment in (
            ("layout_range", 8 * self.num_local_experts * self.num_ranks, LINE),
            ("src_info", 4 * self.rows, LINE),
            ("scales", 4 * self.num_scales * self.rows, LINE),
            ("recv_x", 2 * self.hidden * self.rows, PAGE),
            ("combine_recv", 2 * self.hidden * self.num_experts * self.num_max_tokens, PAGE),
        ):
            offset = _align(offset, alignment)
            fields[name] = offset
            offset += nbytes
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "bytes", _align(offset, PAGE))

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def rows_per_expert(self) -> int:
        return self.num_ranks * self.num_max_tokens

    @property
    def rows(self) -> int:
        return self.rows_per_expert * self.num_local_experts

    @property
    def num_scales(self) -> int:
        return (self.hidden + SCALE_BLOCK - 1) // SCALE_BLOCK

    @property
    def num_packed_scales(self) -> int:
        return (self.num_scales + SCALES_PER_PACK - 1) // SCALES_PER_PACK


def half_bytes(num_bytes: int, num_ranks: int) -> int:
    """The fixed size of each half of an area of `num_bytes` (as `ll::half_bytes`)."""
    control = cpu_control_bytes(num_ranks)
    return (num_bytes - control) // 2 // PAGE * PAGE if num_bytes > control else 0


# ---------------------------------------------------------------------------------------------------------------
# Element casts with integer operations (exact on every backend, the interpreter included)


@triton.jit
def _bf16_bits_rne(v):
    """float32 -> the int16 bit pattern of bfloat16, rounded to nearest even (NaN -> quiet NaN of the same sign)."""
    b = v.to(tl.int32, bitcast=True)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    bits = tl.where(nan, (b >> 16) | 0x40, rounded)
    return bits.to(tl.int16)


@triton.jit
def _bf16_round_kernel(x_ptr, bits_ptr, n, BLOCK: tl.constexpr):
    """float32 `x` -> the int16 bit patterns of bfloat16 (`_bf16_bits_rne`), for its test."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(bits_ptr + offs, _bf16_bits_rne(tl.load(x_ptr + offs, mask=offs < n, other=0.0)), mask=offs < n)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """The kernels' rounding of float32 to bfloat16 (int16 bit patterns)."""
    x = x.float().contiguous().flatten()
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    block = 1 << 16
    _bf16_round_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _addr(table, rank, offset):
    """The int64 address `offset` bytes into `rank`'s area."""
    return tl.load(table + rank) + offset


@triton.jit
def _wait_kernel(table, poison_table, status_ptr, rank, num_ranks, first, last, offset, stride, target, bound, phase,
                 PEER_AREA: tl.constexpr, CLOCK: tl.constexpr):  # fmt: skip
    """One program: for each rank p in [first, last), waits until the int64 flag at `offset + p * stride` in p's area
    (`PEER_AREA`) or in this rank's is >= `target` (`sync.wait_flag_geq`: bounded, acquire at system scope; on
    running out it records (timeout, `phase`, p, rank) in the status word)."""
    ok = tl.full([], 1, tl.int1)
    for p in range(first, last):
        if ok:
            if PEER_AREA:
                flag = sync.peer_pointer(table, p, offset + p * stride, tl.int64)
            else:
                flag = sync.peer_pointer(table, rank, offset + p * stride, tl.int64)
            ok = sync.wait_flag_geq(flag, target, bound, status_ptr, poison_table, phase, p, rank, num_ranks, CLOCK)


@triton.jit
def _enter_kernel(table, rank, offset, seq):
    """This rank entered call `seq` (release, system scope): from now on its half of call seq - 2 may be written."""
    sync.signal_flag(sync.peer_pointer(table, rank, offset, tl.int64), seq)


@triton.jit
def _poison_peers_kernel(poison_table, rank, num_ranks, code):
    """Writes `code` into every other rank's poison word (if none is there yet; release, system scope): their waits
    end at once naming this rank (its buffer is being destroyed)."""
    for r in range(num_ranks):
        if r != rank:
            word = sync.peer_pointer(poison_table, r, 0, tl.int64)
            sync.poison_word(word, tl.cast(code, tl.int64), sync.HAS_ATOMIC_CAS)  # tl.cast: `code` may be a constexpr


@triton.jit
def _publish(table, dest, signal_offset, signature, seq):
    """The signal of call `seq` in `dest`'s area: the signature, then the call number (release, system scope), so
    that a receiver that sees the number sees every write of this call before it."""
    signal = tl.load(table + dest) + signal_offset
    fields = tl.arange(0, 8)
    values = tl.load(signature + fields, mask=fields < 7, other=0)
    tl.store((signal + 8 + 8 * fields).to(tl.pointer_type(tl.int64)), values, mask=fields < 7)
    sync.signal_flag(signal.to(tl.pointer_type(tl.int64)), seq)


@triton.jit
def _write_rows(
    row, in_list, slot, half, e, rows_per_expert, hidden, num_scales, num_packed, OFF_SCALES, OFF_RECV_X,
    USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, USE_UE8M0: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_SB: tl.constexpr,
):  # fmt: skip
    """Rows `row` (bf16 pointers, a block of rows; `in_list` masks them) into the receiver's slots `slot` (int64) of
    its half at `half`: as bfloat16, or cast to E4M3 with one scale per 128 columns (`fp8.quantize_blocks`), the
    scales in the receiver's layout (float32 `[L, S, RT]`, or with UE8M0 the exponents packed 4 per int32 as
    `[L, ceil(S / 4), RT]`, unused bytes 0). Column tiles of BLOCK_H (bf16) or BLOCK_SB scale blocks of 128 (FP8):
    the tile, not the row, bounds the registers."""
    if USE_FP8:
        dst = (half + OFF_RECV_X).to(tl.pointer_type(tl.uint8))
        if USE_UE8M0:
            num_blocks = 4 * num_packed  # the padding exponents of the last int32 are written too (as 0)
        else:
            num_blocks = num_scales
        for b0 in range(0, num_blocks, BLOCK_SB):
            blocks = b0 + tl.arange(0, BLOCK_SB)
            columns = blocks[None, :, None] * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)[None, None, :]
            in_row = (columns < hidden) & in_list[:, None, None]
            v = tl.load(row[:, None, None] + columns, mask=in_row, other=0.0).to(tl.float32)
            bits, scale = fp8.quantize_blocks(v, ROUND_SCALE)
            tl.store(dst + slot[:, None, None] * hidden + columns, bits, mask=in_row)
            # Scale j of row i lives at ((e * S + j) * RT + slot_in_expert(i)); slot - e * RT is that last index.
            row_slot = slot[:, None] - e * rows_per_expert
            if USE_UE8M0:
                exponent = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
                exponent = tl.where(blocks[None, :] < num_scales, exponent, 0)
                base = (half + OFF_SCALES).to(tl.pointer_type(tl.uint8))
                pack = (e * num_packed + blocks[None, :] // 4).to(tl.int64) * rows_per_expert + row_slot
                mask = in_list[:, None] & (blocks[None, :] < num_blocks)
                tl.store(base + 4 * pack + blocks[None, :] % 4, exponent.to(tl.uint8), mask=mask)
            else:
                base = (half + OFF_SCALES).to(tl.pointer_type(tl.float32))
                at = (e * num_scales + blocks[None, :]).to(tl.int64) * rows_per_expert + row_slot
                tl.store(base + at, scale, mask=in_list[:, None] & (blocks[None, :] < num_scales))
    else:
        dst = (half + OFF_RECV_X).to(tl.pointer_type(tl.bfloat16)) + slot * hidden
        for h0 in range(0, hidden, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = in_list[:, None] & (offs_h[None, :] < hidden)
            values = tl.load(row[:, None] + offs_h[None, :], mask=mask)
            tl.store(dst[:, None] + offs_h[None, :], values, mask=mask)


@triton.jit
def _dispatch_send_kernel(
    x_ptr, x_stride, topk_ptr, num_tokens, num_topk, table, rank, seq, half_offset, signal_offset, counter_offset,
    token_list, send_done, signature, status, num_local, num_max_tokens, hidden, num_scales, num_packed,
    OFF_LAYOUT_RANGE, OFF_SRC_INFO, OFF_SCALES, OFF_RECV_X,
    USE_FP8: tl.constexpr, ROUND_SCALE: tl.constexpr, USE_UE8M0: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SB: tl.constexpr,
):  # fmt: skip
    """One program per global expert g (of rank g // L): this rank's tokens routed to g (ascending) are written into
    the receiver's rows [begin, begin + count) of its local expert, reserved with one atomic add; then the receiver's
    layout_range entry for this source. The last program for a receiver publishes this call's signal to it."""
    g = tl.program_id(0)
    dest = g // num_local
    e = g % num_local
    num_ranks = tl.num_programs(0) // num_local
    rows_per_expert = num_ranks * num_max_tokens
    tokens_of_g = token_list + g * num_max_tokens
    # The tokens routed to g, in order, into this rank's scratch list.
    offs_k = tl.arange(0, BLOCK_K)
    count = 0
    for t0 in range(0, num_tokens, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask = (offs_t[:, None] < num_tokens) & (offs_k[None, :] < num_topk)
        ids = tl.load(topk_ptr + offs_t[:, None] * num_topk + offs_k[None, :], mask=mask, other=-1)
        hit = tl.max((ids == g).to(tl.int32), axis=1)
        position = count + tl.cumsum(hit, axis=0) - hit
        tl.store(tokens_of_g + position, offs_t, mask=hit > 0)
        count += tl.sum(hit, axis=0)
    half = _addr(table, dest, half_offset)
    begin = count * 0
    if count > 0:
        counter = _addr(table, dest, counter_offset + 4 * e).to(tl.pointer_type(tl.int32))
        begin = tl.atomic_add(counter, count, sem="relaxed", scope="sys")
    if begin + count > rows_per_expert:
        # Stale signalling state (a call that failed half-way): report it, write nothing.
        tl.atomic_xchg(status, dest + 1)
    else:
        packed = (begin.to(tl.int64) << 32) | count.to(tl.int64)
        tl.store((half + OFF_LAYOUT_RANGE + 8 * (e * num_ranks + rank)).to(tl.pointer_type(tl.int64)), packed)
        src_info = (half + OFF_SRC_INFO).to(tl.pointer_type(tl.int32)) + e * rows_per_expert + begin
        # BLOCK_ROWS rows at a time: row i of the segment is token tokens_of_g[i], slot begin + i.
        for i0 in range(0, count, BLOCK_ROWS):
            offs = i0 + tl.arange(0, BLOCK_ROWS)
            in_list = offs < count
            token = tl.load(tokens_of_g + offs, mask=in_list, other=0)
            tl.store(src_info + offs, token, mask=in_list)
            _write_rows(
                x_ptr + token.to(tl.int64) * x_stride, in_list, (e * rows_per_expert + begin + offs).to(tl.int64),
                half, e, rows_per_expert, hidden, num_scales, num_packed, OFF_SCALES, OFF_RECV_X,
                USE_FP8, ROUND_SCALE, USE_UE8M0, BLOCK_H, BLOCK_SB,
            )  # fmt: skip
    # Every program of `dest` done (acq_rel orders their writes before the signal): the last one signals.
    done = tl.atomic_add(send_done + dest, 1, sem="acq_rel", scope="sys")
    if done == num_local - 1:
        _publish(table, dest, signal_offset, signature, seq)


@triton.jit
def _dispatch_finish_kernel(
    table, rank, num_ranks, half_offset, counter_offset, recv_count, src_info_out, layout_range_out, stats,
    rows_per_expert, OFF_LAYOUT_RANGE, OFF_SRC_INFO, HAS_STATS: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One program per local expert, once every source signalled: layout_range, src_info and the count out of this
    rank's half; the counter reset for the call after next; the count added to the cumulative stats."""
    e = tl.program_id(0)
    half = _addr(table, rank, half_offset)
    offs_r = tl.arange(0, BLOCK_R)
    ranges = tl.load((half + OFF_LAYOUT_RANGE).to(tl.pointer_type(tl.int64)) + e * num_ranks + offs_r,
                     mask=offs_r < num_ranks, other=0)  # fmt: skip
    tl.store(layout_range_out + e * num_ranks + offs_r, ranges, mask=offs_r < num_ranks)
    count = tl.sum(ranges & 0xFFFFFFFF, axis=0).to(tl.int32)
    tl.store(recv_count + e, count)
    src = (half + OFF_SRC_INFO).to(tl.pointer_type(tl.int32)) + e * rows_per_expert
    for i0 in range(0, rows_per_expert, BLOCK_S):
        offs = i0 + tl.arange(0, BLOCK_S)
        values = tl.load(src + offs, mask=offs < rows_per_expert)
        tl.store(src_info_out + e * rows_per_expert + offs, values, mask=offs < rows_per_expert)
    tl.store(_addr(table, rank, counter_offset + 4 * e).to(tl.pointer_type(tl.int32)), 0)
    if HAS_STATS:
        tl.store(stats + e, tl.load(stats + e) + count)


@triton.jit
def _combine_send_kernel(
    x_ptr, src_info, layout_range, table, rank, seq, half_offset, signal_offset, send_done, signature, num_ranks,
    num_max_tokens, hidden, OFF_COMBINE_RECV, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (e, s): the rows of local expert e that came from rank s go back to s's combine_recv[g, token]
    (g = rank * L + e); the last program for s publishes this call's signal to it."""
    e = tl.program_id(0)
    source = tl.program_id(1)
    num_local = tl.num_programs(0)
    rows_per_expert = num_ranks * num_max_tokens
    packed = tl.load(layout_range + e * num_ranks + source)
    begin = (packed >> 32).to(tl.int32)
    count = (packed & 0xFFFFFFFF).to(tl.int32)
    g = rank * num_local + e
    dst = (_addr(table, source, half_offset + OFF_COMBINE_RECV)).to(tl.pointer_type(tl.bfloat16))
    for i0 in range(begin, begin + count, BLOCK_T):
        offs = i0 + tl.arange(0, BLOCK_T)
        in_segment = offs < begin + count
        token = tl.load(src_info + e * rows_per_expert + offs, mask=in_segment, other=0)
        src_row = x_ptr + (e * rows_per_expert + offs).to(tl.int64) * hidden
        dst_row = dst + (g * num_max_tokens + token).to(tl.int64) * hidden
        for h0 in range(0, hidden, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = in_segment[:, None] & (offs_h[None, :] < hidden)
            values = tl.load(src_row[:, None] + offs_h[None, :], mask=mask)
            tl.store(dst_row[:, None] + offs_h[None, :], values, mask=mask)
    done = tl.atomic_add(send_done + source, 1, sem="acq_rel", scope="sys")
    if done == num_local - 1:
        _publish(table, source, signal_offset, signature, seq)


@triton.jit
def _combine_reduce_kernel(
    table, rank, half_offset, topk_ptr, weights_ptr, out_bits, num_tokens, num_topk, num_max_tokens, hidden,
    OFF_COMBINE_RECV, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Program (token block, column block): out[t] = sum over the non-masked slots k, in slot order, of
    w[t, k] * combine_recv[topk_idx[t, k], t], in FP32, rounded once to bfloat16."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = (_addr(table, rank, half_offset + OFF_COMBINE_RECV)).to(tl.pointer_type(tl.bfloat16))
    in_t = offs_t < num_tokens
    in_h = offs_h < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in range(0, num_topk):
        expert = tl.load(topk_ptr + offs_t * num_topk + k, mask=in_t, other=-1)
        weight = tl.load(weights_ptr + offs_t * num_topk + k, mask=in_t, other=0.0)
        valid = expert >= 0
        row = (tl.where(valid, expert, 0) * num_max_tokens + offs_t).to(tl.int64)
        mask = (valid[:, None]) & (in_h[None, :])
        value = tl.load(rows + row[:, None] * hidden + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += weight[:, None] * value
    out = out_bits + offs_t[:, None].to(tl.int64) * hidden + offs_h[None, :]
    tl.store(out, _bf16_bits_rne(acc), mask=in_t[:, None] & in_h[None, :])


# ---------------------------------------------------------------------------------------------------------------
# Host side


@dataclass
class Blocks:
    """Block sizes: few large blocks under the interpreter (about 2.6 ms per program instance), GPU-sized ones
    otherwise. The interpreter's FP8 tile is 2 scale blocks, so that the test shapes (hidden 128 to 512) run the
    cast's column-tile loop more than once, as hidden 7168 does on a GPU."""

    tokens: int = 128  # topk scan
    rows: int = 1  # rows per tile of a copy
    hidden: int = 2048  # columns per tile of a BF16 copy
    scale_blocks: int = 4  # 128-column scale blocks per tile of an FP8 cast: [rows, 4, 128] keeps it in registers
    reduce_tokens: int = 1
    reduce_hidden: int = 1024
    src_info: int = 1024

    @staticmethod
    def for_device(device: torch.device, interpret: bool) -> Blocks:
        if interpret or device.type == "cpu":
            return Blocks(
                tokens=128, rows=64, hidden=8192, scale_blocks=2, reduce_tokens=64, reduce_hidden=1024, src_info=8192
            )
        return Blocks()


@dataclass
class _Call:
    seq: int
    epoch: int
    hook_mode: bool


class LowLatencyKernels:
    """DeepEP's low-latency calls for one rank of `num_ranks` on one node, run by the Triton kernels above.

    area: this rank's low-latency area as a uint8 tensor on the kernels' device (its first byte is the area's);
    peer_table: int64 `[R]` on the same device, every rank's area base address in this process (this rank's too);
    uid: the buffer's id (agreed at set-up), carried in the signatures. Waits are bounded by `timeout_s`
    (`sync.WaitBound`); their failures go to this mode's own status word (`self.status`), and poison the peers'
    low-latency waits through the poison words of their areas, so that `clean` can recover from them without touching
    normal mode. The calls are synchronous on the device's current stream (the engine makes the events).
    """

    def __init__(self, *, area: torch.Tensor, peer_table: torch.Tensor, rank: int, num_ranks: int, uid: int,
                 timeout_s: float) -> None:  # fmt: skip
        if area.dtype != torch.uint8 or area.dim() != 1:
            raise ValueError("mtdeepep: the low-latency area must be a 1-D uint8 tensor")
        if peer_table.dtype != torch.int64 or peer_table.shape != (num_ranks,):
            raise ValueError(f"mtdeepep: peer_table must be int64 [{num_ranks}]")
        self.area, self.peer_table = area, peer_table
        self.rank, self.num_ranks, self.uid = rank, num_ranks, uid
        self.device = area.device
        self.timeout_s = float(timeout_s)
        self.bound = sync.WaitBound.for_timeout(timeout_s, self.device)
        self.status = sync.StatusWord(self.device)
        self.control = ControlLayout(num_ranks)
        if self.control.end > self.control.halves:
            raise ValueError(f"mtdeepep: {num_ranks} ranks need a larger low-latency control part")
        if area.numel() < self.control.halves:
            raise ValueError(
                f"mtdeepep: low-latency mode needs num_rdma_bytes >= {self.control.halves} (got {area.numel()}); use "
                "Buffer.get_low_latency_rdma_size_hint"
            )
        self.half_bytes = half_bytes(area.numel(), num_ranks)
        self.poison_table = peer_table + self.control.poison
        self.blocks = Blocks.for_device(self.device, sync.interpreted())
        self.seq = 0
        self.epoch = 0
        self.barriers = 0
        self.hook_pending = [False, False]
        self.combine_areas: list[torch.Tensor | None] = [None, None]
        self.zero_copy_combines = 0
        self._sender: ThreadPoolExecutor | None = None  # the interpreter's hook-mode sends (`_start_send`)
        self._sends: list[Future] = []  # those not joined yet, in call order

    # ---- helpers ----

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.bound = sync.WaitBound.for_timeout(timeout_s, self.device)

    def _half_offset(self, seq: int) -> int:
        return self.control.halves + (seq % 2) * self.half_bytes

    def _counter_offset(self, seq: int) -> int:
        return self.control.counters + 4 * MAX_LOCAL_EXPERTS * (seq % 2)

    def _layout(self, num_max_tokens: int, hidden: int, num_experts: int) -> HalfLayout:
        if num_max_tokens <= 0 or hidden <= 0 or num_experts <= 0 or num_experts % self.num_ranks:
            raise ValueError(
                f"mtdeepep: invalid num_max_dispatch_tokens_per_rank={num_max_tokens} / hidden={hidden} / "
                f"num_experts={num_experts} on {self.num_ranks} ranks"
            )
        layout = HalfLayout(num_max_tokens, hidden, self.num_ranks, num_experts)
        if layout.num_local_experts > MAX_LOCAL_EXPERTS:
            raise ValueError(f"mtdeepep: at most {MAX_LOCAL_EXPERTS} local experts, got {layout.num_local_experts}")
        if layout.bytes > self.half_bytes:
            needed = self.control.halves + 2 * layout.bytes
            raise ValueError(
                f"mtdeepep: num_rdma_bytes={self.area.numel()} is too small for num_max_dispatch_tokens_per_rank="
                f"{num_max_tokens}, hidden={hidden}, num_experts={num_experts} on {self.num_ranks} ranks: it needs "
                f"{needed} (Buffer.get_low_latency_rdma_size_hint)"
            )
        return layout

    def _view(self, offset: int, sizes, strides, dtype: torch.dtype) -> torch.Tensor:
        """A view of this rank's area at byte `offset`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        elements = 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides))
        return self.area[offset : offset + elements * itemsize].view(dtype).as_strided(sizes, strides)

    def _begin(self, hook_mode: bool) -> _Call:
        seq = self.seq + 1
        if self.hook_pending[seq % 2]:
            raise ValueError(
                f"mtdeepep: low-latency call #{seq} would reuse the buffer half of call #{seq - 2}, whose receive hook "
                "was not called yet; call that hook first (at most two low-latency results can be in flight)"
            )
        self.seq = seq
        if hook_mode:
            self.hook_pending[seq % 2] = True
        return _Call(seq, self.epoch, hook_mode)

    def _end(self, call: _Call) -> None:
        if call.epoch == self.epoch:
            self.hook_pending[call.seq % 2] = False

    def _wait(self, phase: int, offset: int, stride: int, target: int, peer_area: bool,
              wait_ns: torch.Tensor | None, since_ns: int | None = None) -> None:  # fmt: skip
        """Waits (`_wait_kernel`, bounded by the timeout) until every rank's flag reached `target`; raises the status
        word's error (`CommTimeoutError` naming the rank that did not arrive and the phase). With `wait_ns`, one
        launch per rank, each timed: `wait_ns[p]` gets the time spent waiting for rank p (the first from `since_ns`,
        a `time.perf_counter_ns()`, when given: see the module docstring). In the interpreter the host first sleeps
        until the flags are there (`_host_wait`), so the timeout is wall-clock time there too."""
        # This rank's own flag is already there (its own launches, in order): with `wait_ns`, not timed.
        spans = (
            [(0, self.num_ranks)] if wait_ns is None else [(p, p + 1) for p in range(self.num_ranks) if p != self.rank]
        )
        waited = []
        deadline = time.monotonic() + self.timeout_s
        start = time.perf_counter_ns() if since_ns is None else since_ns
        for first, last in spans:
            bound = self._host_wait(offset, stride, target, peer_area, first, last, deadline)
            _wait_kernel[(1,)](
                self.peer_table, self.poison_table, self.status.words, self.rank, self.num_ranks, first, last, offset,
                stride, target, bound, phase, PEER_AREA=peer_area, CLOCK=self.bound.clock,
            )  # fmt: skip
            self._check_status()
            end = time.perf_counter_ns()
            waited.append(end - start)
            start = end
        if wait_ns is not None:
            waited.insert(self.rank, 0)
            wait_ns += torch.tensor(waited, dtype=torch.int64, device=wait_ns.device)

    def _host_wait(self, offset, stride, target, peer_area, first, last, deadline) -> int:
        """The interpreter: the host sleeps until the flags of ranks [first, last) are there, this rank's poison word
        is set, or `deadline` passed (`sync.host_wait_flags`, which frees the core the late peers need); returns the
        kernel wait's bound: 1 spin once the time ran out (the kernel then reports whom it waited for)."""
        if self.bound.clock != sync.CLOCK_SPINS or self.device.type != "cpu":
            return self.bound.bound
        poison = self.area[self.control.poison : self.control.poison + 8].view(torch.int64)
        for p in range(first, last):
            address = int(self.peer_table[p if peer_area else self.rank]) + offset + p * stride
            flag = torch.frombuffer(ctypes.c_int64.from_address(address), dtype=torch.int64)
            if sync.host_wait_flags(flag, target, poison, max(0.0, deadline - time.monotonic())) <= 0:
                return 1
        return self.bound.bound

    def _check_status(self) -> None:
        """The status word's error; a peer that destroyed its buffer (its poison code has phase `DESTROYED_PHASE`)
        is named as such."""
        try:
            self.status.check()
        except _C.CommError as error:
            code, cause = self.status.read()
            kind, phase, culprit, _ = sync.decode_error(cause) if cause else (0, 0, -1, -1)
            if kind == sync.KIND_PEER_FAILED and phase == DESTROYED_PHASE:
                _, waited_in, _, _ = sync.decode_error(code)
                raise _C.CommError(
                    f"mtdeepep: rank {self.rank} stopped waiting in phase '{sync.PHASE_NAMES.get(waited_in, '?')}': "
                    f"rank {culprit} failed: its buffer was destroyed"
                ) from error
            raise

    def _enter_and_wait_peers(self, call: _Call, wait_ns) -> None:
        """This rank entered call `seq`; waits until every peer did (its half of call seq - 2 is given up)."""
        _enter_kernel[(1,)](self.peer_table, self.rank, self.control.entered, call.seq)
        if call.seq > 2:
            self._wait(sync.PHASE_LOW_LATENCY_ENTER, self.control.entered, 0, call.seq, True, wait_ns)

    def _wait_signals(self, call: _Call, phase: int, expected: list[int], wait_ns, since_ns: int | None) -> str:
        """Waits for every source's signal of `call`; returns a mismatch message when they did not all make it."""
        signals = self.control.signal(call.seq, 0)
        self._wait(phase, signals, SIGNAL_BYTES, call.seq, False, wait_ns, since_ns)
        block = self.area[signals : signals + SIGNAL_BYTES * self.num_ranks].view(torch.int64)
        block = block.view(self.num_ranks, SIGNAL_BYTES // 8)[:, 1 : 1 + SIGNATURE_FIELDS].cpu().tolist()
        for source, theirs in enumerate(block):
            if theirs != expected:
                return (
                    f"mtdeepep: ranks disagree on low-latency op #{call.seq} in phase "
                    f"'{sync.PHASE_NAMES[phase]}': rank {self.rank} has {_describe(expected)} but rank {source} has "
                    f"{_describe(theirs)}; kind 1 = "
                    "dispatch, 2 = combine; flags: 1 FP8, 2 round_scale, 4 UE8M0; a combine carries the dispatch of "
                    "its handle: every rank must combine the same dispatch"
                )
        return ""

    def _start_send(self, send: Callable[[], None], hook_mode: bool) -> Future | None:
        """Runs a call's send phase: under the interpreter a hook-mode call's on this rank's sender thread (returns
        its future, for the hook to join), else now on the caller's thread, after the sends still running."""
        if hook_mode and self.device.type == "cpu":
            if self._sender is None:
                self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mtdeepep-ll-send-{self.rank}")
                weakref.finalize(self, self._sender.shutdown, wait=False)  # kernels dropped without destroy()
            future = self._sender.submit(send)
            self._sends.append(future)
            return future
        self._join_sends()
        send()
        return None

    def _join_send(self, sending: Future | None) -> None:
        """Waits for a hook-mode call's send phase (bounded: its waits are) and raises its error."""
        if sending is not None:
            try:
                sending.result()
            finally:
                self._sends = [f for f in self._sends if f is not sending]

    def _join_sends(self) -> None:
        """Waits for the sends still running (their errors belong to their hooks)."""
        for future in self._sends:
            with contextlib.suppress(BaseException):  # raised by the hook of its own call
                future.result()

    def _check_epoch(self, call: _Call) -> None:
        if call.epoch != self.epoch:
            raise _C.CommError("mtdeepep: this receive hook belongs to a call made before clean_low_latency_buffer")

    def _hook(self, call: _Call, receive: Callable[[], None]) -> Callable[[], None]:
        state = {"ran": False, "error": None}

        def hook() -> None:
            if not state["ran"]:
                state["ran"] = True
                try:
                    self._check_epoch(call)
                    receive()
                except BaseException as error:  # noqa: BLE001 - re-raised on this and every later call
                    state["error"] = error
                    self._end(call)
            if state["error"] is not None:
                raise state["error"]

        return hook

    def _send_then_receive(self, call: _Call, send: Callable[[], None], finish: Callable[[], None], phase: int,
                           signature: list[int], wait_stats: torch.Tensor | None, called_ns: int,
                           return_recv_hook: bool) -> Callable[[], None] | None:  # fmt: skip
        """A call's two halves: `send` now (`_start_send`), then the receive: wait for every rank's signal of `phase`
        (checking `signature`), `finish` (the kernels that read what arrived), and a GroupMismatchError if the ranks
        disagreed. Returns the receive as the hook with `return_recv_hook`, else runs it now and returns None."""
        try:
            sending = self._start_send(send, return_recv_hook)
        except BaseException:
            self._end(call)
            raise

        def receive() -> None:
            try:
                self._join_send(sending)
                mismatch = self._wait_signals(call, phase, signature, wait_stats,
                                              None if return_recv_hook else called_ns)  # fmt: skip
                finish()
            finally:
                self._end(call)
            if mismatch:
                raise _C.GroupMismatchError(mismatch)

        if return_recv_hook:
            return self._hook(call, receive)
        receive()
        return None

    # ---- dispatch ----

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                 num_experts: int, cumulative_stats: torch.Tensor | None, wait_stats: torch.Tensor | None,
                 use_fp8: bool, round_scale: bool, use_ue8m0: bool, return_recv_hook: bool):  # fmt: skip
        """`(recv_x, recv_scales or None, recv_count, src_info, layout_range, seq, hook or None)`; arguments checked
        by the facade (x bfloat16 [T, H] rows, topk_idx int64 [T, K] contiguous). See `Buffer.low_latency_dispatch`."""
        layout = self._layout(num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
        _check_topk_idx(topk_idx, num_experts)
        round_scale, use_ue8m0 = use_fp8 and round_scale, use_fp8 and use_ue8m0
        call = self._begin(return_recv_hook)
        L, RT, H = layout.num_local_experts, layout.rows_per_expert, layout.hidden
        half = self._half_offset(call.seq)
        recv_x = self._view(half + layout.recv_x, (L, RT, H), (RT * H, H, 1),
                            torch.float8_e4m3fn if use_fp8 else torch.bfloat16)  # fmt: skip
        recv_scales = None
        if use_fp8:
            columns = layout.num_packed_scales if use_ue8m0 else layout.num_scales
            recv_scales = self._view(half + layout.scales, (L, RT, columns), (columns * RT, 1, RT),
                                     torch.int32 if use_ue8m0 else torch.float32)  # fmt: skip
        recv_count = torch.empty(L, dtype=torch.int32, device=self.device)
        src_info = torch.empty(L, RT, dtype=torch.int32, device=self.device)
        layout_range = torch.empty(L, self.num_ranks, dtype=torch.int64, device=self.device)
        flags = (
            (FLAG_FP8 if use_fp8 else 0) | (FLAG_ROUND_SCALE if round_scale else 0) | (FLAG_UE8M0 if use_ue8m0 else 0)
        )
        signature = [KIND_DISPATCH, H, num_max_dispatch_tokens_per_rank, num_experts, flags, self.uid, call.seq]
        called_ns = time.perf_counter_ns()

        def send() -> None:
            self._enter_and_wait_peers(call, wait_stats if return_recv_hook else None)
            status = torch.zeros(1, dtype=torch.int32, device=self.device)
            token_list = torch.empty(num_experts, num_max_dispatch_tokens_per_rank, dtype=torch.int32,
                                     device=self.device)  # fmt: skip
            blocks = self.blocks
            _dispatch_send_kernel[(num_experts,)](
                x, x.stride(0), topk_idx, x.size(0), topk_idx.size(1), self.peer_table, self.rank, call.seq, half,
                self.control.signal(call.seq, self.rank), self._counter_offset(call.seq), token_list,
                torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device),
                torch.tensor(signature, dtype=torch.int64, device=self.device), status, L,
                num_max_dispatch_tokens_per_rank, H, layout.num_scales, layout.num_packed_scales,
                layout.layout_range, layout.src_info, layout.scales, layout.recv_x,
                USE_FP8=use_fp8, ROUND_SCALE=round_scale, USE_UE8M0=use_ue8m0,
                BLOCK_T=min(blocks.tokens, triton.next_power_of_2(max(x.size(0), 1))),
                BLOCK_K=triton.next_power_of_2(max(topk_idx.size(1), 1)),
                BLOCK_ROWS=blocks.rows,
                BLOCK_H=min(blocks.hidden, triton.next_power_of_2(H)),
                BLOCK_SB=min(blocks.scale_blocks, triton.next_power_of_2(SCALES_PER_PACK * layout.num_packed_scales)),
            )  # fmt: skip
            failed = int(status.item())
            if failed:
                raise _C.CommError(
                    f"mtdeepep: rank {failed - 1} has more rows reserved in low-latency op #{call.seq} than its "
                    f"{RT} slots per expert; the signalling state is stale: call clean_low_latency_buffer"
                )

        def finish() -> None:
            _dispatch_finish_kernel[(L,)](
                self.peer_table, self.rank, self.num_ranks, half, self._counter_offset(call.seq), recv_count,
                src_info, layout_range, cumulative_stats if cumulative_stats is not None else recv_count, RT,
                layout.layout_range, layout.src_info, HAS_STATS=cumulative_stats is not None,
                BLOCK_R=triton.next_power_of_2(self.num_ranks), BLOCK_S=min(self.blocks.src_info,
                                                                            triton.next_power_of_2(RT)),
            )  # fmt: skip

        hook = self._send_then_receive(call, send, finish, sync.PHASE_LOW_LATENCY_DISPATCH_RECEIVE, signature,
                                       wait_stats, called_ns, return_recv_hook)  # fmt: skip
        return recv_x, recv_scales, recv_count, src_info, layout_range, call.seq, hook

    # ---- combine ----

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, src_info: torch.Tensor,
                layout_range: torch.Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                dispatch_uid: int, dispatch_seq: int, zero_copy: bool, return_recv_hook: bool,
                out: torch.Tensor | None, wait_stats: torch.Tensor | None):  # fmt: skip
        """`(combined [T, H] bfloat16, hook or None)`; see `Buffer.low_latency_combine`. `x`: the expert outputs
        `[L, RT, H]` (ignored with `zero_copy`: the area of `next_combine_buffer` is read)."""
        layout = self._layout(num_max_dispatch_tokens_per_rank, x.size(2), num_experts)
        L, RT, H, T_max = layout.num_local_experts, layout.rows_per_expert, layout.hidden, layout.num_max_tokens
        _check_topk_idx(topk_idx, num_experts)
        _check_handle(src_info, layout_range, L, RT, self.num_ranks, T_max)
        if zero_copy:
            area = self.combine_areas[self.zero_copy_combines % 2]
            if area is None or area.shape != x.shape:
                raise ValueError("mtdeepep: zero_copy needs the expert outputs in get_next_low_latency_combine_buffer"
                                 "(handle) first")  # fmt: skip
            x = area
        combined = out if out is not None else torch.empty(topk_idx.size(0), H, dtype=torch.bfloat16,
                                                            device=self.device)  # fmt: skip
        call = self._begin(return_recv_hook)
        if zero_copy:
            self.zero_copy_combines += 1
        half = self._half_offset(call.seq)
        signature = [KIND_COMBINE, H, T_max, num_experts, 0, dispatch_uid, dispatch_seq]
        called_ns = time.perf_counter_ns()

        def send() -> None:
            self._enter_and_wait_peers(call, wait_stats if return_recv_hook else None)
            _combine_send_kernel[(L, self.num_ranks)](
                x, src_info, layout_range, self.peer_table, self.rank, call.seq, half,
                self.control.signal(call.seq, self.rank),
                torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device),
                torch.tensor(signature, dtype=torch.int64, device=self.device), self.num_ranks, T_max, H,
                layout.combine_recv, BLOCK_T=self.blocks.rows,
                BLOCK_H=min(self.blocks.hidden, triton.next_power_of_2(H)),
            )  # fmt: skip

        def finish() -> None:
            num_tokens = topk_idx.size(0)
            if num_tokens:
                block_t = min(self.blocks.reduce_tokens, triton.next_power_of_2(num_tokens))
                block_h = min(self.blocks.reduce_hidden, triton.next_power_of_2(H))
                grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(H, block_h))
                _combine_reduce_kernel[grid](
                    self.peer_table, self.rank, half, topk_idx, topk_weights, combined.view(torch.int16),
                    num_tokens, topk_idx.size(1), T_max, H, layout.combine_recv, BLOCK_T=block_t,
                    BLOCK_H=block_h,
                )  # fmt: skip

        hook = self._send_then_receive(call, send, finish, sync.PHASE_LOW_LATENCY_COMBINE_RECEIVE, signature,
                                       wait_stats, called_ns, return_recv_hook)  # fmt: skip
        return combined, hook

    def next_combine_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int):
        """The bfloat16 `[L, RT, H]` area the next zero-copy combine reads (two, alternating)."""
        layout = self._layout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        sizes = (layout.num_local_experts, layout.rows_per_expert, hidden)
        index = self.zero_copy_combines % 2
        area = self.combine_areas[index]
        if area is None or tuple(area.shape) != sizes:
            area = self.combine_areas[index] = torch.zeros(sizes, dtype=torch.bfloat16, device=self.device)
        return area

    # ---- clean ----

    def _barrier(self) -> None:
        """Every rank arrives (bounded): the flags `barrier[rank]` in every area, as `sync`'s barrier kernels."""
        self.barriers += 1
        sync.signal_all_kernel[(1,)](self.peer_table, self.control.barrier, self.barriers, self.rank, self.num_ranks)
        sync.wait_all_kernel[(1,)](
            self.peer_table, self.poison_table, self.status.words, self.control.barrier, self.barriers,
            self._host_wait(self.control.barrier, 8, self.barriers, False, 0, self.num_ranks,
                            time.monotonic() + self.timeout_s),
            sync.PHASE_BARRIER, self.rank, self.num_ranks, CLOCK=self.bound.clock,
        )  # fmt: skip
        self._check_status()

    def destroy(self) -> None:
        """This rank's buffer goes away: every peer's low-latency wait ends at once with `CommError` naming this rank
        (call before the area is unmapped; the poison goes into the peers' areas)."""
        self._join_sends()  # bounded by the timeout
        if self._sender is not None:
            self._sender.shutdown(wait=True)
            self._sender = None
        code = sync.encode_error(sync.KIND_PEER_FAILED, DESTROYED_PHASE, self.rank, self.rank)
        _poison_peers_kernel[(1,)](self.poison_table, self.rank, self.num_ranks, code)

    def interrupt(self) -> None:
        """Ends this rank's low-latency waits now (its poison word; they raise `CommError`)."""
        code = sync.encode_error(sync.KIND_ABORTED, 0, self.rank, self.rank)
        self.area[self.control.poison : self.control.poison + 8].view(torch.int64)[0] = code

    def clean(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zeroes this rank's signalling state and restarts the call numbering, between two barriers of all ranks
        (collective; no low-latency call in flight)."""
        layout = self._layout(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._join_sends()  # no send of this rank still in flight (each ends within the timeout)
        self._sends = []
        # A failed call left this rank's status word or poison set: clear both, then meet the others.
        self.status = sync.StatusWord(self.device)
        self.area[self.control.poison : self.control.poison + 8].zero_()
        self._barrier()  # every rank stopped sending
        self.area[: self.control.barrier].zero_()
        self.area[self.control.signals : self.control.end].zero_()
        for h in range(2):
            start = self._half_offset(h) + layout.layout_range
            self.area[start : start + 8 * layout.num_local_experts * self.num_ranks].zero_()
        self.seq = 0
        self.epoch += 1
        self.hook_pending = [False, False]
        self._barrier()  # every rank zeroed its state


def _describe(signature: list[int]) -> str:
    kind, hidden, tokens, experts, flags, uid, seq = signature
    return (f"(kind {kind}, hidden {hidden}, num_max_dispatch_tokens_per_rank {tokens}, num_experts {experts}, "
            f"flags {flags}, dispatch {uid}#{seq})")  # fmt: skip


def _check_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Ids in [-1, num_experts), no expert twice in a row (its rows would share one combine slot)."""
    if topk_idx.numel() == 0:
        return
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        t, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"mtdeepep: topk_idx values must lie in [-1, {num_experts}), found {int(topk_idx[t, k])} at "
                         f"[{t}, {k}]")  # fmt: skip
    ordered = topk_idx.sort(dim=1).values
    twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(twice.any()):
        t, k = (int(v) for v in twice.nonzero()[0])
        raise ValueError(f"mtdeepep: topk_idx row {t} names expert {int(ordered[t, k + 1])} twice")


def _check_handle(src_info, layout_range, num_local, rows_per_expert, num_ranks, num_max_tokens) -> None:
    """Every row a handle names lies inside its expert and points at a token slot of its source (the kernels trust
    it)."""
    if tuple(src_info.shape) != (num_local, rows_per_expert) or tuple(layout_range.shape) != (num_local, num_ranks):
        raise ValueError("mtdeepep: the handle's src_info / layout_range do not match this call's shapes")
    begin, count = layout_range >> 32, layout_range & 0xFFFFFFFF
    if bool(((begin < 0) | (begin + count > rows_per_expert)).any()):
        raise ValueError("mtdeepep: handle: layout_range is out of range")
    rows = torch.arange(rows_per_expert, device=src_info.device)
    named = ((rows.view(1, 1, -1) >= begin.unsqueeze(2)) & (rows.view(1, 1, -1) < (begin + count).unsqueeze(2))).any(1)
    sources = src_info[named]
    if bool(((sources < 0) | (sources >= num_max_tokens)).any()):
        raise ValueError("mtdeepep: handle: src_info names a row that is not a token index")


# ---------------------------------------------------------------------------------------------------------------
# Ahead-of-time compile descriptions (the compile check in CI builds each for cuda:90 and hip:gfx942)


def _aot_specs() -> list[dict]:
    """Every kernel at production shapes: hidden 7168, 128 tokens a rank, top-8 of 256 experts on 8 ranks (32 local
    experts), with the GPU block sizes of `Blocks()`. `flags`: the kernel publishes or polls a cross-rank flag (its
    PTX must show release stores / acquire loads at system scope)."""
    blocks = Blocks()
    tokens, hidden, topk = 128, 7168, 8  # of 256 experts
    num_scales = hidden // SCALE_BLOCK
    num_packed = (num_scales + SCALES_PER_PACK - 1) // SCALES_PER_PACK
    clocks = {"cuda": {"CLOCK": sync.CLOCK_CUDA_NS}, "hip": {"CLOCK": sync.CLOCK_HIP_100MHZ}}
    specs = [
        {
            "name": f"ll_wait_{'peer' if peer_area else 'own'}_area",
            "fn": _wait_kernel,
            "signature": {
                "table": "*i64", "poison_table": "*i64", "status_ptr": "*i64", "rank": "i32", "num_ranks": "i32",
                "first": "i32", "last": "i32", "offset": "i64", "stride": "i32", "target": "i64", "bound": "i64",
                "phase": "i32", "PEER_AREA": "constexpr", "CLOCK": "constexpr",
            },
            "constexprs": {"PEER_AREA": peer_area, "CLOCK": sync.CLOCK_SPINS},
            "backend_constexprs": clocks,
            "flags": True,
        }
        for peer_area in (True, False)
    ]  # fmt: skip
    specs.append({
        "name": "ll_enter",
        "fn": _enter_kernel,
        "signature": {"table": "*i64", "rank": "i32", "offset": "i64", "seq": "i64"},
        "constexprs": {},
        "flags": True,
    })  # fmt: skip
    specs.append({
        "name": "ll_poison_peers",
        "fn": _poison_peers_kernel,
        "signature": {"poison_table": "*i64", "rank": "i32", "num_ranks": "i32", "code": "i64"},
        "constexprs": {},
        "flags": True,
    })  # fmt: skip
    specs.append({
        "name": "ll_bf16_round",
        "fn": _bf16_round_kernel,
        "signature": {"x_ptr": "*fp32", "bits_ptr": "*i16", "n": "i32", "BLOCK": "constexpr"},
        "constexprs": {"BLOCK": 1024},
        "flags": False,
    })  # fmt: skip
    dispatch_signature = {
        "x_ptr": "*bf16", "x_stride": "i32", "topk_ptr": "*i64", "num_tokens": "i32", "num_topk": "i32",
        "table": "*i64", "rank": "i32", "seq": "i64", "half_offset": "i64", "signal_offset": "i64",
        "counter_offset": "i64", "token_list": "*i32", "send_done": "*i32", "signature": "*i64", "status": "*i32",
        "num_local": "i32", "num_max_tokens": "i32", "hidden": "i32", "num_scales": "i32", "num_packed": "i32",
        "OFF_LAYOUT_RANGE": "i64", "OFF_SRC_INFO": "i64", "OFF_SCALES": "i64", "OFF_RECV_X": "i64",
        "USE_FP8": "constexpr", "ROUND_SCALE": "constexpr", "USE_UE8M0": "constexpr", "BLOCK_T": "constexpr",
        "BLOCK_K": "constexpr", "BLOCK_ROWS": "constexpr", "BLOCK_H": "constexpr", "BLOCK_SB": "constexpr",
    }  # fmt: skip
    for name, (use_fp8, round_scale, ue8m0) in {"bf16": (False, False, False), "fp8": (True, False, False),
                                             "fp8_ue8m0": (True, True, True)}.items():  # fmt: skip
        specs.append({
            "name": f"ll_dispatch_send_{name}",
            "fn": _dispatch_send_kernel,
            "signature": dispatch_signature,
            "constexprs": {
                "USE_FP8": use_fp8, "ROUND_SCALE": round_scale, "USE_UE8M0": ue8m0, "BLOCK_T": tokens,
                "BLOCK_K": topk, "BLOCK_ROWS": blocks.rows, "BLOCK_H": blocks.hidden,
                "BLOCK_SB": min(blocks.scale_blocks, triton.next_power_of_2(SCALES_PER_PACK * num_packed)),
            },
            "flags": True,
            # The FP8 cast's tile once held a whole row (255 registers on sm_90): now [1, 4, 128] per step.
            "max_registers": 128,
        })  # fmt: skip
    specs.append({
        "name": "ll_dispatch_finish",
        "fn": _dispatch_finish_kernel,
        "signature": {
            "table": "*i64", "rank": "i32", "num_ranks": "i32", "half_offset": "i64", "counter_offset": "i64",
            "recv_count": "*i32", "src_info_out": "*i32", "layout_range_out": "*i64", "stats": "*i32",
            "rows_per_expert": "i32", "OFF_LAYOUT_RANGE": "i64", "OFF_SRC_INFO": "i64", "HAS_STATS": "constexpr",
            "BLOCK_R": "constexpr", "BLOCK_S": "constexpr",
        },
        "constexprs": {"HAS_STATS": True, "BLOCK_R": 8, "BLOCK_S": blocks.src_info},
        "flags": False,
    })  # fmt: skip
    specs.append({
        "name": "ll_combine_send",
        "fn": _combine_send_kernel,
        "signature": {
            "x_ptr": "*bf16", "src_info": "*i32", "layout_range": "*i64", "table": "*i64", "rank": "i32",
            "seq": "i64", "half_offset": "i64", "signal_offset": "i64", "send_done": "*i32", "signature": "*i64",
            "num_ranks": "i32", "num_max_tokens": "i32", "hidden": "i32", "OFF_COMBINE_RECV": "i64",
            "BLOCK_T": "constexpr", "BLOCK_H": "constexpr",
        },
        "constexprs": {"BLOCK_T": blocks.rows, "BLOCK_H": blocks.hidden},
        "flags": True,
    })  # fmt: skip
    specs.append({
        "name": "ll_combine_reduce",
        "fn": _combine_reduce_kernel,
        "signature": {
            "table": "*i64", "rank": "i32", "half_offset": "i64", "topk_ptr": "*i64", "weights_ptr": "*fp32",
            "out_bits": "*i16", "num_tokens": "i32", "num_topk": "i32", "num_max_tokens": "i32", "hidden": "i32",
            "OFF_COMBINE_RECV": "i64", "BLOCK_T": "constexpr", "BLOCK_H": "constexpr",
        },
        "constexprs": {"BLOCK_T": blocks.reduce_tokens, "BLOCK_H": blocks.reduce_hidden},
        "flags": False,
    })  # fmt: skip
    return specs


AOT_SPECS: list[dict] = _aot_specs()
