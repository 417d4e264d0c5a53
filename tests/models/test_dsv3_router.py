"""The router options DeepSeek-V3 needs from `moe`: a group score over a fixed number of experts
(`moe_router_group_score_topk`, transformers sums the top 2) and `moe_router_norm_topk_prob` (None / True / False),
against a per-token reference written from transformers' rule."""

from __future__ import annotations

import pytest
import torch

from moe import MoEConfig, TopKRouter

pytestmark = pytest.mark.timeout(60)

H, E = 16, 16


def reference_route(scores_E, bias_E, topk, groups, group_topk, score_topk, normalise, scale):
    """One token, transformers' DeepseekV3TopkRouter rule in float64: experts sorted by id, their weights."""
    biased = (scores_E + bias_E).tolist()
    size = E // groups
    group_scores = [sum(sorted(biased[g * size : (g + 1) * size], reverse=True)[:score_topk]) for g in range(groups)]
    kept = sorted(range(groups), key=lambda g: -group_scores[g])[:group_topk]
    candidates = [e for e in range(E) if e // size in kept]
    chosen = sorted(sorted(candidates, key=lambda e: -biased[e])[:topk])
    w = torch.tensor([float(scores_E[e]) for e in chosen], dtype=torch.float64)
    if normalise:
        w = w / (w.sum() + 1e-20)
    return chosen, w * scale


@pytest.mark.parametrize("norm", [None, True, False])
@pytest.mark.parametrize("topk,group_topk", [(8, 2), (1, 2), (6, 3)])
def test_group_score_top2_and_norm_option(topk, group_topk, norm):
    cfg = MoEConfig(
        hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid",
        moe_router_topk=topk, moe_router_num_groups=4, moe_router_group_topk=group_topk,
        moe_router_group_score_topk=2, moe_router_norm_topk_prob=norm, moe_router_topk_scaling_factor=2.5,
        moe_router_enable_expert_bias=True, init_method_std=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    router = TopKRouter(cfg)
    router.expert_bias.bias.copy_(torch.randn(E) * 0.2)
    x = torch.randn(64, H)
    with torch.no_grad():
        out = router(x)
    scores = torch.sigmoid(out.logits_TE.double())
    normalise = topk > 1 if norm is None else norm
    for t in range(x.size(0)):
        chosen, weights = reference_route(
            scores[t], router.expert_bias.bias.double(), topk, 4, group_topk, 2, normalise, 2.5
        )
        order = out.topk_idx_TK[t].argsort()
        assert out.topk_idx_TK[t][order].tolist() == chosen, t
        torch.testing.assert_close(out.probs_TK[t][order].double(), weights, rtol=1e-6, atol=1e-7)


def test_top2_group_score_differs_from_megatrons():
    """With topk 8 over 2 kept groups Megatron scores a group by its top 4; the top-2 rule picks other groups for
    some tokens (so the option is not a no-op)."""
    base = dict(
        hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid",
        moe_router_topk=8, moe_router_num_groups=4, moe_router_group_topk=2, init_method_std=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_rule = TopKRouter(MoEConfig(**base, moe_router_group_score_topk=2))
    megatron = TopKRouter(MoEConfig(**base))
    megatron.load_state_dict(hf_rule.state_dict())
    x = torch.randn(256, H)
    with torch.no_grad():
        a = hf_rule(x).topk_idx_TK.sort(dim=-1).values
        b = megatron(x).topk_idx_TK.sort(dim=-1).values
    assert (a != b).any(dim=-1).sum() > 0


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(moe_router_group_score_topk=2), "needs moe_router_num_groups"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_group_score_topk=5), "exceeds the 4"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_group_score_topk=0), "positive int"),
        (dict(moe_router_score_function="softmax", moe_router_norm_topk_prob=True), "applies to the sigmoid"),
        (dict(moe_router_norm_topk_prob=1), "must be None or a bool"),
    ],
)
def test_router_option_errors(fields, message):
    base = dict(hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid")
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**base, **fields})


def test_group_score_topk_allows_topk_below_group_topk():
    """transformers allows top-1 with 2 kept groups (the group score no longer derives from topk)."""
    MoEConfig(
        hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid",
        moe_router_topk=1, moe_router_num_groups=4, moe_router_group_topk=2, moe_router_group_score_topk=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="must be >= moe_router_group_topk"):
        MoEConfig(
            hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=8, moe_router_score_function="sigmoid",
            moe_router_topk=1, moe_router_num_groups=4, moe_router_group_topk=2,
        )  # fmt: skip
