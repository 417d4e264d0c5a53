"""Recompute in one process: every level and the adaptive trigger change no result, and lower the measured peak.

Results must be bit-identical: recompute rebuilds saved tensors with the same operations on the same inputs.
Peak memory is the process's resident-set peak during forward + backward of a stack of MoE layers
(`moe.layer.peak_memory.peak_memory_bytes`), each level measured in the same process, interleaved,
after a warm-up round, least of 3.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe import MoEConfig, MoELayer
from moe.layer.experts import SwiGLUExperts, swiglu_mlp
from moe.layer.fp8 import Fp8SwiGLUExperts
from moe.layer.moe_recompute import DropSaved
from moe.layer.peak_memory import peak_memory_bytes

pytestmark = pytest.mark.timeout(300)

LEVELS = [None, "light", "medium", "full"]


def _cfg(**overrides) -> MoEConfig:
    base = dict(hidden_size=64, num_moe_experts=8, moe_ffn_hidden_size=96, moe_router_topk=2, init_method_std=0.1,
                moe_shared_expert_intermediate_size=48, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)  # fmt: skip
    return MoEConfig(**{**base, **overrides})


def _run(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * grad).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("recompute", ["act", "fc1"])
@pytest.mark.parametrize("impl", ["grouped", "loop", "padded", "fp8"])
def test_expert_recompute_is_exact(impl, recompute):
    torch.manual_seed(0)
    cls = Fp8SwiGLUExperts if impl == "fp8" else SwiGLUExperts
    experts = cls(4, 128, 64, impl="grouped" if impl == "fp8" else impl, init_std=0.1)
    x = torch.randn(50, 128)
    counts = [20, 0, 13, 17]
    grad = torch.randn(50, 128)
    x0 = x.clone().requires_grad_()
    y0 = experts(x0, counts)
    (y0 * grad).sum().backward()
    g0 = (x0.grad, experts.w13.grad.clone(), experts.w2.grad.clone())
    experts.zero_grad(set_to_none=True)
    x1 = x.clone().requires_grad_()
    y1 = experts(x1, counts, recompute=recompute)
    (y1 * grad).sum().backward()
    assert torch.equal(y0, y1)
    for a, b in zip(g0, (x1.grad, experts.w13.grad, experts.w2.grad)):
        assert torch.equal(a, b)


def test_drop_saved_keeps_recipes_not_values():
    """The dropped tensors are not kept: what the graph saved is a recipe, and the value is rebuilt once."""
    w = torch.randn(16, 32, requires_grad=True)
    x = torch.randn(8, 16)
    calls = []

    def fc1(v):
        calls.append(1)
        return v @ w

    out = swiglu_mlp(x, fc1, lambda a: a.sum(dim=1, keepdim=True), recompute="fc1")
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 2  # one rebuild of h serves the SwiGLU's and FC2's saved tensors
    expected = torch.autograd.grad(swiglu_mlp(x, lambda v: v @ w, lambda a: a.sum(dim=1, keepdim=True)).sum(), w)[0]
    assert torch.equal(w.grad, expected)

    dropped = DropSaved()
    big = torch.randn(1000, 100, requires_grad=True)
    with dropped:
        y = big * 2
        dropped.drop(y, lambda: big.detach() * 2)
        z = y.sin()  # sin saves y: a recipe instead
    assert z.grad_fn._saved_self is not None  # unpacking rebuilds it
    assert torch.equal(z.grad_fn._saved_self, y)


@pytest.mark.parametrize("level", LEVELS[1:] + ["adaptive", "layer_recompute"])
def test_layer_results_unchanged(level):
    extra = {}
    if level == "adaptive":
        extra = dict(moe_adaptive_recompute_tokens=1)
    elif level == "layer_recompute":
        extra = dict(moe_layer_recompute=True)
    else:
        extra = dict(moe_recompute_level=level)
    torch.manual_seed(1)
    base = MoELayer(_cfg(moe_shared_expert_overlap=True))
    layer = MoELayer(_cfg(moe_shared_expert_overlap=True, **extra))
    layer.load_state_dict(base.state_dict())
    x, grad = torch.randn(2, 40, 64), torch.randn(2, 40, 64)
    expected = _run(base, x, grad)
    actual = _run(layer, x, grad)
    assert torch.equal(expected[0], actual[0]) and torch.equal(expected[1], actual[1])
    assert expected[2].keys() == actual[2].keys()
    for name in expected[2]:
        assert torch.equal(expected[2][name], actual[2][name]), name
    expected_mode = {"light": "act", "medium": "fc1", "adaptive": "fc1"}.get(level)
    assert layer.metrics.expert_recompute == expected_mode
    assert {k: v.item() for k, v in layer.metrics.losses.items()} == {
        k: v.item() for k, v in base.metrics.losses.items()
    }


def test_adaptive_threshold_is_per_forward():
    layer = MoELayer(_cfg(moe_adaptive_recompute_tokens=100))
    layer(torch.randn(30, 64))  # 60 rows <= 100: keep
    assert layer.metrics.expert_recompute is None
    layer(torch.randn(80, 64))  # 160 rows > 100: recompute
    assert layer.metrics.expert_recompute == "fc1"


@pytest.mark.slow  # slow: peak memory in fresh processes
def test_recompute_lowers_measured_peak_memory():
    """A stack of 4 layers (T=1024, H=256, F=512, top-2 of 8): peak(full) < peak(medium) < peak(light) < peak(none),
    and the adaptive trigger above its threshold (experts' FC1 recomputed) lowers it below no recompute."""
    torch.manual_seed(2)
    cfg = dict(hidden_size=256, moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=256,
               moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)  # fmt: skip
    variants = {str(level): dict(moe_recompute_level=level) for level in LEVELS}
    variants["adaptive"] = dict(moe_adaptive_recompute_tokens=1000)
    stacks = {}
    reference = None
    for name, extra in variants.items():
        torch.manual_seed(3)
        stack = nn.Sequential(*[MoELayer(_cfg(**cfg, **extra)) for _ in range(4)])
        if reference is None:
            reference = stack.state_dict()
        stack.load_state_dict(reference)
        stacks[name] = stack
    x = torch.randn(1024, 256)

    def step(stack):
        def work():
            out = stack(x.clone().requires_grad_())
            out.square().mean().backward()

        return work

    peaks = {name: [] for name in stacks}
    for round_index in range(4):
        for name, stack in stacks.items():
            stack.zero_grad(set_to_none=False)  # keep the gradient buffers allocated between runs
            measured = peak_memory_bytes(step(stack))
            if round_index > 0:  # round 0 warms the allocator and the gradient buffers up
                peaks[name].append(measured)
    # Noise (allocator arenas, pages not yet returned) only adds to a peak, so the least of 3 is the estimate.
    peak = {name: min(values) / 2**20 for name, values in peaks.items()}
    mib = ", ".join(f"{name} {value:.1f}" for name, value in peak.items())
    assert peak["full"] < peak["medium"] < peak["light"] < peak["None"], f"peak MiB: {mib}"
    # The trigger recomputes only the experts' FC1 (level 'light' also drops the router's and the combine's saved
    # tensors, so the two are not ordered): it must save against no recompute.
    assert peak["adaptive"] < peak["None"], f"peak MiB: {mib}"
    assert stacks["adaptive"][0].metrics.expert_recompute == "fc1"
