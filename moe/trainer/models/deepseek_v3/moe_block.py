"""DeepSeekMoE on `moe.MoELayer`: the `MoEConfig` that reproduces transformers' DeepSeek-V3 MoE block.

transformers' `DeepseekV3MoE` -> MoELayer settings:
- router: sigmoid scores of an FP32 gate; selection on `scores + e_score_correction_bias` (the aux-loss-free
  `ExpertBias`, updated by `moe.update_expert_bias` at `bias_update_speed`); group-limited to the best `topk_group`
  of `n_group` groups, a group scored by the sum of its top-2 biased scores (`moe_router_group_score_topk=2`);
  weights are the unbiased scores, divided by their sum (+1e-20) when `norm_topk_prob`, times
  `routed_scaling_factor`.
- experts: `n_routed_experts` SwiGLU experts of `moe_intermediate_size` (grouped GEMM), dropless.
- shared experts: one SwiGLU MLP of `n_shared_experts * moe_intermediate_size`.
- balancing: DeepSeek's sequence-wise loss ('seq_aux_loss') with `seq_aux_loss_coeff` (0 = off).
"""

from __future__ import annotations

from typing import Any

from moe.layer.moe_config import MoEConfig
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config

# transformers' DeepseekV3TopkRouter scores a group by the sum of its top-2 (biased) expert scores.
HF_GROUP_SCORE_TOPK = 2


def moe_config(config: DeepseekV3Config, overrides: dict[str, Any] | None = None) -> MoEConfig:
    """The `MoEConfig` of every MoE layer of `config`. `overrides`: other MoEConfig fields (recompute level, fp8,
    shared-expert overlap, dispatcher, ...); the fields that define the DeepSeek-V3 maths may not be overridden."""
    grouped = config.n_group > 1
    fields: dict[str, Any] = dict(
        hidden_size=config.hidden_size,
        num_moe_experts=config.n_routed_experts,
        moe_ffn_hidden_size=config.moe_intermediate_size,
        moe_router_topk=config.num_experts_per_tok,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=config.routed_scaling_factor,
        moe_router_num_groups=config.n_group if grouped else None,
        moe_router_group_topk=config.topk_group if grouped else None,
        moe_router_group_score_topk=HF_GROUP_SCORE_TOPK if grouped else None,
        moe_router_norm_topk_prob=config.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=config.seq_aux_loss_coeff,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=config.bias_update_speed,
        moe_shared_expert_intermediate_size=(config.n_shared_experts * config.moe_intermediate_size) or None,
        moe_token_dispatcher_type="flex",
        init_method_std=config.initializer_range,
    )
    fixed = set(fields) - {"moe_token_dispatcher_type"}
    overrides = dict(overrides or {})
    clash = sorted(fixed & set(overrides))
    if clash:
        raise ValueError(f"moe_options may not override {clash}: they follow from the DeepseekV3Config")
    fields.update(overrides)
    return MoEConfig(**fields)
