"""Balancing losses against loops, the aux-loss autoscaler, and the aux-loss-free expert bias."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe import MoEConfig, MoELayer, TopKRouter, set_aux_loss_scale, update_expert_bias
from moe.balancing import (
    AuxLossScale,
    ExpertBias,
    attach_aux_loss,
    global_aux_loss,
    load_imbalance,
    seq_aux_loss,
    switch_aux_loss,
    tokens_per_expert,
    z_loss,
)

from .moe_testlib import assert_close

pytestmark = pytest.mark.timeout(60)


def _random_routing(T, E, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.softmax(torch.randn(T, E, generator=gen, dtype=torch.float64), dim=1)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return scores, idx


def _switch_loop(scores, idx, E):
    T, K = idx.shape
    total = 0.0
    for e in range(E):
        f = sum(int(v == e) for v in idx.flatten().tolist()) / (T * K)
        P = sum(float(scores[t, e]) for t in range(T)) / T
        total += f * P
    return E * total


def test_switch_aux_loss_matches_loop_and_is_one_when_uniform():
    scores, idx = _random_routing(30, 8, 2)
    assert abs(float(switch_aux_loss(scores, idx, 8)) - _switch_loop(scores, idx, 8)) < 1e-6
    uniform = torch.full((16, 4), 0.25)
    idx = torch.arange(16).remainder(4).view(16, 1)
    assert float(switch_aux_loss(uniform, idx, 4)) == pytest.approx(1.0)


def test_seq_aux_loss_is_mean_of_per_sequence_losses():
    B, S, E, K = 3, 10, 6, 2
    scores, idx = _random_routing(B * S, E, K, seed=1)
    per_seq = [_switch_loop(scores[b * S : (b + 1) * S], idx[b * S : (b + 1) * S], E) for b in range(B)]
    got = seq_aux_loss(scores.view(B, S, E), idx.view(B, S, K), E)
    assert float(got) == pytest.approx(sum(per_seq) / B, rel=1e-6)
    # Differs from the batch-level loss in general.
    assert abs(float(got) - float(switch_aux_loss(scores, idx, E))) > 1e-4


def test_global_aux_loss_without_group_is_switch_loss_and_ignores_dropped_slots():
    scores, idx = _random_routing(20, 8, 2, seed=2)
    assert float(global_aux_loss(scores, idx, 8, None)) == pytest.approx(float(switch_aux_loss(scores, idx, 8)))
    dropped = idx.clone()
    dropped[0, 0] = -1
    assert tokens_per_expert(dropped, 8).sum() == idx.numel() - 1


def test_z_loss_matches_formula():
    logits = torch.randn(12, 5, dtype=torch.float64)
    ref = sum(float(torch.log(torch.exp(row).sum())) ** 2 for row in logits) / 12
    assert float(z_loss(logits)) == pytest.approx(ref, rel=1e-6)


def test_attach_aux_loss_injects_scaled_gradient():
    p = torch.randn(5, dtype=torch.float64, requires_grad=True)
    act = torch.randn(4, dtype=torch.float64, requires_grad=True)
    scale = AuxLossScale(1.0)
    aux = (p**2).sum() * 0.3  # d aux / dp = 0.6 p
    out = attach_aux_loss(act * 2, aux, scale)
    assert torch.equal(out, act * 2)
    scale.value = 0.25  # set after the forward, before backward (as a trainer does)
    out.sum().backward()
    assert_close(p.grad, 0.25 * 0.6 * p.detach(), msg="aux grad")
    assert_close(act.grad, torch.full((4,), 2.0, dtype=torch.float64), msg="main grad unchanged")


def test_layer_aux_loss_gradient_follows_loss_scale():
    """router grad(scale s) = grad of main loss + s * grad of the aux losses."""
    cfg = MoEConfig(
        hidden_size=16, num_moe_experts=8, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1
    )
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(0))
    grads = {}
    for s in (0.0, 1.0, 0.125):
        torch.manual_seed(0)
        layer = MoELayer(cfg)
        set_aux_loss_scale(layer, s)
        layer(x).sum().backward()
        grads[s] = layer.router.weight.grad.clone()
    aux_part = grads[1.0] - grads[0.0]
    assert aux_part.abs().max() > 1e-4, "the aux loss should move the router"
    assert_close(grads[0.125], grads[0.0] + 0.125 * aux_part, rtol=1e-4, atol=1e-7, msg="scaled aux grad")


def test_expert_bias_counts_only_grad_enabled_forwards():
    cfg = MoEConfig(
        hidden_size=16,
        num_moe_experts=8,
        moe_ffn_hidden_size=8,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    router = TopKRouter(cfg)
    x = torch.randn(10, 16, requires_grad=True)
    with torch.no_grad():
        router(x)
    assert float(router.expert_bias.counts.sum()) == 0
    router(x)
    assert float(router.expert_bias.counts.sum()) == 10 * 2
    router.expert_bias.counts.zero_()
    # Non-reentrant activation checkpointing recomputes the forward inside backward: counted once.
    out = checkpoint(lambda t: router(t).probs_TK, x, use_reentrant=False)
    out.sum().backward()
    assert float(router.expert_bias.counts.sum()) == 10 * 2


def test_update_expert_bias_rule():
    bias = ExpertBias(4, update_rate=0.01)
    bias.counts.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5
    assert update_expert_bias(bias) == 1
    assert_close(bias.bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]), msg="bias")
    assert float(bias.counts.abs().sum()) == 0


def test_expert_bias_balances_a_skewed_router():
    E, H = 8, 16
    cfg = MoEConfig(
        hidden_size=H,
        num_moe_experts=E,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.01,
    )
    torch.manual_seed(0)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.weight[:2] += 0.2  # with inputs of mean 0.5, experts 0 and 1 win for most tokens
    gen = torch.Generator().manual_seed(1)
    x_eval = torch.randn(512, H, generator=gen) + 0.5

    def imbalance():
        with torch.no_grad():
            return load_imbalance(tokens_per_expert(router(x_eval).topk_idx_TK, E))

    before = imbalance()
    assert before > 2.5, f"router not skewed enough to test anything ({before})"
    for _ in range(150):
        router(torch.randn(256, H, generator=gen) + 0.5)
        update_expert_bias(router)
    after = imbalance()
    assert after < 1.45 and after < before / 1.8, (before, after)
    assert router.expert_bias.bias[:2].max() < router.expert_bias.bias[2:].min()
