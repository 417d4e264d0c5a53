"""The MoE layer's GPU paths, run for real in one process on GPU 0: the grouped GEMM (`torch._grouped_mm`) and the
block-wise FP8 GEMMs (`torch._scaled_mm`, DeepSeek-V3's 1x128 x 128x128 scaling), each against a float64 (or FP32)
reference on the host. A spy on the torch function proves that the real kernel ran: the code falls back to a loop
or to emulation silently when a probe fails, which would otherwise pass these tests without ever running the GPU
path. Skipped, with one reason, without a CUDA device (the mtdeepep CUDA executor is not needed).

Tolerances. bf16 GEMMs with FP32 accumulation round the result once: `|y - ref| <= 2^-8 |ref| + K 2^-22 M`, with
M = |x| @ |w| (the FP32 summation term with margin), and K the reduction length. A chain (SwiGLU experts, forward
and backward) compounds a few such roundings: an SQNR of 30 dB (3% RMS relative error) against float64 is a floor
about 10 dB under what bf16 gives, and far above what a wrong group, a lost row or a transposed weight give (under
10 dB). FP8: as tests/moe/test_moe_fp8.py (E4M3 noise: experts >= 20 dB against FP32); the real GEMM against the
emulated one (the same quantised operands) differs by the tensor cores' accumulation (see the test) and, for a
bf16-output variant, one bf16 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe import MoEConfig, MoELayer
from moe.layer.experts import SwiGLUExperts, grouped_linear, grouped_mm_available
from moe.layer.fp8 import (
    ACT_TILE,
    COL_TILE,
    WEIGHT_TILE,
    Fp8SwiGLUExperts,
    fake_quantize,
    fp8_linear,
    probe_scaled_mm,
    scaled_mm_variant,
)

from ..moe.moe_testlib import sqnr_db
from .gpu import skip_unless_cuda

pytestmark = [*skip_unless_cuda(need_executor=False), pytest.mark.timeout(300)]

CUDA = torch.device("cuda", 0)


@pytest.fixture
def spy(monkeypatch):
    """`spy(name)`: counts the calls of `torch.<name>` from now on (the moe code looks it up at call time)."""
    calls: dict[str, int] = {}

    def install(name: str) -> dict[str, int]:
        real = getattr(torch, name)
        calls[name] = 0

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
        return calls

    return install


def _bounded(name: str, actual: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    bound = 2.0**-8 * ref.abs() + k * 2.0**-22 * magnitude + 1e-30
    excess = (actual.double().cpu() - ref).abs() - bound
    assert bool((excess <= 0).all()), f"{name}: worst excess over the bound {excess.max().item():.3e}"


def test_grouped_gemm_runs_torch_grouped_mm_on_cuda(spy):
    """`grouped_linear` (bf16, groups of 40, 0, 77 and 11 rows) forward and both gradients through
    `torch._grouped_mm`, against float64 per-group matmuls on the host."""
    assert grouped_mm_available("cuda", torch.bfloat16), "torch._grouped_mm failed its probe on this GPU"
    calls = spy("_grouped_mm")
    counts, k, m = [40, 0, 77, 11], 256, 384
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), k, generator=gen).bfloat16()
    w = (torch.randn(len(counts), k, m, generator=gen) / k**0.5).bfloat16()
    g = torch.randn(sum(counts), m, generator=gen).bfloat16()
    x_d, w_d = x.to(CUDA).requires_grad_(), w.to(CUDA).requires_grad_()
    y = grouped_linear(x_d, w_d, counts)
    y.backward(g.to(CUDA))
    assert calls["_grouped_mm"] >= 1, "the grouped GEMM did not run torch._grouped_mm"
    xs, gs = x.double().split(counts), g.double().split(counts)
    wd = w.double()
    ref_y = torch.cat([xs[e] @ wd[e] for e in range(len(counts))])
    mag_y = torch.cat([xs[e].abs() @ wd[e].abs() for e in range(len(counts))])
    ref_dx = torch.cat([gs[e] @ wd[e].T for e in range(len(counts))])
    mag_dx = torch.cat([gs[e].abs() @ wd[e].abs().T for e in range(len(counts))])
    ref_dw = torch.stack([xs[e].T @ gs[e] for e in range(len(counts))])
    mag_dw = torch.stack([xs[e].abs().T @ gs[e].abs() for e in range(len(counts))])
    _bounded("y", y.detach(), ref_y, mag_y, k)
    _bounded("x.grad", x_d.grad, ref_dx, mag_dx, m)
    _bounded("w.grad", w_d.grad, ref_dw, mag_dw, max(counts))
    assert w_d.grad[1].abs().sum() == 0, "the empty group's weight gradient"


def test_swiglu_experts_on_cuda_track_float64():
    """bf16 SwiGLU experts (grouped GEMM) on the GPU, forward and backward, against the same weights in float64 on
    the host (loop implementation)."""
    torch.manual_seed(0)
    ref = SwiGLUExperts(4, 512, 256, impl="loop", init_std=0.05, dtype=torch.float64)
    gpu_experts = SwiGLUExperts(4, 512, 256, impl="grouped", init_std=0.05, dtype=torch.bfloat16, device=CUDA)
    with torch.no_grad():
        gpu_experts.w13.copy_(ref.w13)
        gpu_experts.w2.copy_(ref.w2)
        ref.w13.copy_(gpu_experts.w13.double().cpu())  # both start from the bf16-representable weights
        ref.w2.copy_(gpu_experts.w2.double().cpu())
    counts = [100, 0, 63, 93]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), 512, generator=gen).bfloat16()
    g = torch.randn(sum(counts), 512, generator=gen).bfloat16()
    x_ref, x_gpu = x.double().requires_grad_(), x.to(CUDA).requires_grad_()
    y_ref, y_gpu = ref(x_ref, counts), gpu_experts(x_gpu, counts)
    y_ref.backward(g.double())
    y_gpu.backward(g.to(CUDA))
    for name, a, b in [
        ("y", y_ref, y_gpu),
        ("dx", x_ref.grad, x_gpu.grad),
        ("dw13", ref.w13.grad, gpu_experts.w13.grad),
        ("dw2", ref.w2.grad, gpu_experts.w2.grad),
    ]:
        assert sqnr_db(a, b.cpu()) > 30, f"{name}: {sqnr_db(a, b.cpu()):.1f} dB"


def test_fp8_linear_runs_torch_scaled_mm_for_all_three_gemms(spy):
    """Forward, input grad and weight grad each run one `torch._scaled_mm` (1x128 activations with 128x128 weight
    blocks, and 128x1 tiles for the weight gradient), equal to the emulated recipe on the same quantised operands."""
    for tile in (WEIGHT_TILE, COL_TILE):
        tried = "; ".join(f"{tuple(v)}: {why}" for v, why in probe_scaled_mm(CUDA, tile))
        assert scaled_mm_variant(CUDA, tile) is not None, f"torch._scaled_mm failed its probe for {tile}: {tried}"
    calls = spy("_scaled_mm")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 512, generator=gen)
    w = torch.randn(512, 384, generator=gen) * 0.05
    g = torch.randn(256, 384, generator=gen)
    x_d, w_d = x.to(CUDA).requires_grad_(), w.to(CUDA).requires_grad_()
    y = fp8_linear(x_d, w_d.t())  # fp8_linear takes nn.Linear's [out, in] weight
    y.backward(g.to(CUDA))
    assert calls["_scaled_mm"] == 3, f"expected 3 real FP8 GEMMs, ran {calls['_scaled_mm']}"

    def fq(t: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:  # what the GEMM sees of t, in float64
        return fake_quantize(t, tile).double()

    expected = {
        "y": fq(x, ACT_TILE) @ fq(w, WEIGHT_TILE),
        "x.grad": fq(g, ACT_TILE) @ fq(w.T, WEIGHT_TILE),
        "w.grad": fq(x.T, ACT_TILE) @ fq(g, COL_TILE),
    }
    # Hopper's FP8 tensor cores accumulate a 128-wide block with ~14 mantissa bits before the scaled FP32 sum
    # (DeepSeek-V3's report): ~2^-14 relative per block, under 1e-3 overall; a bf16 output adds one 2^-8 rounding.
    bf16_out = scaled_mm_variant(CUDA, WEIGHT_TILE).out_dtype == torch.bfloat16
    limit = 1e-2 if bf16_out else 1e-3
    for name, actual in (("y", y.detach()), ("x.grad", x_d.grad), ("w.grad", w_d.grad)):
        ref = expected[name]
        rel = float((actual.double().cpu() - ref).norm() / ref.norm())
        variants = [scaled_mm_variant(CUDA, tile) for tile in (WEIGHT_TILE, COL_TILE)]
        assert rel < limit, f"{name}: relative error {rel:.2e} against the emulated recipe (conventions {variants})"


def test_fp8_experts_on_cuda_track_float32_experts(spy):
    """FP8 SwiGLU experts through the real FP8 GEMM on the GPU against FP32 experts on the GPU (same weights)."""
    calls = spy("_scaled_mm")
    torch.manual_seed(0)
    ref = SwiGLUExperts(4, 512, 256, init_std=0.05, device=CUDA)
    fp8 = Fp8SwiGLUExperts.from_experts(copy.deepcopy(ref))  # own weights: from_experts shares ref's Parameters
    counts = [40, 0, 60, 28]
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(3)).to(CUDA)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa, counts), fp8(xb, counts)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert calls["_scaled_mm"] > 0, "the FP8 experts did not run torch._scaled_mm"
    for name, a, b in [
        ("y", ya, yb),
        ("dx", xa.grad, xb.grad),
        ("dw13", ref.w13.grad, fp8.w13.grad),
        ("dw2", ref.w2.grad, fp8.w2.grad),
    ]:
        assert sqnr_db(a, b) > 20, f"{name}: {sqnr_db(a, b):.1f} dB"
    assert fp8.w13.grad[1].abs().sum() == 0  # the expert without tokens


def test_moe_layer_on_cuda_tracks_float64_layer():
    """The whole MoE layer (router, single-process dispatch, grouped experts) in FP32 on the GPU against the same
    layer in float64 on the host: forward and the input gradient. (FP32 only: in bf16 the router's top-k flips on
    near-ties between the two devices, which says nothing about the GPU paths.)"""
    dtype = torch.float32
    kwargs = dict(hidden_size=256, num_moe_experts=8, moe_ffn_hidden_size=256, moe_router_topk=2,
                  init_method_std=0.05)  # fmt: skip
    torch.manual_seed(0)
    ref = MoELayer(MoEConfig(**kwargs), dtype=torch.float64)
    layer = MoELayer(MoEConfig(**kwargs), dtype=dtype, device=CUDA)
    layer.load_state_dict(ref.state_dict())  # load_state_dict casts to each parameter's dtype and device
    ref.load_state_dict(layer.state_dict())  # the FP32-representable weights in both
    x = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    xa, xb = x.double().requires_grad_(), x.to(CUDA).requires_grad_()
    ya, yb = ref(xa), layer(xb)
    assert yb.device == CUDA and yb.dtype == dtype
    ya.square().sum().backward()
    yb.float().square().sum().backward()
    # FP32 against float64: ~1e-6 relative error (~120 dB); a wrong route or weight gives under 20 dB.
    assert sqnr_db(ya, yb.cpu()) > 60, f"output {sqnr_db(ya, yb.cpu()):.1f} dB"
    assert sqnr_db(xa.grad, xb.grad.cpu()) > 60, f"x.grad {sqnr_db(xa.grad, xb.grad.cpu()):.1f} dB"


def test_fp8_moe_layer_on_cuda_tracks_float32_layer(spy):
    """`MoEConfig(fp8='e4m3')` on the GPU runs its experts through the real FP8 GEMM and tracks the FP32 layer."""
    calls = spy("_scaled_mm")
    kwargs = dict(hidden_size=256, num_moe_experts=4, moe_ffn_hidden_size=256, init_method_std=0.05)
    torch.manual_seed(0)
    ref = MoELayer(MoEConfig(**kwargs), device=CUDA)
    fp8 = MoELayer(MoEConfig(fp8="e4m3", **kwargs), device=CUDA)
    fp8.load_state_dict(ref.state_dict())
    assert isinstance(fp8.experts, Fp8SwiGLUExperts)
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(5)).to(CUDA)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), fp8(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert calls["_scaled_mm"] > 0, "the FP8 layer did not run torch._scaled_mm"
    assert sqnr_db(ya, yb) > 20
    assert sqnr_db(xa.grad, xb.grad) > 20
    assert sqnr_db(ref.experts.w2.grad, fp8.experts.w2.grad) > 20
