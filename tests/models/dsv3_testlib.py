"""Tiny DeepSeek-V3 configs and helpers shared by the model tests (transformers' model is the reference)."""

from __future__ import annotations

import math
from typing import Any

import torch

from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

# Hidden 64, 3 layers (the first dense), 8 experts in 4 groups (2 kept), top-3, one MTP module. The value head dim
# (16) differs from the query/key head dim (24 + 16): MLA's shapes, not a square attention.
TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    v_head_dim=16,
    qk_nope_head_dim=24,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_nextn_predict_layers=1,
)

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,  # != mscale: the cos/sin factor and the softmax scale both differ from 1
}

# The parity cases against transformers: every MLA/rope/routing variant at least once.
HF_CASES: dict[str, dict[str, Any]] = {
    # q_a/q_b with LoRA, YaRN, interleaved rope, normalised weights, 2 of 4 groups kept.
    "qlora_yarn_norm_groups": dict(rope_parameters=YARN),
    # plain q_proj with attention biases (not fused), default rope in the half layout, unnormalised weights, 1 of 2
    # groups, tied embeddings, two dense layers, two MTP depths.
    "qproj_bias_default_unnorm_tied": dict(
        q_lora_rank=None,
        attention_bias=True,
        rope_interleave=False,
        norm_topk_prob=False,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        first_k_dense_replace=2,
        num_nextn_predict_layers=2,
    ),
}


def tiny_config(**overrides: Any) -> DeepseekV3Config:
    return DeepseekV3Config(**{**TINY, **overrides})


def tokens(config: DeepseekV3Config, batch: int, seq: int, seed: int = 0, ignore: int = 3):
    """`(input_ids, labels)` `[batch, seq]` int64; labels = input_ids with `ignore` random positions set to -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    labels = ids.clone()
    flat = labels.view(-1)
    flat[torch.randperm(flat.numel(), generator=gen)[:ignore]] = -100
    return ids, labels


@torch.no_grad()
def randomize_hf_model(model: torch.nn.Module, seed: int) -> None:
    """Give a transformers model weights that make a wrong formula visible: linear weights N(0, 1/fan_in) (O(1)
    activations), norm weights 1 + N(0, 0.1^2), embeddings N(0, 1), decisive router logits, and a random
    e_score_correction_bias (so the bias changes some selections while the weights stay unbiased)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name or name == "lm_head.weight":
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            fan_in = p.shape[-1]
            std = (3.0 if name.endswith("mlp.gate.weight") else 1.0) / math.sqrt(fan_in)
            p.copy_(std * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def hf_model(config: DeepseekV3Config, seed: int = 0):
    """A randomised transformers `DeepseekV3ForCausalLM` (float32, eval mode) of `config`."""
    import transformers

    hf_config = transformers.DeepseekV3Config(**config.to_hf_dict())
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    randomize_hf_model(model, seed)
    return model


def our_model(config: DeepseekV3Config, state_dict: dict[str, torch.Tensor] | None = None, **kwargs):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config, **kwargs)
    if state_dict is not None:
        model.load_full_state_dict(state_dict)
    return model.eval()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (float64)."""
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).abs().max() / e.abs().max().clamp(min=1e-30))
