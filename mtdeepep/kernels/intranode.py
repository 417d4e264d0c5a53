"""Normal-mode dispatch and combine between the ranks of one node, in Triton.

Every rank's normal region is its data area (the `num_nvl_bytes` users see through `get_local_buffer_tensor`),
followed by a control area (`NormalLayout`: the poison word, five flag arrays, the mailbox of the count exchange).
An operation moves in rounds when the receivers' data areas cannot hold all its rows at once (as the CPU executor
stages them; one round when they can):

- dispatch: the counts exchange (`sync.exchange_kernel`, phase notify: every rank's row counts, its per-expert counts
  and its channel counts for each receiver, and a signature of the call) doubles as the entry barrier. In each round
  every sender writes the rows of that round (rows `[lo, lo + capacity)` of each receiver's output order) into each
  receiver's data area (`dispatch_send_kernel`, the round's rows picked by the host through `send_head` and
  `recv_offset`), signals, and waits for every sender (phase dispatch receive); the receiver copies its rows out of
  its own area, and every rank signals that before the next round writes (the round flags).
- combine: a barrier exchange with the call's signature (phase barrier), then, round by round, each rank sends the
  received rows back into their source's data area at the source's position for them (`combine_send_kernel`),
  signals and waits (phase combine receive); each source sums the rows of every token in rank order in FP32, then
  the biases, and rounds once (`combine_reduce_kernel`), as the CPU executor does (over several rounds: each round's
  FP32 partial sums are added in FP32 and rounded once at the end).

The data area's layout depends only on the traffic matrix every rank holds after the exchange, so every rank agrees
on every receiver's field offsets without another exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_LOCAL_EXPERTS = 1024  # experts one rank may own (bounds the mailbox slot)
MAX_CHANNELS = 128  # channels of the handle's channel prefix matrices (as the CPU executor)
SIGNATURE_WORDS = 16  # int32 words of a call's signature in the exchange
ALIGNMENT = 4096


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class NormalLayout:
    """Byte offsets of the control area of a normal region; they depend on the rank count only (every rank agrees).
    Flags: `notify_flags` and `barrier_flags` take the operation's exchange number; `dispatch_flags` (rows written),
    `combine_flags` (rows written) and `round_flags` (a staging round consumed) take step numbers, one per round.
    The notify payload of rank i for rank j: `[signature (16) | rows i sends to every rank (R) | i's token counts of
    j's experts (MAX_LOCAL_EXPERTS) | i's channel counts for j (MAX_CHANNELS)]` int32."""

    num_ranks: int
    poison: int = 0
    notify_flags: int = 0
    barrier_flags: int = 0
    dispatch_flags: int = 0
    combine_flags: int = 0
    round_flags: int = 0
    mailbox: int = 0
    slot_words: int = 0
    control_bytes: int = 0

    @staticmethod
    def of(num_ranks: int) -> NormalLayout:
        flags = _align(8 * num_ranks, 64)
        slot_words = SIGNATURE_WORDS + num_ranks + MAX_LOCAL_EXPERTS + MAX_CHANNELS
        slot_bytes = _align(4 * slot_words, 64)
        mailbox = 64 + 5 * flags
        return NormalLayout(
            num_ranks=num_ranks, poison=0, notify_flags=64, barrier_flags=64 + flags, dispatch_flags=64 + 2 * flags,
            combine_flags=64 + 3 * flags, round_flags=64 + 4 * flags, mailbox=mailbox, slot_words=slot_words,
            control_bytes=_align(mailbox + 2 * num_ranks * slot_bytes, ALIGNMENT),
        )  # fmt: skip

    @property
    def slot_bytes(self) -> int:
        return _align(4 * self.slot_words, 64)


@dataclass(frozen=True)
class RowFields:
    """Where the fields of `capacity` rows lie in a data area (byte offsets from its start, 16-byte aligned): the
    same for every receiver of one operation (the capacity is the largest receiver's)."""

    capacity: int
    x: int
    scales: int
    topk_idx: int
    topk_weights: int
    src_idx: int
    total_bytes: int

    @staticmethod
    def of(capacity: int, x_bytes: int, scale_bytes: int, num_topk: int, with_src: bool = True) -> RowFields:
        offset = 0

        def take(row_bytes: int) -> int:
            nonlocal offset
            at = offset
            offset = _align(offset + row_bytes * capacity, 16)
            return at

        x = take(x_bytes)
        scales = take(scale_bytes)
        topk_idx = take(8 * num_topk)
        topk_weights = take(4 * num_topk)
        src_idx = take(4 if with_src else 0)
        return RowFields(capacity, x, scales, topk_idx, topk_weights, src_idx, offset)


def word_view(rows: torch.Tensor) -> torch.Tensor:
    """`rows [N, W]` (any dtype, contiguous) as the widest integer words its row size allows: rows move as bytes,
    whatever they hold (bf16, FP8, packed scales)."""
    raw = rows.contiguous().view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if raw.size(1) % size == 0:
            return raw.view(dtype)
    return raw


@triton.jit
def _peer_rows(table, peer, offset, row, row_bytes, DTYPE: tl.constexpr):
    # [BLOCK] pointers to `row` (a block) of the field at byte `offset` of rank `peer`'s data area.
    return (tl.load(table + peer) + offset + row * row_bytes).to(tl.pointer_type(DTYPE))


@triton.jit
def dispatch_send_kernel(region_table, data_offset, x, x_stride, num_words, scales, scale_stride0, scale_stride1,
                         num_scales, topk_idx, topk_weights, send_head, recv_offset, num_tokens, num_ranks,
                         experts_per_rank, off_x, off_scales, off_idx, off_weights, off_src, token_base,
                         HAS_SCALES: tl.constexpr, NUM_TOPK: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr,
                         TOPK: tl.constexpr):  # fmt: skip
    """One program per `BLOCK_T` tokens, every receiver: token t goes to rank j's row `recv_offset[j] +
    send_head[t, j]` when `send_head[t, j] >= 0`. `x [T, num_words]` integer words (row stride `x_stride` words),
    `scales` 32-bit words with strides, `topk_idx [T, NUM_TOPK]` int64 (global ids; each receiver gets its local
    ids, -1 elsewhere, weights 0 there), the source index int32 (`token_base` + t: the tokens may be a window of
    the caller's, for a staging round). No wait: the host's next launch signals."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_mask = tokens < num_tokens
    word_bytes = x.dtype.element_ty.primitive_bitwidth // 8
    row_bytes = num_words * word_bytes
    topk = tl.arange(0, TOPK)
    topk_mask = (tokens[:, None] < num_tokens) & (topk[None, :] < NUM_TOPK)
    if NUM_TOPK > 0:
        expert = tl.load(topk_idx + tokens[:, None] * NUM_TOPK + topk[None, :], mask=topk_mask, other=-1)
        if HAS_WEIGHTS:
            weight = tl.load(topk_weights + tokens[:, None] * NUM_TOPK + topk[None, :], mask=topk_mask, other=0.0)
    for j in range(num_ranks):
        position = tl.load(send_head + tokens * num_ranks + j, mask=token_mask, other=-1)
        sent = position >= 0
        row = (tl.load(recv_offset + j) + position).to(tl.int64)
        base = data_offset + off_x
        for w0 in range(0, num_words, BLOCK_W):
            words = w0 + tl.arange(0, BLOCK_W)
            mask = (position[:, None] >= 0) & (words[None, :] < num_words)
            values = tl.load(x + tokens[:, None] * x_stride + words[None, :], mask=mask)
            dst = _peer_rows(region_table, j, base, row, row_bytes, x.dtype.element_ty)
            tl.store(dst[:, None] + words[None, :], values, mask=mask)
        if HAS_SCALES:
            s = tl.arange(0, BLOCK_S)
            mask = (position[:, None] >= 0) & (s[None, :] < num_scales)
            values = tl.load(scales + tokens[:, None] * scale_stride0 + s[None, :] * scale_stride1, mask=mask)
            dst = _peer_rows(region_table, j, data_offset + off_scales, row, num_scales * 4, tl.int32)
            tl.store(dst[:, None] + s[None, :], values, mask=mask)
        if NUM_TOPK > 0:
            local = expert - j * experts_per_rank
            is_local = (expert >= 0) & (local >= 0) & (local < experts_per_rank)
            mask = (position[:, None] >= 0) & (topk[None, :] < NUM_TOPK)
            dst = _peer_rows(region_table, j, data_offset + off_idx, row, NUM_TOPK * 8, tl.int64)
            tl.store(dst[:, None] + topk[None, :], tl.where(is_local, local, -1), mask=mask)
            if HAS_WEIGHTS:
                dst = _peer_rows(region_table, j, data_offset + off_weights, row, NUM_TOPK * 4, tl.float32)
                tl.store(dst[:, None] + topk[None, :], tl.where(is_local, weight, 0.0), mask=mask)
        dst = _peer_rows(region_table, j, data_offset + off_src, row, 4, tl.int32)
        tl.store(dst, (tokens + token_base).to(tl.int32), mask=sent)


@triton.jit
def combine_send_kernel(region_table, data_offset, x, num_words, weights, dst_rank, dst_row, num_rows, off_x,
                        off_weights, NUM_TOPK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                        TOPK: tl.constexpr):  # fmt: skip
    """One program per `BLOCK_R` received rows: row r (integer words of `x [N, num_words]`, contiguous) and its
    `weights [N, NUM_TOPK]` float32 go back to rank `dst_rank[r]`, row `dst_row[r]` of its data area."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_mask = rows < num_rows
    word_bytes = x.dtype.element_ty.primitive_bitwidth // 8
    peer = tl.load(dst_rank + rows, mask=row_mask, other=0)
    target = tl.load(dst_row + rows, mask=row_mask, other=0).to(tl.int64)
    base = tl.load(region_table + peer, mask=row_mask, other=0) + data_offset
    for w0 in range(0, num_words, BLOCK_W):
        words = w0 + tl.arange(0, BLOCK_W)
        mask = (rows[:, None] < num_rows) & (words[None, :] < num_words)
        values = tl.load(x + rows[:, None] * num_words + words[None, :], mask=mask)
        dst = (base + off_x + target * (num_words * word_bytes)).to(tl.pointer_type(x.dtype.element_ty))
        tl.store(dst[:, None] + words[None, :], values, mask=mask)
    if NUM_TOPK > 0:
        topk = tl.arange(0, TOPK)
        mask = (rows[:, None] < num_rows) & (topk[None, :] < NUM_TOPK)
        values = tl.load(weights + rows[:, None] * NUM_TOPK + topk[None, :], mask=mask)
        dst = (base + off_weights + target * (NUM_TOPK * 4)).to(tl.pointer_type(tl.float32))
        tl.store(dst[:, None] + topk[None, :], values, mask=mask)


@triton.jit
def bf16_bits(value):
    """FP32 -> bf16 bits (int16), rounded to nearest even on the integer bits, NaN kept quiet: the CPU executor's
    rounding. Not `.to(tl.bfloat16)`: Triton's interpreter truncates there (half the values one ulp low)."""
    bits = value.to(tl.uint32, bitcast=True)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    result = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
    return result.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def combine_reduce_kernel(area_x, area_weights, send_head, send_offset, num_tokens, num_ranks, hidden, bias0, bias1,
                          out, out_weights, OUT_BF16: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr,
                          NUM_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                          TOPK: tl.constexpr):  # fmt: skip
    """One program per `BLOCK_T` tokens (local): token t's output is the FP32 sum, in rank order, of the rows rank j
    sent back (row `send_offset[j] + send_head[t, j]` of this rank's area, when >= 0), then `bias0`, then `bias1`,
    rounded once to the output's dtype (`OUT_BF16`: `out` is the bf16 output viewed as int16, see `bf16_bits`); its
    weights the FP32 sum of the rows' weights in rank order."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_mask = tokens < num_tokens
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        col_mask = (tokens[:, None] < num_tokens) & (h[None, :] < hidden)
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j in range(num_ranks):
            position = tl.load(send_head + tokens * num_ranks + j, mask=token_mask, other=-1)
            row = (tl.load(send_offset + j) + position).to(tl.int64)
            mask = (position[:, None] >= 0) & (h[None, :] < hidden)
            acc += tl.load(area_x + row[:, None] * hidden + h[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS0:
            acc += tl.load(bias0 + tokens[:, None] * hidden + h[None, :], mask=col_mask, other=0.0).to(tl.float32)
        if HAS_BIAS1:
            acc += tl.load(bias1 + tokens[:, None] * hidden + h[None, :], mask=col_mask, other=0.0).to(tl.float32)
        if OUT_BF16:
            result = bf16_bits(acc)
        else:
            result = acc.to(out.dtype.element_ty)
        tl.store(out + tokens[:, None] * hidden + h[None, :], result, mask=col_mask)
    if NUM_TOPK > 0:
        topk = tl.arange(0, TOPK)
        acc_w = tl.zeros([BLOCK_T, TOPK], dtype=tl.float32)
        for j in range(num_ranks):
            position = tl.load(send_head + tokens * num_ranks + j, mask=token_mask, other=-1)
            row = (tl.load(send_offset + j) + position).to(tl.int64)
            mask = (position[:, None] >= 0) & (topk[None, :] < NUM_TOPK)
            acc_w += tl.load(area_weights + row[:, None] * NUM_TOPK + topk[None, :], mask=mask, other=0.0)
        mask = (tokens[:, None] < num_tokens) & (topk[None, :] < NUM_TOPK)
        tl.store(out_weights + tokens[:, None] * NUM_TOPK + topk[None, :], acc_w, mask=mask)


def _row_blocks(num_rows: int, row_width: int, interpreted: bool, interpreted_rows: int = 64) -> tuple[int, int]:
    """`(BLOCK rows, BLOCK columns)` of the launchers' kernels over `[num_rows, row_width]` rows: under the
    interpreter up to `interpreted_rows` whole rows per program, on a GPU 4 rows of at most 1024 columns."""
    if interpreted:
        return min(interpreted_rows, triton.next_power_of_2(num_rows)), triton.next_power_of_2(row_width)
    return 4, min(1024, triton.next_power_of_2(row_width))


def launch_dispatch_send(region_table, data_offset, x_words, scales, topk_idx, topk_weights, send_head, recv_offset,
                         num_ranks, experts_per_rank, fields: RowFields, interpreted: bool,
                         token_base: int = 0) -> None:  # fmt: skip
    """Writes this rank's rows into every receiver's data area (see `dispatch_send_kernel`; the tokens are the
    caller's tokens `token_base + t`). The host's index tensors may be CPU tensors: they move to the table's device."""
    recv_offset = recv_offset.to(region_table.device)
    num_tokens, num_words = x_words.shape
    if num_tokens == 0:
        return
    num_topk = 0 if topk_idx is None else topk_idx.size(1)
    block_t, block_w = _row_blocks(num_tokens, num_words, interpreted)
    scale_words = None if scales is None else scales.view(torch.int32) if scales.element_size() == 4 else None
    if scales is not None and scale_words is None:
        raise ValueError("mtdeepep: the Triton executor moves 4-byte scales (float32 or packed UE8M0)")
    dummy = x_words
    dispatch_send_kernel[(triton.cdiv(num_tokens, block_t),)](
        region_table, data_offset, x_words, x_words.stride(0), num_words,
        dummy if scale_words is None else scale_words,
        0 if scale_words is None else scale_words.stride(0), 0 if scale_words is None else scale_words.stride(1),
        0 if scale_words is None else scale_words.size(1),
        dummy if topk_idx is None else topk_idx, dummy if topk_weights is None else topk_weights,
        send_head, recv_offset, num_tokens, num_ranks, experts_per_rank,
        fields.x, fields.scales, fields.topk_idx, fields.topk_weights, fields.src_idx, token_base,
        HAS_SCALES=scale_words is not None, NUM_TOPK=num_topk, HAS_WEIGHTS=topk_weights is not None,
        BLOCK_T=block_t, BLOCK_W=block_w,
        BLOCK_S=triton.next_power_of_2(max(1, 0 if scale_words is None else scale_words.size(1))),
        TOPK=triton.next_power_of_2(max(1, num_topk)),
    )  # fmt: skip


def launch_combine_send(region_table, data_offset, x_words, weights, dst_rank, dst_row, fields: RowFields,
                        interpreted: bool) -> None:  # fmt: skip
    """Sends every received row (and its weights) back to its source (see `combine_send_kernel`); `dst_rank` and
    `dst_row` may be CPU tensors (they move to the table's device)."""
    dst_rank, dst_row = dst_rank.to(region_table.device), dst_row.to(region_table.device)
    num_rows, num_words = x_words.shape
    if num_rows == 0:
        return
    num_topk = 0 if weights is None else weights.size(1)
    block_r, block_w = _row_blocks(num_rows, num_words, interpreted)
    combine_send_kernel[(triton.cdiv(num_rows, block_r),)](
        region_table, data_offset, x_words, num_words, x_words if weights is None else weights, dst_rank, dst_row,
        num_rows, fields.x, fields.topk_weights, NUM_TOPK=num_topk, BLOCK_R=block_r, BLOCK_W=block_w,
        TOPK=triton.next_power_of_2(max(1, num_topk)),
    )  # fmt: skip


def launch_combine_reduce(area_x, area_weights, send_head, send_offset, bias0, bias1, out, out_weights,
                          interpreted: bool) -> None:  # fmt: skip
    """Sums the rows sent back per token (see `combine_reduce_kernel`); `send_offset` may be a CPU tensor."""
    send_offset = send_offset.to(out.device)
    num_tokens, hidden = out.shape
    if num_tokens == 0:
        return
    num_ranks = send_head.size(1)
    num_topk = 0 if out_weights is None else out_weights.size(1)
    block_t, block_h = _row_blocks(num_tokens, hidden, interpreted, interpreted_rows=32)
    combine_reduce_kernel[(triton.cdiv(num_tokens, block_t),)](
        area_x, out if area_weights is None else area_weights, send_head, send_offset, num_tokens, num_ranks,
        hidden, out if bias0 is None else bias0, out if bias1 is None else bias1,
        out.view(torch.int16) if out.dtype == torch.bfloat16 else out, out if out_weights is None else out_weights,
        OUT_BF16=out.dtype == torch.bfloat16, HAS_BIAS0=bias0 is not None, HAS_BIAS1=bias1 is not None,
        NUM_TOPK=num_topk, BLOCK_T=block_t, BLOCK_H=block_h, TOPK=triton.next_power_of_2(max(1, num_topk)),
    )  # fmt: skip


# Ahead-of-time compile specs (mtdeepep.kernels.aot): hidden 7168 (3584 int32 words of bf16, 1792 of FP8 with 56
# scales), top-8, the GPU blocks of the launchers above.
AOT_SPECS = [
    *(
        {
            "name": f"intranode.dispatch_send_{kind}",
            "fn": dispatch_send_kernel,
            "signature": {
                "region_table": "*i64",
                "data_offset": "i64",
                "x": "*i32",
                "x_stride": "i64",
                "num_words": "i32",
                "scales": "*i32",
                "scale_stride0": "i64",
                "scale_stride1": "i64",
                "num_scales": "i32",
                "topk_idx": "*i64",
                "topk_weights": "*fp32",
                "send_head": "*i32",
                "recv_offset": "*i32",
                "num_tokens": "i32",
                "num_ranks": "i32",
                "experts_per_rank": "i32",
                "off_x": "i64",
                "off_scales": "i64",
                "off_idx": "i64",
                "off_weights": "i64",
                "off_src": "i64",
                "token_base": "i32",
                "HAS_SCALES": "constexpr",
                "NUM_TOPK": "constexpr",
                "HAS_WEIGHTS": "constexpr",
                "BLOCK_T": "constexpr",
                "BLOCK_W": "constexpr",
                "BLOCK_S": "constexpr",
                "TOPK": "constexpr",
            },  # fmt: skip
            "constexprs": {
                "HAS_SCALES": fp8,
                "NUM_TOPK": 8,
                "HAS_WEIGHTS": True,
                "BLOCK_T": 4,
                "BLOCK_W": 1024,
                "BLOCK_S": 64,
                "TOPK": 8,
            },  # fmt: skip
            "flags": False,
        }
        for kind, fp8 in (("bf16", False), ("fp8", True))
    ),
    {
        "name": "intranode.combine_send",
        "fn": combine_send_kernel,
        "signature": {
            "region_table": "*i64",
            "data_offset": "i64",
            "x": "*i32",
            "num_words": "i32",
            "weights": "*fp32",
            "dst_rank": "*i32",
            "dst_row": "*i32",
            "num_rows": "i32",
            "off_x": "i64",
            "off_weights": "i64",
            "NUM_TOPK": "constexpr",
            "BLOCK_R": "constexpr",
            "BLOCK_W": "constexpr",
            "TOPK": "constexpr",
        },  # fmt: skip
        "constexprs": {"NUM_TOPK": 8, "BLOCK_R": 4, "BLOCK_W": 1024, "TOPK": 8},
        "flags": False,
    },
    {
        "name": "intranode.combine_reduce_bf16",
        "fn": combine_reduce_kernel,
        "signature": {
            "area_x": "*bf16",
            "area_weights": "*fp32",
            "send_head": "*i32",
            "send_offset": "*i32",
            "num_tokens": "i32",
            "num_ranks": "i32",
            "hidden": "i32",
            "bias0": "*bf16",
            "bias1": "*bf16",
            "out": "*i16",
            "out_weights": "*fp32",
            "OUT_BF16": "constexpr",
            "HAS_BIAS0": "constexpr",
            "HAS_BIAS1": "constexpr",
            "NUM_TOPK": "constexpr",
            "BLOCK_T": "constexpr",
            "BLOCK_H": "constexpr",
            "TOPK": "constexpr",
        },  # fmt: skip
        "constexprs": {
            "OUT_BF16": True,
            "HAS_BIAS0": True,
            "HAS_BIAS1": False,
            "NUM_TOPK": 8,
            "BLOCK_T": 4,
            "BLOCK_H": 1024,
            "TOPK": 8,
        },  # fmt: skip
        "flags": False,
    },
]
