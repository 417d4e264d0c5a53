"""Parameter counts of a DeepSeek-V3 config, on the meta device (nothing is allocated).

What DeepSeek counts (report, section 1; the Hugging Face model card): "671B total parameters with 37B activated for
each token" are the main model's, MTP excluded; the released checkpoint adds 14B of MTP weights ("685B" on Hugging
Face), and those 14B include the MTP module's stored copies of the embedding and the output head.

`ParameterCounts` fields:
    total: main model parameters (embedding, decoder layers, final norm, output head; MTP excluded).
    activated: main model parameters one token computes with: every routed expert weight counts K/E of itself (K
        of the E experts run), and the embedding counts one row (a token reads one row of the table; the output
        head counts in full).
    activated_with_embedding: `activated` counting the whole embedding table (another convention).
    mtp_total / mtp_activated: the MTP modules' own parameters (the embedding and head are shared, not counted).
    mtp_stored: the MTP modules as the release stores them (plus one embedding and one head copy per module).
    checkpoint_total: `total + mtp_stored`, what the released files hold (FP8 scales not counted).
The expert-bias buffer (`e_score_correction_bias`) is a buffer, not a parameter: not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.layer.experts import SwiGLUExperts
from moe.trainer.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    activated: int
    activated_with_embedding: int
    mtp_total: int
    mtp_activated: int
    mtp_stored: int
    checkpoint_total: int


def parameter_counts(config: DeepseekV3Config) -> ParameterCounts:
    """Count on a meta-device model (see the module docstring)."""
    model = DeepseekV3ForCausalLM(config, device="meta")
    routed_fraction = config.num_experts_per_tok / config.n_routed_experts

    def count(module, *, skip_embedding: bool = False) -> tuple[int, float]:
        total, activated = 0, 0.0
        expert_params = {id(p) for m in module.modules() if isinstance(m, SwiGLUExperts) for p in m.parameters()}
        for p in module.parameters():
            if skip_embedding and p is model.embed_tokens.weight:
                continue
            total += p.numel()
            activated += p.numel() * (routed_fraction if id(p) in expert_params else 1.0)
        return total, activated

    main = [model.embed_tokens, model.layers, model.norm] + ([model.lm_head] if model.lm_head is not None else [])
    total = activated = 0
    for part in main:
        t, a = count(part)
        total, activated = total + t, activated + a
    embedding = model.embed_tokens.weight.numel()
    mtp_total, mtp_activated = count(model.mtp)
    copies = config.num_nextn_predict_layers * (embedding + model.output_weight.numel())
    return ParameterCounts(
        total=total,
        activated=round(activated - embedding + config.hidden_size),
        activated_with_embedding=round(activated),
        mtp_total=mtp_total,
        mtp_activated=round(mtp_activated),
        mtp_stored=mtp_total + copies,
        checkpoint_total=total + mtp_total + copies,
    )


def count_parameters(config: DeepseekV3Config) -> tuple[int, int]:
    """`(total, activated)` of the main model as DeepSeek counts them (MTP excluded; see the module docstring)."""
    counts = parameter_counts(config)
    return counts.total, counts.activated
