"""Top-k router: a linear gate in float32 (or float64), softmax or sigmoid scores, optional group- and node-limited
routing, optional input jitter.

Legend: T tokens, H hidden, E experts, K top-k slots, G expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe.layer.balancing import ExpertBias
from moe.layer.moe_config import MoEConfig


@dataclass
class RouterOutput:
    """What the router hands to the dispatcher and to the balancing losses.

    probs_TK: `[T, K] float32` combine weights of the chosen experts (scaling factor applied); float32 whatever
        the router dtype, as the dispatchers carry them (DeepEP's top-k weights are float32).
    topk_idx_TK: `[T, K] int64` chosen experts, in descending order of the selection score.
    logits_TE: `[T, E]` gate logits in the router dtype (float32, or float64 with `moe_router_dtype='fp64'`).
    aux_scores_TE: `[T, E]` (router dtype) per-expert probabilities for the auxiliary losses: softmax over all
        experts, or for sigmoid routing the sigmoid scores normalised to sum to 1 per token.
    """

    probs_TK: torch.Tensor
    topk_idx_TK: torch.Tensor
    logits_TE: torch.Tensor
    aux_scores_TE: torch.Tensor


def group_limited_topk(
    scores_TE: torch.Tensor, topk: int, num_groups: int, group_topk: int, group_score_topk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the best `group_topk` of `num_groups` contiguous expert groups.

    A group's score is the sum of its top `group_score_topk` expert scores (None: `topk // group_topk`, Megatron's
    rule; transformers' DeepSeek-V3 router sums the top 2). Returns `(values [T, K], indices [T, K] int64)` of
    `scores_TE` after masking the other groups to -inf.
    """
    T, E = scores_TE.shape
    scores_TGX = scores_TE.view(T, num_groups, E // num_groups)
    n = topk // group_topk if group_score_topk is None else group_score_topk
    group_scores_TG = scores_TGX.topk(n, dim=-1).values.sum(dim=-1)
    best_groups_TG = group_scores_TG.topk(group_topk, dim=-1).indices
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_groups_TG, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand_as(scores_TGX).reshape(T, E)
    return scores_TE.masked_fill(~expert_mask_TE, float("-inf")).topk(topk, dim=-1)


def node_limited_routing(ep_size: int, ranks_per_node: int, max_nodes_per_token: int) -> dict[str, int]:
    """MoEConfig fields for node-limited routing: one expert group per node of the expert-parallel group.

    Rank `r` owns a contiguous slice of experts, so the ranks of node `n` (ranks `[n*ranks_per_node,
    (n+1)*ranks_per_node)`) own a contiguous slice too, which is exactly expert group `n`. Limiting every token to
    `max_nodes_per_token` groups bounds the inter-node traffic per token (DeepSeek-V3: 4 nodes).

    Returns `{"moe_router_num_groups": nodes, "moe_router_group_topk": max_nodes_per_token}`.
    """
    if ep_size <= 0 or ranks_per_node <= 0 or ep_size % ranks_per_node:
        raise ValueError(f"ep_size={ep_size} must be a positive multiple of ranks_per_node={ranks_per_node}")
    num_nodes = ep_size // ranks_per_node
    if not 1 <= max_nodes_per_token <= num_nodes:
        raise ValueError(f"max_nodes_per_token={max_nodes_per_token} must be in [1, {num_nodes}]")
    return {"moe_router_num_groups": num_nodes, "moe_router_group_topk": max_nodes_per_token}


class TopKRouter(nn.Module):
    """Linear gate `[E, H]` (float32 weight) followed by top-k selection.

    Score functions:
      - softmax: top-k on the logits, then softmax over the k chosen (default); with `moe_router_pre_softmax`,
        softmax over all experts first, then top-k of the probabilities.
      - sigmoid (DeepSeek-V3): scores = sigmoid(logits); selection uses scores + expert_bias (if enabled); the
        weights are the unbiased scores of the chosen experts, normalised over the k (`moe_router_norm_topk_prob`:
        None = when k > 1, as Megatron; True = always; False = never, as transformers' `norm_topk_prob=False`).
    All weights are then multiplied by `moe_router_topk_scaling_factor` (if set). Group-limited routing
    (`moe_router_num_groups`, `moe_router_group_topk`) restricts the selection to the best groups.

    Precision (`moe_router_dtype`): the gate GEMM, the logits and the scores are float64 with 'fp64', float32
    otherwise. Megatron's default (None) gates in the input dtype (bf16 in mixed precision); here None means
    float32, since a bf16 top-k over many experts flips near-tied choices.

    Input jitter (`moe_input_jitter_eps`, Switch Transformer): in training mode the router (only) sees
    `x * u` with `u ~ U(1 - eps, 1 + eps)` drawn per element from torch's global generator. Megatron also jitters
    in eval mode; here evaluation routes the input as it is.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.router_dtype = torch.float64 if config.moe_router_dtype == "fp64" else torch.float32
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size, dtype=torch.float32))
        self.expert_bias = (
            ExpertBias(config.num_moe_experts, config.moe_router_bias_update_rate)
            if config.moe_router_enable_expert_bias
            else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.config.init_method_std)

    def gating(self, x_TH: torch.Tensor) -> torch.Tensor:
        """Logits `[T, E]` in the router dtype; the input and weight are upcast, the product accumulates in it."""
        return F.linear(x_TH.to(self.router_dtype), self.weight.to(self.router_dtype))

    def apply_input_jitter(self, x_TH: torch.Tensor) -> torch.Tensor:
        """`x * u`, `u ~ U(1 - eps, 1 + eps)` elementwise in `x`'s dtype, in training mode with
        `moe_input_jitter_eps` set; `x` itself otherwise."""
        eps = self.config.moe_input_jitter_eps
        if eps is None or not self.training:
            return x_TH
        low = torch.tensor(1.0 - eps, dtype=x_TH.dtype, device=x_TH.device)
        high = torch.tensor(1.0 + eps, dtype=x_TH.dtype, device=x_TH.device)
        # low + U[0, 1) * (high - low), in this order: the same draw as torch.distributions.Uniform.rsample.
        return x_TH * (low + torch.rand(x_TH.shape, dtype=x_TH.dtype, device=x_TH.device) * (high - low))

    def _topk(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        if cfg.moe_router_num_groups is not None:
            return group_limited_topk(
                scores_TE, self.topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk,
                cfg.moe_router_group_score_topk,
            )  # fmt: skip
        return scores_TE.topk(self.topk, dim=-1)

    def route(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From logits to `(probs [T, K] float32, topk_idx [T, K] int64, aux_scores [T, E])`; the scores are
        computed in the logits' dtype."""
        cfg = self.config
        if cfg.moe_router_score_function == "softmax":
            aux_scores_TE = torch.softmax(logits_TE, dim=-1)
            if cfg.moe_router_pre_softmax:
                probs_TK, topk_idx_TK = self._topk(aux_scores_TE)
            else:
                top_logits_TK, topk_idx_TK = self._topk(logits_TE)
                probs_TK = torch.softmax(top_logits_TK, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)
            aux_scores_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
            if self.expert_bias is not None:
                _, topk_idx_TK = self._topk(scores_TE.detach() + self.expert_bias.bias.to(scores_TE.dtype))
                probs_TK = scores_TE.gather(1, topk_idx_TK)
            else:
                probs_TK, topk_idx_TK = self._topk(scores_TE)
            normalise = self.topk > 1 if cfg.moe_router_norm_topk_prob is None else cfg.moe_router_norm_topk_prob
            if normalise:
                probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.moe_router_topk_scaling_factor is not None:
            probs_TK = probs_TK * cfg.moe_router_topk_scaling_factor
        return probs_TK.float(), topk_idx_TK, aux_scores_TE

    def forward(self, x_TH: torch.Tensor) -> RouterOutput:
        """Route `x_TH [T, H]` (any float dtype). Records expert-bias counts in grad-enabled forwards."""
        logits_TE = self.gating(self.apply_input_jitter(x_TH))
        probs_TK, topk_idx_TK, aux_scores_TE = self.route(logits_TE)
        if self.expert_bias is not None:
            self.expert_bias.record(topk_idx_TK)
        return RouterOutput(probs_TK, topk_idx_TK, logits_TE, aux_scores_TE)
