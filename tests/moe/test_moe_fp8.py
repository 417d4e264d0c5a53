"""Block-wise FP8 (DeepSeek-V3 recipe) on CPU by emulation.

Tolerances. E4M3 keeps 3 mantissa bits, so rounding a normal value has relative error <= 2^-4 and, for values
spread over a binade, an RMS relative error of about 2^-4/sqrt(3) = 3.6% (~29 dB; block scaling keeps the values
in the normal range). A GEMM with two quantised operands adds both noises (~28 dB measured); an expert chains two
GEMMs and multiplies gate by up (~24 dB measured). Floors, a few dB under those: casts 28 dB, one linear layer
25 dB (torchao asks >= 18 dB for e4m3 outputs), experts 20 dB (relative error below 10%).
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe import MoEConfig, MoELayer
from moe.layer.experts import SwiGLUExperts
from moe.layer.fp8 import (
    ACT_TILE,
    COL_TILE,
    WEIGHT_TILE,
    Fp8SwiGLUExperts,
    fake_quantize,
    fp8_grouped_linear,
    fp8_linear,
)
from mtdeepep.utils.fp8 import FP8_E4M3_MAX, dequantize_blocks, per_token_cast_to_fp8, quantize_blocks

from .moe_testlib import sqnr_db

pytestmark = pytest.mark.timeout(60)


def _e4m3_values() -> torch.Tensor:
    """Every finite E4M3 value, from its 256 bit patterns (independent of torch's float -> E4M3 rounding)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[values.isfinite()].unique()


@pytest.mark.parametrize("round_scale", [False, True], ids=["exact_scale", "pow2_scale"])
def test_per_token_cast_is_the_nearest_e4m3_per_128_channel_block(round_scale):
    """The activation cast (the one quantiser of mtdeepep, the dispatchers and the FP8 experts), checked by brute
    force: per token and 128 channels, scale = max(amax, 1e-4) / 448 (or the smallest power of two >= it), and every
    code is a nearest E4M3 value of x / scale."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(16, 384, generator=gen) * torch.logspace(-3, 2, 16).unsqueeze(1)
    x[3, 128:256] = 0.0  # an all-zero block: the amax floor
    q, s = per_token_cast_to_fp8(x, round_scale=round_scale)
    assert s.shape == (16, 3) and s.dtype == torch.float32 and q.dtype == torch.float8_e4m3fn
    amax = x.double().abs().view(16, 3, 128).amax(dim=2).clamp(min=1e-4)
    if round_scale:
        assert bool((torch.log2(s.double()) == torch.log2(s.double()).round()).all()), "power-of-two scales"
        assert bool((s.double() * 448 >= amax).all() and (s.double() * 224 < amax).all()), "the smallest such"
    else:
        torch.testing.assert_close(s.double(), amax / 448, rtol=2**-23, atol=0)
    target = x.view(16, 3, 128) / s.unsqueeze(2)  # what the codes stand for, in units of the scale
    distance = (target.unsqueeze(-1) - _e4m3_values()).abs()
    got = (target - q.float().view(16, 3, 128)).abs()
    assert bool((got <= distance.amin(dim=-1)).all()), "a code that is not a nearest E4M3 value"
    assert torch.count_nonzero(q[3, 128:256].float()) == 0
    assert torch.equal(quantize_blocks(x, ACT_TILE, round_scale)[1], s), "the (1, 128) tiles of quantize_blocks"


@pytest.mark.parametrize("tile", [ACT_TILE, WEIGHT_TILE, COL_TILE], ids=["1x128", "128x128", "128x1"])
def test_block_quantisation_error_bound(tile):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=gen) * torch.rand(200, 1, generator=gen) * 10  # ragged edges on purpose
    q, s = quantize_blocks(x, tile)
    rows, cols = -(-200 // tile[0]), -(-300 // tile[1])
    assert s.shape == (rows, cols) and s.dtype == torch.float32
    xq = dequantize_blocks(q, s, tile)
    scale_full = s.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:200, :300]
    # Normal range: half an ulp = 2^-4 relative; subnormal range: half of the 2^-9 spacing, in scaled units.
    bound = 2.0**-4 * x.abs() + 2.0**-10 * scale_full
    assert bool(((xq - x).abs() <= bound * (1 + 1e-6)).all())
    assert float(q.float().abs().max()) <= FP8_E4M3_MAX
    assert sqnr_db(x, xq) > 28


def test_fp8_linear_is_the_blockwise_recipe_for_all_three_gemms():
    """Forward, input grad and weight grad equal float32 GEMMs of the quantise-dequantised operands."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 256, generator=gen, requires_grad=True)
    w = (torch.randn(256, 384, generator=gen) * 0.05).requires_grad_()
    g = torch.randn(96, 384, generator=gen)
    y = fp8_linear(x, w.t())  # fp8_linear takes nn.Linear's [out, in] weight
    y.backward(g)
    xd, wd = x.detach(), w.detach()
    torch.testing.assert_close(y, fake_quantize(xd, ACT_TILE) @ fake_quantize(wd, WEIGHT_TILE))
    torch.testing.assert_close(x.grad, fake_quantize(g, ACT_TILE) @ fake_quantize(wd.t(), WEIGHT_TILE))
    torch.testing.assert_close(w.grad, fake_quantize(xd.t(), ACT_TILE) @ fake_quantize(g, COL_TILE))
    # And they track the float32 GEMMs.
    assert sqnr_db(xd @ wd, y) > 25
    assert sqnr_db(g @ wd.t(), x.grad) > 25
    assert sqnr_db(xd.t() @ g, w.grad) > 25


def test_fp8_grouped_linear_quantises_weight_grads_per_group():
    gen = torch.Generator().manual_seed(2)
    counts = [50, 0, 78]
    x = torch.randn(128, 128, generator=gen, requires_grad=True)
    w = torch.randn(3, 128, 256, generator=gen, requires_grad=True)
    g = torch.randn(128, 256, generator=gen)
    fp8_grouped_linear(x, w, counts).backward(g)
    assert w.grad[1].abs().sum() == 0
    for e, (xe, ge) in enumerate(zip(x.detach().split(counts), g.split(counts))):
        if xe.size(0):
            expected = fake_quantize(xe.t(), ACT_TILE) @ fake_quantize(ge, COL_TILE)
            torch.testing.assert_close(w.grad[e], expected)


def test_fp8_experts_track_float32_experts():
    torch.manual_seed(0)
    ref = SwiGLUExperts(4, 256, 128, init_std=0.05)
    fp8 = Fp8SwiGLUExperts.from_experts(copy.deepcopy(ref))  # own weights: from_experts shares ref's Parameters
    counts = [20, 0, 30, 14]
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa, counts), fp8(xb, counts)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert float((ya - yb).detach().norm() / ya.detach().norm()) < 0.1
    for name, a, b in [
        ("y", ya, yb),
        ("dx", xa.grad, xb.grad),
        ("dw13", ref.w13.grad, fp8.w13.grad),
        ("dw2", ref.w2.grad, fp8.w2.grad),
    ]:
        assert sqnr_db(a, b) > 20, name
    assert fp8.w13.grad[1].abs().sum() == 0  # the expert without tokens


def test_fp8_moe_layer_tracks_float32_layer():
    kwargs = dict(hidden_size=128, num_moe_experts=4, moe_ffn_hidden_size=128, init_method_std=0.05)
    torch.manual_seed(0)
    ref = MoELayer(MoEConfig(**kwargs))
    fp8 = MoELayer(MoEConfig(fp8="e4m3", **kwargs))
    fp8.load_state_dict(ref.state_dict())
    assert isinstance(fp8.experts, Fp8SwiGLUExperts)
    x = torch.randn(2, 16, 128)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), fp8(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert sqnr_db(ya, yb) > 20
    assert sqnr_db(xa.grad, xb.grad) > 20
    assert sqnr_db(ref.experts.w2.grad, fp8.experts.w2.grad) > 20
    # The router is not quantised: its input is the same, so its logits are identical.
    assert torch.equal(ref.router.gating(x.view(-1, 128)), fp8.router.gating(x.view(-1, 128)))
