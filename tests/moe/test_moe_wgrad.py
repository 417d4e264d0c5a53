"""Delayed expert weight gradients (moe/layer/wgrad.py) in one process: the delayed GEMMs are autograd's own, bit for
bit, and the store hands the gradients to autograd (AccumulateGrad and its hooks, `torch.autograd.grad`), leaving
nothing queued. The multi-rank cases (overlap with the dispatch's backward, every dispatcher, recompute, FP8) are in
`wgrad_overlap_cases.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe import MoELayer
from moe.layer import wgrad
from moe.layer.experts import batched_linear, grouped_linear, grouped_mm_available, loop_linear
from moe.layer.fp8 import fp8_grouped_linear
from moe.layer.fp8.linear import Fp8Caster
from moe.layer.fp8.recipe import BlockwiseScaling, DelayedScaling
from mtdeepep import in_flight

from .moe_testlib import SMALL_LAYER, moe_config

pytestmark = pytest.mark.timeout(120)

COUNTS = [5, 0, 19, 8]  # an empty group included


def _gemms():
    """name -> (fn(x, w), x shape, w shape): the expert GEMMs that can delay their weight gradient."""
    L, N, K, M = len(COUNTS), sum(COUNTS), 32, 48
    delayed = DelayedScaling()
    return {
        "grouped": (lambda x, w: grouped_linear(x, w, COUNTS), (N, K), (L, K, M)),
        "loop": (lambda x, w: loop_linear(x, w, COUNTS), (N, K), (L, K, M)),
        "bmm": (batched_linear, (L, 8, K), (L, K, M)),
        "fp8_e4m3": (lambda x, w: fp8_grouped_linear(x, w, COUNTS), (N, 128), (L, 128, M)),
        "fp8_blockwise": (
            lambda x, w: fp8_grouped_linear(x, w, COUNTS, Fp8Caster(BlockwiseScaling())),
            (N, 128),
            (L, 128, M),
        ),
        # Delayed scaling keeps amax histories: a fresh caster per call, so both runs cast alike.
        "fp8_delayed": (
            lambda x, w: fp8_grouped_linear(x, w, COUNTS, Fp8Caster(delayed)),
            (N, 128),
            (L, 128, M),
        ),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(_gemms()))
def test_delayed_wgrad_gemms_match_autograd(name, dtype):
    """Inside `deferring(store)` the GEMM's backward returns the input gradient and queues the weight gradient; run,
    it is bitwise autograd's (and the input gradient too)."""
    if name == "grouped" and not grouped_mm_available("cpu", dtype):
        pytest.skip("torch._grouped_mm unavailable: 'grouped' is the loop")
    fn, x_shape, w_shape = _gemms()[name]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(x_shape, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(w_shape, generator=gen).to(dtype).requires_grad_()
    y = fn(x, w)
    g = torch.randn(y.shape, generator=gen).to(dtype)
    gx_ref, gw_ref = torch.autograd.grad(y, (x, w), g)

    store = wgrad.WeightGradStore((w,))
    with wgrad.deferring(store):
        y_delayed = fn(x, w)
    assert torch.equal(y_delayed, y)
    (gx,) = torch.autograd.grad(y_delayed, (x,), g)
    assert store.num_queued == 1, "the weight gradient must be queued, not computed"
    assert torch.equal(gx, gx_ref)
    assert store.run() == 1 and store.num_queued == 0
    (gw,) = store.take()
    assert gw.dtype == gw_ref.dtype and torch.equal(gw, gw_ref)
    assert not in_flight.has_work()


def test_weights_the_store_does_not_hold_are_not_delayed():
    """A copy of the weights (hot-expert replicas compute on copies) or no autograd recording: nothing queued."""
    w = torch.randn(2, 16, 16, requires_grad=True)
    store = wgrad.WeightGradStore((w,))
    x = torch.randn(6, 16, requires_grad=True)
    with wgrad.deferring(store):
        grouped_linear(x, w * 1.0, [3, 3]).sum().backward()
        with torch.no_grad():
            grouped_linear(x, w, [3, 3])
    assert store.num_queued == 0 and w.grad is not None


def _layer(on: bool, **overrides) -> MoELayer:
    cfg = moe_config(SMALL_LAYER, moe_shared_expert_intermediate_size=24, moe_aux_loss_coeff=0.01, **overrides)
    torch.manual_seed(0)
    return MoELayer(dataclasses.replace(cfg, overlap_dispatch_backward_with_experts_wgrad=on))


def test_option_is_on_by_default():
    assert moe_config(SMALL_LAYER).overlap_dispatch_backward_with_experts_wgrad is True


@pytest.mark.parametrize("dispatcher", ["flex", "alltoall"])
def test_layer_gradients_reach_autograd_as_without_the_delay(dispatcher):
    """One process (the anchor runs the queue): `torch.autograd.grad` w.r.t. the expert weights, and
    post-accumulate-grad hooks (ZeRO reduces from them) that fire once per micro-batch with the accumulated `.grad`,
    give bitwise the gradients without the delay; nothing stays queued."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, SMALL_LAYER["hidden_size"], generator=gen)
    g = torch.randn(x.shape, generator=gen)
    results = {}
    for on in (False, True):
        layer = _layer(on, moe_token_dispatcher_type=dispatcher)
        out = layer(x.clone().requires_grad_())
        direct = torch.autograd.grad(out, (layer.experts.w13, layer.experts.w2), g)
        seen = []
        layer.experts.w2.register_post_accumulate_grad_hook(lambda p, seen=seen: seen.append(p.grad.clone()))
        for _ in range(2):
            layer(x).backward(g)
        results[on] = [*direct, *seen, *(p.grad for p in layer.parameters())]
        assert len(seen) == 2, "the hook fires once per micro-batch"
    assert not in_flight.has_work()
    for i, (a, b) in enumerate(zip(results[True], results[False], strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs"


def test_no_store_without_autograd_or_with_frozen_experts():
    layer = _layer(True)
    x = torch.randn(7, SMALL_LAYER["hidden_size"])
    assert layer._wgrad_store() is not None
    with torch.no_grad():
        assert layer._wgrad_store() is None
        layer(x)
    layer.experts.requires_grad_(False)
    assert layer._wgrad_store() is None
    layer(x.requires_grad_()).sum().backward()
    assert layer.experts.w13.grad is None and layer.router.weight.grad is not None
