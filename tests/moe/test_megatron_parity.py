"""The MoE layer's router numerics against megatron-core's own router and loss functions (megatron_ref.py).

Both sides get the same router weight (and expert bias) and the same tokens; our layer takes `[B, S, H]`,
Megatron's router `[S, B, H]`. Only the attached losses are back-propagated (`(out * 0).sum()`), so the router
gradient is the gradient of the balancing losses and the z-loss alone.

Tolerances: both sides evaluate the same float32 formulas (sums over tokens and experts) in different orders, so
they agree to float32 rounding: losses to rtol 1e-5 (about 80 ulp; measured: within 2 ulp), router gradients to
1e-5 of the gradient's largest magnitude (measured: under 1e-6). The bugs these tests guard against move values by
percent to 100 %. Computations that are the same operations in the same order are compared exactly.
The two-rank cases (data parallel 2, tensor parallel 2) are in megatron_parity_cases.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe import MoEConfig, MoELayer, TopKRouter, reset_global_aux_loss_tracker
from moe.layer.balancing import aux_loss_topk, global_aux_loss, z_loss

from . import megatron_parity_cases as cases
from . import megatron_ref as mr
from .moe_testlib import assert_close, moe_config

pytestmark = pytest.mark.timeout(180)

H, E = cases.H, cases.E
B, S = 3, 8


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo group: Megatron's router reduces its counts with torch.distributed even on one rank."""
    assert not dist.is_initialized(), "these tests start their own one-rank process group"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pool(rank_pools):
    return rank_pools[2]


def _cfg(**overrides) -> MoEConfig:
    return moe_config(cases.ROUTER_PARITY_LAYER, **overrides)


def _pair(cfg: MoEConfig, world, seed: int = 0, **layer_kwargs):
    """Our layer and Megatron's router with the same weight and (random, choice-changing) expert bias."""
    torch.manual_seed(seed)
    layer = MoELayer(cfg, aux_loss_group=world, **layer_kwargs)
    bias = None
    if layer.router.expert_bias is not None:
        bias = torch.randn(E) * 0.05
        layer.router.expert_bias.bias.copy_(bias)
    megatron = mr.megatron_router(
        cfg, layer.router.weight.detach(), tp_cp_group=world, tp_dp_cp_group=world, expert_bias=bias
    )
    return layer, megatron


GROUPS = dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2)
VARIANTS = {
    "softmax_aux_z": dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    # Group limits change choices: the balancing losses must count the plain top-k anyway.
    "softmax_groups_three_losses": dict(
        **GROUPS,
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[0.01, 0.02, 0.03],
        moe_z_loss_coeff=1e-3,
    ),
    # DeepSeek-V3 routing: group limits and the expert bias change choices.
    "sigmoid_v3_bias": dict(
        **GROUPS,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type=["seq_aux_loss", "aux_loss"],
        moe_aux_loss_coeff=[0.05, 0.01],
    ),
    "softmax_pre_top3_fp64": dict(
        moe_router_topk=3,
        moe_router_pre_softmax=True,
        moe_router_dtype="fp64",
        moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=1e-2,
    ),  # fmt: skip
    "softmax_pre_top1": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.01),
    "capacity_probs": dict(moe_expert_capacity_factor=0.75, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_losses_and_router_grad_match_megatron(world, variant):
    cfg = _cfg(**VARIANTS[variant])
    layer, megatron = _pair(cfg, world)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    cases.compare_step(layer, megatron, x)

    # The routing itself (before any capacity limit) agrees too.
    with torch.no_grad(), mr.on_cpu():
        route = layer.router(x.view(-1, H))
        probs, routing_map = mr.moe_utils.topk_routing_with_score_function(
            megatron.gating(x.transpose(0, 1).reshape(-1, H)),
            cfg.moe_router_topk,
            use_pre_softmax=cfg.moe_router_pre_softmax,
            num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=cfg.moe_router_score_function,
            expert_bias=megatron.expert_bias,
        )
    to_bs = lambda t: t.view(S, B, E).transpose(0, 1).reshape(B * S, E)  # Megatron's token order -> ours
    ours_TE = torch.zeros(B * S, E, dtype=torch.float64).scatter(1, route.topk_idx_TK, route.probs_TK.double())
    assert torch.equal(ours_TE != 0, to_bs(routing_map))
    assert_close(ours_TE, to_bs(probs), rtol=1e-6, atol=1e-7, msg="routing probs")

    if cfg.moe_router_num_groups is not None:
        # The case the fix is about: the routed selection differs from the plain top-k the losses count.
        plain = aux_loss_topk(route.aux_scores_TE, cfg.moe_router_topk).sort(dim=1).values
        assert (plain != route.topk_idx_TK.sort(dim=1).values).any(dim=1).sum() >= 3


def test_global_aux_loss_averages_counts_over_the_global_batch_like_megatron(world):
    """Micro-batches 1-3 of a global batch see the counts averaged over the micro-batches so far; after the reset
    (the optimizer step) the next one starts a new average."""
    cfg = _cfg(moe_router_topk=4, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    layer, megatron = _pair(cfg, world)
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        if step == 3:
            assert reset_global_aux_loss_tracker([layer]) == 1
            megatron.reset_global_aux_loss_tracker()
        x = torch.randn(B, S, H, generator=gen) + 0.3 * step  # shifted, so the micro-batches route differently
        cases.compare_step(layer, megatron, x)
        route = layer.router(x.view(-1, H))
        this_batch_only = 0.1 * global_aux_loss(route.aux_scores_TE, aux_loss_topk(route.aux_scores_TE, 4), E)
        averaged = step in (1, 2)  # steps 0 and 3 are the first micro-batch of their global batch
        assert averaged != torch.allclose(layer.metrics.losses["global_aux_loss"], this_batch_only, rtol=1e-4)
    assert float(layer.global_aux_loss_tracker.steps) == 1


def test_top1_softmax_after_topk_is_refused_like_megatron():
    with pytest.raises(ValueError, match="moe_router_pre_softmax=True"):
        _cfg(moe_router_topk=1)
    with pytest.raises(ValueError, match="pre-softmax"):
        mr.megatron_config(_cfg(moe_router_topk=1, moe_router_pre_softmax=True), moe_router_pre_softmax=False)
    _cfg(moe_router_topk=1, moe_router_pre_softmax=True)
    _cfg(moe_router_topk=1, moe_router_score_function="sigmoid")


@pytest.mark.parametrize("capacity_factor", [1.0, 4.0, 8.0])  # capacity 4 (< 16 tokens), 16 (= tokens), 32 (>)
def test_pad_to_capacity_rows_follow_megatron(world, capacity_factor):
    T, K, Ex = 16, 2, 8
    cfg = _cfg(
        num_moe_experts=Ex,
        moe_router_topk=K,
        moe_expert_capacity_factor=capacity_factor,
        moe_pad_expert_input_to_capacity=True,
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    seen = []
    layer.experts.register_forward_pre_hook(lambda module, args: seen.append((args[0].shape[0], list(args[1]))))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    out = layer(x)

    route = layer.router(x)
    probs_TE = torch.zeros(T, Ex).scatter(1, route.topk_idx_TK, route.probs_TK.detach())
    _, padded_map = mr.moe_utils.apply_router_token_dropping(
        probs_TE, probs_TE > 0, K, capacity_factor, cfg.moe_token_drop_policy, pad_to_capacity=True
    )
    megatron_rows = padded_map.sum(dim=0).tolist()  # rows each expert computes in Megatron, padding included
    assert len(set(megatron_rows)) == 1
    assert seen == [(sum(megatron_rows), megatron_rows)]

    cfg_unpadded = _cfg(num_moe_experts=Ex, moe_router_topk=K, moe_expert_capacity_factor=capacity_factor)
    unpadded = MoELayer(cfg_unpadded)
    unpadded.load_state_dict(layer.state_dict())
    torch.testing.assert_close(out, unpadded(x), rtol=1e-5, atol=1e-6)


def test_eval_mode_attaches_no_loss_like_megatron(world):
    cfg = _cfg(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-2)
    layer, megatron = _pair(cfg, world)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4), requires_grad=True)
    grads = {}
    for training in (True, False):
        layer.train(training)
        megatron.train(training)
        cases.backward_attached_losses(layer, megatron, x)
        grads[training] = (layer.router.weight.grad, megatron.weight.grad)
        if not training:
            assert layer.metrics.losses == {}
        mr.recorded_losses({}, None)
    assert grads[True][0].abs().max() > 0 and grads[True][1].abs().max() > 0
    assert grads[False][0].abs().max() == 0 and grads[False][1].abs().max() == 0


@pytest.mark.parametrize("router_dtype", [None, "fp32", "fp64"])
def test_router_dtype_gating_and_z_loss_match_megatron(router_dtype):
    cfg = _cfg(moe_router_dtype=router_dtype)
    torch.manual_seed(0)
    router = TopKRouter(cfg)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = router(x)
    dtype = torch.float64 if router_dtype == "fp64" else torch.float32
    assert out.logits_TE.dtype == dtype and out.aux_scores_TE.dtype == dtype and out.probs_TK.dtype == torch.float32
    # Megatron's default (None) gates in the input dtype (bf16 here); ours in float32, i.e. its 'fp32'.
    megatron_dtype = {None: torch.float32, "fp32": torch.float32, "fp64": torch.float64}[router_dtype]
    logits = mr.moe_utils.router_gating_linear(x, router.weight.detach(), None, megatron_dtype)
    torch.testing.assert_close(out.logits_TE, logits, rtol=0, atol=0)
    coeff = 1e-3
    got, expected = coeff * z_loss(out.logits_TE), mr.moe_utils.z_loss_func(logits, coeff)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)


def test_input_jitter_matches_megatron(world):
    eps = 0.1
    cfg = _cfg(moe_input_jitter_eps=eps)
    torch.manual_seed(0)
    router = TopKRouter(cfg)
    megatron = mr.megatron_router(cfg, router.weight.detach(), tp_cp_group=world, tp_dp_cp_group=world)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(6), requires_grad=True)

    torch.manual_seed(11)
    logits = router(x).logits_TE
    torch.manual_seed(11)
    jittered = megatron.apply_input_jitter(x)
    assert torch.equal(logits, torch.nn.functional.linear(jittered, router.weight))  # the same draw, bit for bit
    factor = (jittered / x).detach()
    assert factor.min() >= 1 - eps and factor.max() <= 1 + eps and factor.std() > eps / 4
    logits.sum().backward()  # the gradient flows through the jitter: d(x * u)/dx = u
    assert_close(x.grad, factor * router.weight.detach().sum(0), msg="input grad")

    router.eval()  # evaluation routes the input as it is (Megatron would jitter it here too)
    assert torch.equal(router(x).logits_TE, torch.nn.functional.linear(x, router.weight))


def test_data_parallel_2_global_aux_loss_matches_megatron(pool):
    pool.run(cases.dp2_global_aux_loss)


def test_tensor_parallel_2_losses_match_megatron(pool):
    pool.run(cases.tp2_sequence_split_losses)
