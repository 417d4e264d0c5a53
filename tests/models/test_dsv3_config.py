"""DeepseekV3Config: the TOML configs, config.json round trips (transformers' and the release's legacy rope_scaling),
and clear errors for bad settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe.trainer.models.deepseek_v3 import DeepseekV3Config
from moe.trainer.models.deepseek_v3.rope import inverse_frequencies, softmax_scale

from .dsv3_testlib import TINY, YARN, tiny_config

pytestmark = pytest.mark.timeout(60)

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "configs"


@pytest.mark.parametrize("name", ["tiny", "small", "671b"])
def test_toml_configs_load(name):
    config = DeepseekV3Config.from_toml(CONFIGS / f"{name}.toml")
    assert config.rope_parameters["rope_type"] in ("default", "yarn")
    assert DeepseekV3Config.from_dict(config.to_dict()) == config


def test_671b_matches_the_release():
    c = DeepseekV3Config.from_toml(CONFIGS / "671b.toml")
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok) == (7168, 61, 256, 8)
    assert (c.n_group, c.topk_group, c.first_k_dense_replace, c.q_lora_rank, c.kv_lora_rank) == (8, 4, 3, 1536, 512)
    assert c.rope_parameters["factor"] == 40.0 and c.rope_parameters["mscale_all_dim"] == 1.0
    # YaRN with mscale_all_dim: the softmax scale is 192^-0.5 * (0.1 ln 40 + 1)^2.
    assert softmax_scale(c.rope_parameters, c.qk_head_dim) == pytest.approx(192**-0.5 * (0.1 * 3.6888794541 + 1) ** 2)


def test_release_config_json_with_legacy_rope_scaling():
    """The official config.json: `rope_scaling` with `type`, top-level `rope_theta`, and keys of its own code."""
    release = dict(TINY, rope_parameters=None, rope_theta=10000, hidden_act="silu", topk_method="noaux_tc",
                   scoring_func="sigmoid", quantization_config={"fmt": "e4m3", "weight_block_size": [128, 128]},
                   rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 32,
                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})  # fmt: skip
    del release["rope_parameters"]
    config = DeepseekV3Config.from_dict(release)
    assert config.rope_parameters == {**YARN, "factor": 4.0} | {"rope_theta": 10000}


def test_hf_dict_is_accepted_by_transformers():
    transformers = pytest.importorskip("transformers")
    config = tiny_config(rope_parameters=YARN, q_lora_rank=None)
    hf = transformers.DeepseekV3Config(**config.to_hf_dict())
    assert hf.model_type == "deepseek_v3" and hf.q_lora_rank is None
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 4.0
    back = DeepseekV3Config.from_dict(hf.to_dict())
    assert back.to_hf_dict() == config.to_hf_dict()


def test_yarn_frequencies_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config(rope_parameters=YARN)
    hf = transformers.DeepseekV3Config(**config.to_hf_dict())
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    got, factor = inverse_frequencies(config.rope_parameters, config.qk_rope_head_dim)
    assert factor == pytest.approx(expected_factor, rel=1e-12) and factor != 1.0
    assert (got - expected).abs().max() == 0  # same float32 formula


def test_extensions_and_toml_strictness(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nvocab_size = 64\nhidden_sise = 32\n")
    with pytest.raises(ValueError, match="unknown DeepseekV3Config fields.*hidden_sise"):
        DeepseekV3Config.from_toml(path)
    config = DeepseekV3Config.from_dict({**TINY, "mtdeepep": {"mtp_loss_weight": 0.1, "seq_aux_loss_coeff": 1e-4}})
    assert (config.mtp_loss_weight, config.seq_aux_loss_coeff, config.bias_update_speed) == (0.1, 1e-4, 1e-3)


BAD = {
    "experts_not_divisible_into_groups": (dict(n_routed_experts=10, n_group=4), "not divisible into n_group"),
    "topk_group_above_groups": (dict(topk_group=5), "topk_group=5 exceeds n_group=4"),
    "topk_above_kept_groups": (dict(num_experts_per_tok=5), "exceeds the 4 experts of the topk_group=2 groups"),
    "one_expert_per_group": (dict(n_group=8, topk_group=4), "at least 2 experts"),
    "kv_heads_differ": (dict(num_key_value_heads=2), "must equal num_attention_heads"),
    "odd_rope_dim": (dict(qk_rope_head_dim=15), "must be even"),
    "zero_q_lora": (dict(q_lora_rank=0), "q_lora_rank must be > 0 or None"),
    "negative_dense": (dict(first_k_dense_replace=-1), "first_k_dense_replace must be >= 0"),
    "bad_rope_type": (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "rope_type must be one of"),
    "yarn_without_factor_source": (
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": -2.0}),
        "factor must be > 0",
    ),
    "rope_key_of_other_type": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}),
        "do not apply to rope_type 'default'",
    ),
    "float_for_int": (dict(hidden_size=64.0), "hidden_size must be an int"),
    "string_for_bool": (dict(norm_topk_prob="yes"), "norm_topk_prob must be a bool"),
    "negative_mtp_weight": (dict(mtp_loss_weight=-0.1), "mtp_loss_weight must be >= 0"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_config_is_a_clear_error(name):
    overrides, message = BAD[name]
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_bad_hidden_act_and_model_arguments():
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        DeepseekV3Config.from_dict({**TINY, "hidden_act": "gelu"})
    from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM

    with pytest.raises(ValueError, match="moe_options may not override"):
        DeepseekV3ForCausalLM(tiny_config(), device="meta", moe_options={"moe_router_topk": 2})
    model = DeepseekV3ForCausalLM(tiny_config(num_hidden_layers=1, num_nextn_predict_layers=0))
    import torch

    with pytest.raises(ValueError, match="input_ids must be"):
        model(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="labels must be"):
        model(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model(torch.zeros(1, 257, dtype=torch.int64))
