"""Balancing losses against loops, the aux-loss autoscaler, and the aux-loss-free expert bias."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from moe import (
    MoEConfig,
    MoELayer,
    TopKRouter,
    reset_global_aux_loss_tracker,
    set_aux_loss_scale,
    update_expert_bias,
)
from moe.layer.balancing import (
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


def _layer(seed=0, **overrides):
    cfg = MoEConfig(
        hidden_size=16,
        num_moe_experts=8,
        moe_ffn_hidden_size=8,
        init_method_std=0.3,
        moe_token_dispatcher_type="alltoall",
        **overrides,
    )
    torch.manual_seed(seed)
    return MoELayer(cfg)


def _aux_router_grad(layer, x):
    """Router grad of the attached losses alone, and the loss values."""
    layer.router.weight.grad = None
    (layer(x) * 0).sum().backward()
    return layer.router.weight.grad.clone(), dict(layer.metrics.losses)


def test_several_balancing_losses_add_up():
    """A list of types with a list of coefficients = the sum of the single-type layers (values and router grads)."""
    kinds, coeffs = ["aux_loss", "seq_aux_loss", "global_aux_loss"], [0.01, 0.05, 0.1]
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(1))
    grad, losses = _aux_router_grad(
        _layer(moe_router_load_balancing_type=kinds, moe_aux_loss_coeff=coeffs, moe_z_loss_coeff=1e-3), x
    )
    assert list(losses) == [*kinds, "z_loss"]
    total = torch.zeros_like(grad)
    for kind, coeff in zip(kinds, coeffs):
        g, single = _aux_router_grad(_layer(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff), x)
        assert_close(losses[kind], single[kind], rtol=1e-6, atol=0, msg=kind)
        total += g
    g, single = _aux_router_grad(_layer(moe_z_loss_coeff=1e-3), x)
    assert_close(losses["z_loss"], single["z_loss"], rtol=1e-6, atol=0, msg="z_loss")
    total += g
    assert_close(grad, total, rtol=1e-5, atol=1e-9, msg="router grad of the sum")


def test_balancing_losses_count_plain_topk_of_unbiased_scores():
    """With the expert bias steering the selection, f still counts the plain top-k of the probabilities."""
    layer = _layer(
        moe_router_score_function="sigmoid",
        moe_router_topk=2,
        moe_router_enable_expert_bias=True,
        moe_aux_loss_coeff=1.0,
    )
    layer.router.expert_bias.bias.copy_(torch.tensor([2.0, 2.0, 0, 0, 0, 0, 0, 0]))  # always selects 0 and 1
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    _, losses = _aux_router_grad(layer, x)
    route = layer.router(x)
    assert (route.topk_idx_TK.sort(dim=1).values == torch.tensor([0, 1])).all()
    counted = route.aux_scores_TE.topk(2, dim=1).indices
    assert not (counted.sort(dim=1).values == torch.tensor([0, 1])).all()
    assert_close(losses["aux_loss"], switch_aux_loss(route.aux_scores_TE, counted, 8), rtol=1e-6, msg="aux loss")


def test_global_aux_loss_tracker_counts_each_micro_batch_once_under_full_recompute():
    """Recompute runs the layer's forward again inside backward: the global counts must not grow there, and the
    recomputed loss must use the same averaged counts (values and router grads equal to no recompute)."""
    common = dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    plain, recomputed = _layer(**common), _layer(**common, moe_layer_recompute=True)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(8)
    for step in range(3):
        x = torch.randn(12, 16, generator=gen) + 0.5 * step
        g_plain, l_plain = _aux_router_grad(plain, x)
        g_re, l_re = _aux_router_grad(recomputed, x)
        assert_close(l_re["global_aux_loss"], l_plain["global_aux_loss"], rtol=1e-6, atol=0, msg=f"loss {step}")
        assert_close(g_re, g_plain, rtol=1e-5, atol=1e-9, msg=f"router grad {step}")
        scores = plain.router(x).aux_scores_TE
        counts += tokens_per_expert(scores.topk(2, dim=1).indices, 8)
    for layer in (plain, recomputed):
        assert float(layer.global_aux_loss_tracker.steps) == 3
        assert torch.equal(layer.global_aux_loss_tracker.tokens_per_expert, counts)
    assert reset_global_aux_loss_tracker([plain, recomputed]) == 2
    assert float(recomputed.global_aux_loss_tracker.steps) == 0
    assert float(recomputed.global_aux_loss_tracker.tokens_per_expert.abs().sum()) == 0


def test_no_balancing_loss_in_eval_mode_even_with_grad():
    layer = _layer(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss")
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(4))
    train_grad, train_losses = _aux_router_grad(layer, x)
    assert set(train_losses) == {"aux_loss", "z_loss"} and train_grad.abs().max() > 0
    layer.eval()
    eval_grad, eval_losses = _aux_router_grad(layer, x)
    assert eval_losses == {} and eval_grad.abs().max() == 0
