"""FP8 (E4M3) casts in Triton: the element cast, DeepEP's per-token 1x128 cast and its inverse.

Every result is bit-identical to torch and to the project's quantiser `mtdeepep/utils/fp8.py`:

- `e4m3_bits_from_f32(x)`: the element cast float32 -> `torch.float8_e4m3fn` bits (uint8), written with integer
  operations on the float32 bits so that it rounds the same on every backend: round to nearest even, subnormals
  below 2^-6 on a grid of 2^-9, magnitudes of 480 and above (inf included) and NaN to NaN (0x7F with the sign), as
  torch's `c10::Float8_e4m3fn` does. It saturates nothing: the block cast clamps to +-448 before it, as torch's
  quantiser does. Triton's own `.to(tl.float8e4nv)` is not used: the interpreter rounds it wrongly (about 5% of
  values, a lost rounding carry), and a cast that differs by backend could not be proven on a CPU.
- `f32_from_e4m3_bits(b)`: the exact inverse for every finite pattern (NaN patterns give a quiet NaN).
- `per_token_cast_to_fp8(x)`: `[T, H]` bf16 / fp16 / fp32 -> `(e4m3 [T, H], float32 scales [T, H/128])`,
  `scale = max(amax, 1e-4) / 448` per token and 128 channels, `e4m3 = cast(clamp(x / scale, -448, 448))`. With
  `round_scale` the scale is rounded up to a power of two (UE8M0-representable) exactly, on its bits; the reference's
  `exp2(ceil(log2(scale)))` agrees with that on every scale a bf16 / fp16 input can produce, but for float32 input it
  rounds down the few scales within 4 ulps above a power of two (torch's float32 `log2` returns the power itself), so
  there the kernel gives the larger, correct power of two. Inputs are finite (an inf or NaN poisons its block as in
  torch, but the kernel does not promise torch's exact NaN placement).
- `per_token_cast_back(e4m3, scales)`: `[T, H]` float32, `e4m3 * scale`.

The device functions `quantize_blocks`, `e4m3_bits_from_f32`, `f32_from_e4m3_bits`, `block_scale` and
`ceil_pow2_f32` are imported by the kernels that cast on the way (low-latency dispatch).

Legend: T tokens, H hidden, G = H / 128 channel groups, R the rows of a block: (token, group) pairs of 128 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtdeepep.utils.fp8 import AMAX_FLOOR, FP8_BLOCK, FP8_DTYPE, FP8_E4M3_MAX

# Production block: 32 (token, group) rows of 128 channels, 4096 values per program.
CAST_BLOCK_ROWS = 32
ELEMENT_BLOCK = 4096
NUM_WARPS = 8  # 16 values per thread: the integer cast's temporaries stay well inside the register file

# Constants the kernels read (a kernel sees globals only as constexprs).
_SATURATE_FROM_BITS = tl.constexpr(0x43F00000)  # float32 bits of 480: |x| >= 480 (inf too) saturates to 448
_MIN_NORMAL_BITS = tl.constexpr(121 << 23)  # float32 bits of 2^-6, E4M3's smallest normal: below it, subnormals
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def e4m3_bits_from_f32(x):
    """float32 block -> the `torch.float8_e4m3fn` bit patterns of `x.to(float8_e4m3fn)`, as uint8."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal results: move the exponent from bias 127 to bias 7 and round the 23-bit mantissa to 3 bits, to nearest
    # even (add 0x7FFFF plus the lowest kept bit, then drop 20 bits).
    odd = (mag >> 20) & 1
    normal = (mag + (-120 << 23) + 0x7FFFF + odd) >> 20
    # Subnormal results: |x| in units of 2^-9 (the E4M3 subnormal step), rounded to nearest even. The 24-bit
    # significand sits at 2^(exponent - 150), so the shift is 141 - exponent (at least 21 here); a shift of 25
    # already leaves nothing, and float32 subnormals (exponent 0, no implicit bit) land there too.
    exponent = mag >> 23
    significand = (mag & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    shift = tl.minimum(141 - tl.maximum(exponent, 1), 25)
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    subnormal = kept + round_up.to(tl.int32)
    # Past the range: NaN stays NaN (0x7F); inf and every finite |x| that rounds past 448 saturate to 448 (0x7E),
    # the rounding carry into 0x7F included.
    in_range = tl.where(mag < _MIN_NORMAL_BITS, subnormal, tl.minimum(normal, 0x7E))
    result = tl.where(mag > 0x7F800000, 0x7F, tl.where(mag >= _SATURATE_FROM_BITS, 0x7E, in_range))
    return (result | sign).to(tl.uint8)


@triton.jit
def f32_from_e4m3_bits(b):
    """uint8 block of `float8_e4m3fn` bit patterns -> float32 (exact; the NaN patterns 0x7F / 0xFF give NaN)."""
    b32 = b.to(tl.int32)
    sign = (b32 & 0x80) << 24
    exponent = (b32 >> 3) & 0xF
    mantissa = b32 & 0x7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # mantissa * 2^-9, exact
    is_nan = (exponent == 15) & (mantissa == 7)
    bits = tl.where(is_nan, 0x7FC00000, tl.where(exponent == 0, subnormal, normal))
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def ceil_pow2_f32(x):
    """Positive normal float32 block -> the smallest power of two >= x, exactly (on the bits: a non-zero mantissa
    moves the exponent up one)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent_bits = bits & 0x7F800000
    rounded = tl.where((bits & 0x7FFFFF) != 0, exponent_bits + 0x800000, exponent_bits)
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def block_scale(amax, ROUND_SCALE: tl.constexpr):
    """The float32 scale of a block from its float32 `amax`: `max(amax, 1e-4) / 448`, rounded up to a power of two
    with `ROUND_SCALE`."""
    # Correctly rounded divisions (`/` is an approximate division on NVIDIA: `div.full.f32`), as torch's.
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), tl.full(amax.shape, _E4M3_MAX, tl.float32))
    if ROUND_SCALE:
        scale = ceil_pow2_f32(scale)
    return scale


@triton.jit
def quantize_blocks(x, ROUND_SCALE: tl.constexpr):
    """float32 `x [..., 128]`, one block of 128 values per last-axis row -> `(e4m3 bits [..., 128] uint8, float32
    scales [...])`: `scale = block_scale(amax)`, `bits = cast(clamp(x / scale, -448, 448))` (an exact division)."""
    scale = block_scale(tl.max(tl.abs(x), axis=len(x.shape) - 1), ROUND_SCALE)
    scaled = tl.math.div_rn(x, tl.broadcast_to(tl.expand_dims(scale, len(x.shape) - 1), x.shape))
    return e4m3_bits_from_f32(tl.minimum(tl.maximum(scaled, -_E4M3_MAX), _E4M3_MAX)), scale


@triton.jit
def _group_rows(num_rows, groups, BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
    """This program's BLOCK_R (token, group) rows of 128 channels: `(token int64 [BLOCK_R], channel offset of the
    group [BLOCK_R], row mask [BLOCK_R], element mask [BLOCK_R, GROUP], channels [GROUP])`."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # int32: T * G < 2^31
    row_ok = rows < num_rows
    cols = tl.arange(0, GROUP)
    mask = row_ok[:, None] & (cols[None, :] < GROUP)
    return (rows // groups).to(tl.int64), (rows % groups) * GROUP, row_ok, mask, cols


@triton.jit
def _cast_elements_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, e4m3_bits_from_f32(x), mask=mask)


@triton.jit
def _per_token_cast_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    num_rows,
    groups,
    x_stride,
    q_stride,
    scale_stride_t,
    scale_stride_g,
    ROUND_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
):
    # One program: BLOCK_R rows, each the 128 channels of one (token, group); a scale per row.
    token, column, row_ok, mask, cols = _group_rows(num_rows, groups, BLOCK_R, GROUP)
    x = tl.load(x_ptr + (token * x_stride + column)[:, None] + cols[None, :], mask=mask, other=0.0)
    bits, scale = quantize_blocks(x.to(tl.float32), ROUND_SCALE)
    tl.store(q_ptr + (token * q_stride + column)[:, None] + cols[None, :], bits, mask=mask)
    tl.store(scale_ptr + token * scale_stride_t + (column // GROUP) * scale_stride_g, scale, mask=row_ok)


@triton.jit
def _per_token_cast_back_kernel(
    q_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    groups,
    q_stride,
    out_stride,
    scale_stride_t,
    scale_stride_g,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
):
    token, column, row_ok, mask, cols = _group_rows(num_rows, groups, BLOCK_R, GROUP)
    q = tl.load(q_ptr + (token * q_stride + column)[:, None] + cols[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + token * scale_stride_t + (column // GROUP) * scale_stride_g, mask=row_ok, other=1.0)
    out = f32_from_e4m3_bits(q) * scale[:, None]
    tl.store(out_ptr + (token * out_stride + column)[:, None] + cols[None, :], out, mask=mask)


def _check_rows(x_TH: torch.Tensor, what: str) -> None:
    if x_TH.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D [tokens, hidden] tensor, got shape {tuple(x_TH.shape)}")
    if x_TH.size(1) % FP8_BLOCK:
        raise ValueError(f"{what}: hidden={x_TH.size(1)} must be a multiple of {FP8_BLOCK} for FP8")
    if x_TH.stride(1) != 1:
        raise ValueError(f"{what}: the hidden dimension must be contiguous (stride {x_TH.stride(1)})")


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x.to(torch.float8_e4m3fn)` by the Triton element cast (no scaling, no saturation: |x| >= 480 gives NaN as in
    torch). `x`: any shape, contiguous, float32 / bfloat16 / float16. Returns the same shape in float8_e4m3fn."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"cast_to_e4m3: expected float32, bfloat16 or float16, got {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    n = x.numel()
    if n:
        _cast_elements_kernel[(triton.cdiv(n, ELEMENT_BLOCK),)](
            x, out.view(torch.uint8), n, BLOCK=ELEMENT_BLOCK, num_warps=NUM_WARPS
        )
    return out


def per_token_cast_to_fp8(
    x_TH: torch.Tensor, round_scale: bool = False, block_rows: int = CAST_BLOCK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-token, per-128-channel E4M3 cast in one kernel.

    Args:
        x_TH: `[T, H]` bfloat16, float16 or float32, `H` a multiple of 128, the last dimension contiguous; finite.
        round_scale: round each scale up to a power of two (UE8M0-representable).
        block_rows: (token, group) rows per program (a power of two).
    Returns:
        `(e4m3 [T, H] float8_e4m3fn, scales [T, H/128] float32)`, bit-identical to
        `mtdeepep.utils.fp8.per_token_cast_to_fp8` (see the module docstring for `round_scale` on float32 input).
    """
    _check_rows(x_TH, "per_token_cast_to_fp8")
    if x_TH.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"per_token_cast_to_fp8: expected float32, bfloat16 or float16, got {x_TH.dtype}")
    T, H = x_TH.shape
    groups = H // FP8_BLOCK
    q = torch.empty((T, H), dtype=FP8_DTYPE, device=x_TH.device)
    scales = torch.empty((T, groups), dtype=torch.float32, device=x_TH.device)
    rows = T * groups
    if rows:
        _per_token_cast_kernel[(triton.cdiv(rows, block_rows),)](
            x_TH, q.view(torch.uint8), scales, rows, groups, x_TH.stride(0), q.stride(0), scales.stride(0),
            scales.stride(1), ROUND_SCALE=round_scale, BLOCK_R=block_rows, GROUP=FP8_BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return q, scales


def per_token_cast_back(
    e4m3_TH: torch.Tensor, scales_TG: torch.Tensor, block_rows: int = CAST_BLOCK_ROWS
) -> torch.Tensor:
    """Inverse of `per_token_cast_to_fp8`: `[T, H]` float32 `e4m3 * scale`, bit-identical to
    `mtdeepep.utils.fp8.per_token_cast_back`. `scales_TG`: `[T, H/128]` float32 in either memory order."""
    _check_rows(e4m3_TH, "per_token_cast_back")
    if e4m3_TH.dtype != FP8_DTYPE:
        raise ValueError(f"per_token_cast_back: expected {FP8_DTYPE}, got {e4m3_TH.dtype}")
    T, H = e4m3_TH.shape
    groups = H // FP8_BLOCK
    if tuple(scales_TG.shape) != (T, groups) or scales_TG.dtype != torch.float32:
        raise ValueError(
            f"per_token_cast_back: scales must be [{T}, {groups}] float32, got {tuple(scales_TG.shape)} "
            f"{scales_TG.dtype}"
        )
    out = torch.empty((T, H), dtype=torch.float32, device=e4m3_TH.device)
    rows = T * groups
    if rows:
        _per_token_cast_back_kernel[(triton.cdiv(rows, block_rows),)](
            e4m3_TH.view(torch.uint8), scales_TG, out, rows, groups, e4m3_TH.stride(0), out.stride(0),
            scales_TG.stride(0), scales_TG.stride(1), BLOCK_R=block_rows, GROUP=FP8_BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    return out


# Ahead-of-time compile specs (mtdeepep.kernels.aot): the production block sizes.
AOT_SPECS = [
    {
        "name": "fp8.cast_elements",
        "fn": _cast_elements_kernel,
        "signature": {"x_ptr": "*bf16", "out_ptr": "*u8", "n": "i32", "BLOCK": "constexpr"},
        "constexprs": {"BLOCK": ELEMENT_BLOCK},
        "options": {"num_warps": NUM_WARPS},
        "flags": False,
    },
    *(
        {
            "name": f"fp8.per_token_cast_{dtype}{'_ue8m0' if round_scale else ''}",
            "fn": _per_token_cast_kernel,
            "signature": {
                "x_ptr": f"*{dtype}",
                "q_ptr": "*u8",
                "scale_ptr": "*fp32",
                "num_rows": "i32",
                "groups": "i32",
                "x_stride": "i64",
                "q_stride": "i64",
                "scale_stride_t": "i64",
                "scale_stride_g": "i64",
                "ROUND_SCALE": "constexpr",
                "BLOCK_R": "constexpr",
                "GROUP": "constexpr",
            },  # fmt: skip
            "constexprs": {"ROUND_SCALE": round_scale, "BLOCK_R": CAST_BLOCK_ROWS, "GROUP": FP8_BLOCK},
            "options": {"num_warps": NUM_WARPS},
            "flags": False,
        }
        for dtype in ("bf16", "fp32")
        for round_scale in (False, True)
    ),
    {
        "name": "fp8.per_token_cast_back",
        "fn": _per_token_cast_back_kernel,
        "signature": {
            "q_ptr": "*u8",
            "scale_ptr": "*fp32",
            "out_ptr": "*fp32",
            "num_rows": "i32",
            "groups": "i32",
            "q_stride": "i64",
            "out_stride": "i64",
            "scale_stride_t": "i64",
            "scale_stride_g": "i64",
            "BLOCK_R": "constexpr",
            "GROUP": "constexpr",
        },  # fmt: skip
        "constexprs": {"BLOCK_R": CAST_BLOCK_ROWS, "GROUP": FP8_BLOCK},
        "options": {"num_warps": NUM_WARPS},
        "flags": False,
    },
]

__all__ = [
    "AMAX_FLOOR",
    "FP8_E4M3_MAX",
    "block_scale",
    "cast_to_e4m3",
    "ceil_pow2_f32",
    "e4m3_bits_from_f32",
    "f32_from_e4m3_bits",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "quantize_blocks",
]
