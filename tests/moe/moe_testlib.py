"""Straightforward references for the MoE tests: per-token loops in float64, no batching tricks.

Routing *decisions* are taken on float32 scores computed like the layer does (so near-ties resolve the same way);
every differentiable quantity is float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe.layer.moe_config import MoEConfig

# The small layer of the single-process and expert-parallel layer tests: hidden 32, 8 experts of FFN 16.
SMALL_LAYER = dict(hidden_size=32, num_moe_experts=8, moe_ffn_hidden_size=16, init_method_std=0.2)

# DeepSeek-V3-style routing: sigmoid scores, group-limited top-4, scaled weights, expert bias (aux-loss-free
# balancing) and the sequence aux loss.
SIGMOID_V3 = dict(
    moe_router_score_function="sigmoid",
    moe_router_topk=4,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=0.05,
)


def moe_config(base: Mapping[str, Any], **overrides: Any) -> MoEConfig:
    """The tests' one config builder: `MoEConfig` of a test module's `base` fields, `overrides` replacing or adding
    fields."""
    return MoEConfig(**{**base, **overrides})


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB."""
    ref, test = ref.detach().double(), test.detach().double()
    return float(10 * torch.log10(ref.square().sum() / (ref - test).square().sum().clamp(min=1e-300)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5, msg=""):
    assert actual is not None, f"{msg}: got None"
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")


def ref_route_token(
    logits_E: torch.Tensor, logits32_E: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor | None = None
) -> tuple[list[int], torch.Tensor]:
    """One token: the chosen experts (by descending selection score) and their float64 weights.

    logits_E: float64 differentiable logits; logits32_E: float32 logits used for the decisions.
    """
    E, k = cfg.num_moe_experts, cfg.moe_router_topk
    if cfg.moe_router_score_function == "softmax":
        p_all = torch.softmax(logits_E, dim=0)
        select = torch.softmax(logits32_E, dim=0) if cfg.moe_router_pre_softmax else logits32_E
    else:
        s_all = torch.sigmoid(logits_E)
        select = torch.sigmoid(logits32_E)
        if bias_E is not None:
            select = select + bias_E.float()
    sel = select.tolist()
    allowed = list(range(E))
    if cfg.moe_router_num_groups is not None:
        groups, per = cfg.moe_router_num_groups, E // cfg.moe_router_num_groups
        take = k // cfg.moe_router_group_topk
        group_score = [sum(sorted(sel[g * per : (g + 1) * per], reverse=True)[:take]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -group_score[g])[: cfg.moe_router_group_topk]
        allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
    chosen = sorted(allowed, key=lambda e: -sel[e])[:k]
    idx = torch.tensor(chosen)
    if cfg.moe_router_score_function == "softmax":
        probs = p_all[idx] if cfg.moe_router_pre_softmax else torch.softmax(logits_E[idx], dim=0)
    else:
        w = s_all[idx]
        probs = w / w.sum() if k > 1 else w
    if cfg.moe_router_topk_scaling_factor is not None:
        probs = probs * cfg.moe_router_topk_scaling_factor
    return chosen, probs


def ref_capacity_keep(chosen: list[list[int]], probs: list[list[float]], num_experts: int, capacity: int, policy: str):
    """`keep[t][k]` by looping over experts: 'probs' keeps the highest weights, 'position' the earliest tokens."""
    keep = [[False] * len(c) for c in chosen]
    for e in range(num_experts):
        slots = [(t, k) for t, c in enumerate(chosen) for k, ce in enumerate(c) if ce == e]
        if policy == "probs":
            slots = sorted(slots, key=lambda s: -probs[s[0]][s[1]])
        for t, k in slots[:capacity]:
            keep[t][k] = True
    return keep


def swiglu_row(x_H: torch.Tensor, w13_H2F: torch.Tensor, w2_FH: torch.Tensor) -> torch.Tensor:
    h = x_H @ w13_H2F
    gate, up = h.chunk(2)
    return (F.silu(gate) * up) @ w2_FH


def ref_moe(
    x_TH: torch.Tensor,
    params: dict[str, torch.Tensor],
    cfg: MoEConfig,
    *,
    num_seqs: int = 1,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Dense MoE reference. `params` holds float64 `router [E, H]`, `w13 [E, H, 2F]`, `w2 [E, F, H]` and
    optionally `shared_w13 [H, 2Fs]`, `shared_w2 [Fs, H]`. Returns `(out [T, H], losses (coefficients applied),
    number of dropped slots)`."""
    T, _ = x_TH.shape
    E, k = cfg.num_moe_experts, cfg.moe_router_topk
    logits_TE = x_TH @ params["router"].t()
    logits32_TE = F.linear(x_TH.detach().float(), params["router"].detach().float())
    chosen, probs = [], []
    for t in range(T):
        c, p = ref_route_token(logits_TE[t], logits32_TE[t], cfg, expert_bias)
        chosen.append(c)
        probs.append(p)
    keep = [[True] * k for _ in range(T)]
    if cfg.moe_expert_capacity_factor is not None:
        capacity = math.ceil(T * k / E * cfg.moe_expert_capacity_factor)
        keep = ref_capacity_keep(chosen, [p.tolist() for p in probs], E, capacity, cfg.moe_token_drop_policy)
    dropped = sum(not kk for row in keep for kk in row)
    rows = []
    for t in range(T):
        acc = torch.zeros_like(x_TH[t])
        for j, e in enumerate(chosen[t]):
            if keep[t][j]:
                acc = acc + probs[t][j] * swiglu_row(x_TH[t], params["w13"][e], params["w2"][e])
        if "shared_w13" in params:
            acc = acc + swiglu_row(x_TH[t], params["shared_w13"], params["shared_w2"])
        rows.append(acc)
    out_TH = torch.stack(rows)

    losses: dict[str, torch.Tensor] = {}
    kind = cfg.moe_router_load_balancing_type
    if cfg.moe_router_score_function == "softmax":
        aux_TE = torch.softmax(logits_TE, dim=1)
    else:
        s = torch.sigmoid(logits_TE)
        aux_TE = s / s.sum(dim=1, keepdim=True)
    # The balancing losses count a plain top-k of the unbiased probabilities (no group limit, no expert bias),
    # decided on float32 probabilities like the layer's.
    with torch.no_grad():
        if cfg.moe_router_score_function == "softmax":
            aux32_TE = torch.softmax(logits32_TE, dim=1)
        else:
            s32 = torch.sigmoid(logits32_TE)
            aux32_TE = s32 / (s32.sum(dim=1, keepdim=True) + 1e-20)
        counted = aux32_TE.topk(k, dim=1).indices.tolist()
    if cfg.moe_aux_loss_coeff > 0 and kind in ("aux_loss", "global_aux_loss", "seq_aux_loss"):
        seqs = num_seqs if kind == "seq_aux_loss" else 1
        S = T // seqs
        total = 0.0
        for b in range(seqs):
            toks = range(b * S, (b + 1) * S)
            loss_b = 0.0
            for e in range(E):
                f_e = sum(counted[t].count(e) for t in toks) / (S * k)
                P_e = sum(aux_TE[t, e] for t in toks) / S
                loss_b = loss_b + f_e * P_e
            total = total + E * loss_b
        losses[kind] = cfg.moe_aux_loss_coeff * total / seqs
    if cfg.moe_z_loss_coeff:
        lse = torch.stack([torch.log(torch.exp(logits_TE[t]).sum()) for t in range(T)])
        losses["z_loss"] = cfg.moe_z_loss_coeff * (lse**2).mean()
    return out_TH, losses, dropped


def layer_params_double(layer) -> dict[str, torch.Tensor]:
    """float64 leaf copies of a single-process MoELayer's parameters, for `ref_moe`."""
    params = {
        "router": layer.router.weight,
        "w13": layer.experts.w13,
        "w2": layer.experts.w2,
    }
    if layer.shared_experts is not None:
        params["shared_w13"] = layer.shared_experts.w13
        params["shared_w2"] = layer.shared_experts.w2
    return {name: p.detach().double().clone().requires_grad_() for name, p in params.items()}


def layer_grads(layer) -> dict[str, torch.Tensor | None]:
    grads = {"router": layer.router.weight.grad, "w13": layer.experts.w13.grad, "w2": layer.experts.w2.grad}
    if layer.shared_experts is not None:
        grads["shared_w13"] = layer.shared_experts.w13.grad
        grads["shared_w2"] = layer.shared_experts.w2.grad
    return grads


def ep_group(ctx) -> dist.ProcessGroup:
    """The expert-parallel group of a `RankPool` rank: an explicit group of every rank (not the default one), created
    once per pool (collective, on first use)."""
    if "ep_group" not in ctx.cache:
        ctx.cache["ep_group"] = dist.new_group(list(range(ctx.world_size)))
    return ctx.cache["ep_group"]
