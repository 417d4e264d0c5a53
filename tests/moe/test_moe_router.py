"""TopKRouter variants against per-token reference routing, group/node-limited routing, and MoEConfig checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe import MoEConfig, MoELayer, TopKRouter, node_limited_routing
from moe.layer.router import group_limited_topk

from .moe_testlib import assert_close, moe_config, ref_route_token

pytestmark = pytest.mark.timeout(60)

H, E = 24, 16
ROUTER_LAYER = dict(hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=8)  # the experts do not matter here

ROUTERS = {
    "softmax_top2": dict(),
    "softmax_pre_top4": dict(moe_router_topk=4, moe_router_pre_softmax=True),
    "softmax_pre_top1_scaled": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_router_topk_scaling_factor=3.0),
    "softmax_groups": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2),
    "softmax_pre_groups": dict(
        moe_router_topk=3, moe_router_pre_softmax=True, moe_router_num_groups=8, moe_router_group_topk=3
    ),
    "sigmoid_top6": dict(moe_router_score_function="sigmoid", moe_router_topk=6),
    "sigmoid_top6_fp64": dict(moe_router_score_function="sigmoid", moe_router_topk=6, moe_router_dtype="fp64"),
    "softmax_pre_top2_fp64": dict(moe_router_pre_softmax=True, moe_router_dtype="fp64"),
    "sigmoid_bias_groups_scaled": dict(
        moe_router_score_function="sigmoid",
        moe_router_topk=8,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True,
    ),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_matches_reference(name):
    cfg = moe_config(ROUTER_LAYER, init_method_std=0.5, **ROUTERS[name])
    torch.manual_seed(0)
    router = TopKRouter(cfg)
    bias = None
    if router.expert_bias is not None:
        # Large enough to change some selections, so the test sees the bias at work.
        bias = torch.randn(E) * 0.3
        router.expert_bias.bias.copy_(bias)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    out = router(x)
    assert out.probs_TK.dtype == torch.float32 and out.topk_idx_TK.dtype == torch.int64
    assert out.logits_TE.shape == (40, E) and out.aux_scores_TE.shape == (40, E)
    assert_close(out.aux_scores_TE.sum(dim=1), torch.ones(40), msg="aux scores sum to 1")

    w = router.weight.detach().double()
    logits64 = x.double() @ w.t()
    changed_by_bias = 0
    for t in range(x.size(0)):
        chosen, probs = ref_route_token(logits64[t], out.logits_TE[t], cfg, bias)
        assert out.topk_idx_TK[t].tolist() == chosen, f"token {t}"
        assert_close(out.probs_TK[t], probs, msg=f"token {t} probs")
        if bias is not None:
            unbiased, _ = ref_route_token(logits64[t], out.logits_TE[t], cfg, None)
            changed_by_bias += sorted(unbiased) != sorted(chosen)
    if bias is not None:
        assert changed_by_bias > 0
    if cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_topk > 1:
        scale = cfg.moe_router_topk_scaling_factor or 1.0
        assert_close(out.probs_TK.sum(dim=1), torch.full((40,), scale), msg="normalised over k")


def test_router_gates_in_float32_for_bf16_input():
    router = TopKRouter(moe_config(ROUTER_LAYER))
    x = torch.randn(8, H).bfloat16()
    out = router(x)
    assert out.logits_TE.dtype == torch.float32 and out.probs_TK.dtype == torch.float32
    torch.testing.assert_close(out.logits_TE, F.linear(x.float(), router.weight))


def test_group_limited_topk_keeps_only_best_groups():
    # Two groups of 4; group 1 holds the two best experts of the token, group 0 the single best one.
    scores = torch.tensor([[0.95, 0.0, 0.0, 0.0, 0.9, 0.85, 0.0, 0.0]])
    vals, idx = group_limited_topk(scores, topk=2, num_groups=2, group_topk=1)
    # Group score = sum of its top (2 // 1) = 2 experts: group 0 -> 0.95, group 1 -> 1.75.
    assert idx.tolist() == [[4, 5]]
    vals, idx = scores.topk(2)
    assert idx.tolist() == [[0, 4]]


def test_node_limited_routing_helper():
    fields = node_limited_routing(ep_size=64, ranks_per_node=8, max_nodes_per_token=4)
    assert fields == {"moe_router_num_groups": 8, "moe_router_group_topk": 4}
    cfg = moe_config(ROUTER_LAYER, num_moe_experts=256, moe_router_topk=8, **fields)
    router = TopKRouter(cfg)
    out = router(torch.randn(32, H))
    nodes = out.topk_idx_TK // (256 // 8)  # experts of node n are [n*32, (n+1)*32)
    assert max(len(set(row)) for row in nodes.tolist()) <= 4
    with pytest.raises(ValueError, match="multiple of ranks_per_node"):
        node_limited_routing(ep_size=12, ranks_per_node=8, max_nodes_per_token=1)
    with pytest.raises(ValueError, match="max_nodes_per_token"):
        node_limited_routing(ep_size=16, ranks_per_node=8, max_nodes_per_token=3)


BAD_CONFIGS = [
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(moe_router_topk=17), "exceeds num_moe_experts"),
    (dict(moe_router_score_function="relu"), "moe_router_score_function must be one of"),
    (dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=True), "requires moe_router_score_function"),
    (dict(moe_router_num_groups=4), "must be set together"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "not divisible by moe_router_num_groups"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5), "exceeds moe_router_num_groups"),
    (
        dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=2),
        "must be >= moe_router_group_topk",
    ),
    (dict(moe_router_topk=10, moe_router_num_groups=8, moe_router_group_topk=2), "exceeds the 2 experts of a group"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type must be one of"),
    (dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.1), "needs moe_router_load_balancing_type"),
    (dict(moe_aux_loss_coeff=-0.1), "moe_aux_loss_coeff must be >= 0"),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.1), "of the same length"),
    (dict(moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.1, 0.2]), "of the same length"),
    (dict(moe_aux_loss_coeff=[0.1]), "needs moe_router_load_balancing_type as a list"),
    (dict(moe_router_load_balancing_type=["aux_loss", "aux_loss"], moe_aux_loss_coeff=[0.1, 0.1]), "a type twice"),
    (dict(moe_router_load_balancing_type=["aux_loss", "sinkhorn"], moe_aux_loss_coeff=[0.1, 0.1]), "must be one of"),
    (dict(moe_router_topk=1), "needs moe_router_pre_softmax=True"),
    (dict(moe_router_dtype="bf16"), "moe_router_dtype must be one of"),
    (dict(moe_input_jitter_eps=0.0), "moe_input_jitter_eps must be in"),
    (dict(moe_router_enable_expert_bias=True), "requires the sigmoid score function"),
    (dict(moe_expert_capacity_factor=0.0), "moe_expert_capacity_factor must be > 0"),
    (dict(moe_pad_expert_input_to_capacity=True), "requires moe_expert_capacity_factor"),
    (dict(moe_token_drop_policy="random"), "moe_token_drop_policy must be one of"),
    (dict(moe_shared_expert_overlap=True), "requires moe_shared_expert_intermediate_size"),
    (dict(fp8="e5m2"), "fp8 must be one of"),
    (dict(fp8="e4m3", moe_padded_batch_gemm=True), "moe_padded_batch_gemm is not supported with fp8"),
    (dict(moe_padded_batch_gemm_factor=1.2), "requires moe_padded_batch_gemm=True"),
]


def test_aux_loss_coeffs_lists_the_enabled_losses():
    one = moe_config(ROUTER_LAYER, moe_aux_loss_coeff=0.01)
    assert one.aux_loss_coeffs == {"aux_loss": 0.01}
    assert moe_config(ROUTER_LAYER).aux_loss_coeffs == {}
    several = moe_config(
        ROUTER_LAYER,
        moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss", "aux_loss", "none"],
        moe_aux_loss_coeff=[1e-4, 0.0, 0.01, 0.0],
    )
    assert several.aux_loss_coeffs == {"seq_aux_loss": 1e-4, "aux_loss": 0.01}


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_config_rejects(overrides, message):
    with pytest.raises(ValueError, match=message):
        moe_config(ROUTER_LAYER, **overrides)


def test_unknown_dispatcher_is_refused_where_the_layer_builds_it():
    """The dispatcher name is checked by `build_dispatcher` (the registry's state), in `MoELayer`'s constructor,
    before any communication; the config itself holds any name."""
    config = moe_config(ROUTER_LAYER, moe_token_dispatcher_type="deepspeed")
    with pytest.raises(ValueError, match="names no registered token dispatcher"):
        MoELayer(config)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        MoEConfig(16, 8, 32)


@pytest.mark.parametrize("level", ["light", "full"])
def test_input_jitter_is_replayed_by_recompute(level):
    """Recompute runs the router again in backward: it must draw the same jitter (torch.utils.checkpoint restores
    the RNG state), so outputs and gradients equal those without recompute."""
    from moe import MoELayer

    results = []
    for recompute in (None, level):
        cfg = moe_config(
            ROUTER_LAYER,
            moe_input_jitter_eps=0.2,
            moe_aux_loss_coeff=0.01,
            moe_recompute_level=recompute,
            moe_token_dispatcher_type="alltoall",
        )
        torch.manual_seed(0)
        layer = MoELayer(cfg)
        x = torch.randn(2, 12, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.manual_seed(5)
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, layer.router.weight.grad, layer.experts.w13.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    layer.eval()  # no jitter in evaluation: the same input routes the same way every time
    torch.manual_seed(6)
    first = layer(x).detach()
    assert torch.equal(layer(x).detach(), first)
