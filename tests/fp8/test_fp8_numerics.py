"""FP8 casts and the FP8 linear / grouped linear against FP32: SQNR floors, exact emulation, delayed-scaling state.

SQNR floors. E4M3 has 3 mantissa bits: rounding to nearest leaves a relative error of at most 2^-4 and, for values
spread over a binade, an RMS relative error of about 2^-4 / sqrt(3) = 3.6%, i.e. ~29 dB for one quantisation of the
values in E4M3's normal range (measured 30-31 dB for Gaussian data). The floors below leave 4-6 dB for the tiles
whose scale is set by an outlier (their small values lose relative precision) and for power-of-two scales (up to
one bit of range lost): 25 dB for a cast. A GEMM multiplies two quantised operands whose errors add (about 3 dB
less: 28 dB measured), so GEMM outputs and gradients get 22 dB. An upper bound of 40 dB catches a path that
silently skipped the quantisation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe.layer.fp8 import (
    AmaxHistory,
    BlockwiseScaling,
    DelayedScaling,
    Fp8Caster,
    Fp8LinearFn,
    cast_blockwise,
    cast_per_tensor,
    fp8_grouped_linear,
)
from moe.layer.fp8.cast import amax_to_scale

CAST_FLOOR_DB = 25.0
GEMM_FLOOR_DB = 22.0
LOSSLESS_DB = 40.0

RECIPES = {
    "delayed": DelayedScaling(),
    "blockwise": BlockwiseScaling(),
    "blockwise_pow2": BlockwiseScaling(power_of_two_scales=True),
}


def sqnr_db(approx: torch.Tensor, ref: torch.Tensor) -> float:
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (approx - ref).pow(2).sum()))


def with_outliers(*shape: int, seed: int) -> torch.Tensor:
    """Gaussian values with 1% of them 30x larger (the activation outliers FP8 has to live with)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    mask = torch.rand(*shape, generator=gen) < 0.01
    return torch.where(mask, x * 30.0, x)


def ref_blockwise(x: torch.Tensor, tile: tuple[int, int], pow2: bool) -> torch.Tensor:
    """Independent block-wise fake quantisation (shapes multiple of the tile): reshape, amax, round through E4M3."""
    M, K = x.shape
    r, c = tile
    blocks = x.double().reshape(M // r, r, K // c, c)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4) / 448.0
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.float().double()
    q = (blocks / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
    return (q * scale).reshape(M, K)


# ---------------------------------------------------------------------------------------------------------------
# Casts


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize("tile", [(1, 128), (128, 128), (128, 1)], ids=["1x128", "128x128", "128x1"])
def test_blockwise_cast_sqnr_and_exact_rounding(tile, pow2):
    x = with_outliers(256, 384, seed=1)
    op = cast_blockwise(x, tile, pow2)
    assert op.q.dtype == torch.float8_e4m3fn and op.scale.dtype == torch.float32
    assert op.scale.shape == (256 // tile[0], 384 // tile[1])
    if pow2:
        assert torch.equal(op.scale, torch.exp2(torch.round(torch.log2(op.scale))))
    deq = op.dequantize()
    torch.testing.assert_close(deq.double(), ref_blockwise(x, tile, pow2), rtol=1e-6, atol=0)
    assert CAST_FLOOR_DB < sqnr_db(deq, x) < LOSSLESS_DB


def test_per_tensor_cast_sqnr_and_saturation():
    x = with_outliers(256, 384, seed=2)
    scale = amax_to_scale(x.abs().amax())
    op = cast_per_tensor(x, scale)
    expected = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    torch.testing.assert_close(op.dequantize(), expected, rtol=0, atol=0)
    assert CAST_FLOOR_DB < sqnr_db(op.dequantize(), x) < LOSSLESS_DB
    # A scale from a smaller amax (delayed scaling after a jump): values beyond 448 * scale saturate, never inf/nan.
    small = cast_per_tensor(x, scale / 4)
    assert torch.isfinite(small.q.float()).all() and small.q.float().abs().max() == 448


def test_casts_reject_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        cast_per_tensor(torch.randn(3), torch.tensor(1.0))
    with pytest.raises(ValueError, match="2-D"):
        cast_blockwise(torch.randn(2, 3, 4), (1, 128))


# ---------------------------------------------------------------------------------------------------------------
# The FP8 linear


def _linear_pair(recipe, seed: int, M: int = 96, N: int = 320):
    """FP8 and FP32 linear on the same data (M rows, 256 -> N; 96 and 320 end in partial tiles)."""
    x = with_outliers(M, 256, seed=seed)
    w = torch.randn(N, 256, generator=torch.Generator().manual_seed(seed + 1)) * 0.05
    b = torch.randn(N, generator=torch.Generator().manual_seed(seed + 2))
    g = with_outliers(M, N, seed=seed + 3)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    bs = [b.clone().requires_grad_() for _ in range(2)]
    y8 = Fp8LinearFn(recipe)(xs[0], ws[0], bs[0])
    y8.backward(g)
    y = F.linear(xs[1], ws[1], bs[1])
    y.backward(g)
    return (y8, xs[0].grad, ws[0].grad, bs[0].grad), (y, xs[1].grad, ws[1].grad, bs[1].grad), (x, w, b, g)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_linear_sqnr_of_output_and_gradients(name):
    (y8, gx8, gw8, gb8), (y, gx, gw, gb), _ = _linear_pair(RECIPES[name], seed=10)
    for what, approx, ref in (("output", y8, y), ("input grad", gx8, gx), ("weight grad", gw8, gw)):
        assert GEMM_FLOOR_DB < sqnr_db(approx, ref) < LOSSLESS_DB, what
    torch.testing.assert_close(gb8, gb)  # the bias gradient is a plain FP32 sum


def test_blockwise_linear_is_the_exact_emulation():
    """Output and gradients equal FP64 products of independently fake-quantised operands (FP32 rounding only)."""
    (y8, gx8, gw8, _), _, (x, w, b, g) = _linear_pair(RECIPES["blockwise"], seed=20, M=128, N=384)
    y_ref = ref_blockwise(x, (1, 128), False) @ ref_blockwise(w, (128, 128), False).t() + b.double()
    gx_ref = ref_blockwise(g, (1, 128), False) @ ref_blockwise(w, (128, 128), False)
    gw_ref = ref_blockwise(g.t().contiguous(), (1, 128), False) @ ref_blockwise(x, (128, 1), False)
    for got, ref in ((y8, y_ref), (gx8, gx_ref), (gw8, gw_ref)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_grouped_linear_sqnr_with_an_empty_group(name):
    counts = [40, 0, 88]
    x = with_outliers(128, 256, seed=30).requires_grad_()
    w = (torch.randn(3, 256, 192, generator=torch.Generator().manual_seed(31)) * 0.05).requires_grad_()
    g = with_outliers(128, 192, seed=32)
    fp8_grouped_linear(x, w, counts, Fp8Caster(RECIPES[name])).backward(g)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.cat([x_ref[:40] @ w_ref[0], x_ref[40:] @ w_ref[2]]).backward(g)
    assert GEMM_FLOOR_DB < sqnr_db(x.grad, x_ref.grad) < LOSSLESS_DB
    for e in (0, 2):
        assert GEMM_FLOOR_DB < sqnr_db(w.grad[e], w_ref.grad[e]) < LOSSLESS_DB
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))


def test_delayed_first_step_matches_torchao_dynamic_e4m3():
    """Step 1 of the delayed recipe is a dynamic per-tensor E4M3 cast of all three operands: torchao's
    `Float8Linear(emulate=True)` with E4M3 grad-output casts computes the same (an independent implementation)."""
    float8 = pytest.importorskip("torchao.float8")
    cfg = float8.Float8LinearConfig(
        emulate=True, cast_config_grad_output=float8.CastConfig(target_dtype=torch.float8_e4m3fn)
    )
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 320, bias=False)
    ao = torch.nn.Sequential(torch.nn.Linear(256, 320, bias=False))
    ao[0].load_state_dict(lin.state_dict())
    float8.convert_to_float8_training(ao, config=cfg)
    x, g = with_outliers(64, 256, seed=40), with_outliers(64, 320, seed=41)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours = Fp8LinearFn(DelayedScaling())(x1, lin.weight)
    y_ours.backward(g)
    y_ao = ao(x2)
    y_ao.backward(g)
    # torchao multiplies by 448 / amax where we divide by amax / 448: rare one-ulp E4M3 differences only.
    assert sqnr_db(y_ours, y_ao) > 50
    assert sqnr_db(x1.grad, x2.grad) > 50
    assert sqnr_db(lin.weight.grad, ao[0].weight.grad) > 50


# ---------------------------------------------------------------------------------------------------------------
# Delayed scaling state


def test_amax_history_first_step_then_delayed_max_and_roll_off():
    hist = AmaxHistory(DelayedScaling(amax_history_len=3))
    a = torch.full((4, 4), 2.0)
    assert float(hist.scale_for(a)) == pytest.approx(2.0 / 448)  # first step: the current amax
    assert float(hist.scale_for(torch.full((4, 4), 8.0))) == pytest.approx(2.0 / 448)  # history, not the current 8
    assert float(hist.scale_for(torch.full((4, 4), 1.0))) == pytest.approx(8.0 / 448)  # max over [8, 2]
    assert float(hist.scale_for(torch.full((4, 4), 1.0))) == pytest.approx(8.0 / 448)  # [1, 8, 2]
    assert float(hist.scale_for(torch.full((4, 4), 1.0))) == pytest.approx(8.0 / 448)  # [1, 1, 8]
    assert float(hist.scale_for(torch.full((4, 4), 1.0))) == pytest.approx(1.0 / 448)  # 8 rolled off: [1, 1, 1]
    assert hist.num_recorded == 6 and hist.history.tolist() == [1.0, 1.0, 1.0]


def test_amax_history_most_recent_and_margin():
    hist = AmaxHistory(DelayedScaling(amax_history_len=4, margin=2, amax_compute_algo="most_recent"))
    hist.scale_for(torch.full((2, 2), 8.0))
    hist.scale_for(torch.full((2, 2), 3.0))
    assert float(hist.scale_for(torch.zeros(2, 2))) == pytest.approx(3.0 * 4 / 448)  # newest amax, 2**margin


def test_delayed_linear_records_each_role_once_per_step():
    fn = Fp8LinearFn(DelayedScaling(amax_history_len=2))
    x = torch.randn(8, 128, requires_grad=True)
    w = torch.randn(64, 128, requires_grad=True)
    fn(x, w).backward(torch.ones(8, 64) * 3.0)
    state = fn.caster.delayed
    assert state.input.num_recorded == state.weight.num_recorded == state.grad_output.num_recorded == 1
    assert float(state.input.history[0]) == pytest.approx(float(x.detach().abs().max()))
    assert float(state.weight.history[0]) == pytest.approx(float(w.detach().abs().max()))
    assert float(state.grad_output.history[0]) == 3.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"margin": -1}, "margin"),
        ({"amax_compute_algo": "mean"}, "algo"),
    ],
)
def test_recipe_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DelayedScaling(**kwargs)
