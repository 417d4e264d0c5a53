"""Parameter counts of configs/671b.toml against DeepSeek's published 671B total / 37B activated (main model, MTP
excluded) and 685B on Hugging Face (main + the MTP module as stored, with its embedding and head copies), and against
a closed form of the architecture written out here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe.trainer.models.deepseek_v3 import DeepseekV3Config, count_parameters, parameter_counts

from .dsv3_testlib import tiny_config

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
CONFIG_671B = ROOT / "examples" / "deepseek_v3" / "configs" / "671b.toml"


def closed_form(c: DeepseekV3Config) -> dict[str, int]:
    """Counts from the shapes (every weight matrix, every norm vector; no buffers)."""
    H, N = c.hidden_size, c.num_attention_heads
    q = c.q_lora_rank
    attn = (H * q + q + q * N * c.qk_head_dim) if q else H * N * c.qk_head_dim
    attn += H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
    attn += c.kv_lora_rank * N * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b_proj
    attn += N * c.v_head_dim * H + 2 * H  # o_proj and the layer's two norms
    expert = 3 * H * c.moe_intermediate_size
    shared = c.n_shared_experts * expert
    router = c.n_routed_experts * H
    dense_layer = attn + 3 * H * c.intermediate_size
    moe_total = attn + router + shared + c.n_routed_experts * expert
    moe_active = attn + router + shared + c.num_experts_per_tok * expert
    dense, moe = c.first_k_dense_replace, c.num_hidden_layers - c.first_k_dense_replace
    emb = c.vocab_size * H
    head = 0 if c.tie_word_embeddings else emb
    total = emb + head + H + dense * dense_layer + moe * moe_total
    activated = H + head + H + dense * dense_layer + moe * moe_active  # one embedding row per token
    mtp = c.num_nextn_predict_layers * (2 * H + 2 * H * H + H + moe_total)
    return dict(total=total, activated=activated, mtp=mtp, stored=mtp + c.num_nextn_predict_layers * (emb + emb))


def test_671b_counts():
    config = DeepseekV3Config.from_toml(CONFIG_671B)
    counts = parameter_counts(config)
    expected = closed_form(config)
    assert (counts.total, counts.activated, counts.mtp_total, counts.mtp_stored) == (
        expected["total"], expected["activated"], expected["mtp"], expected["stored"],
    )  # fmt: skip
    assert abs(counts.total / 671e9 - 1) < 0.01  # 671.03B
    # 36.63B: DeepSeek's "37B" (rounded to whole billions; 1.0% under 37.0B). Counting the whole embedding table
    # instead of one row gives 37.55B.
    assert round(counts.activated / 1e9) == 37
    assert round(counts.activated_with_embedding / 1e9) == 38
    # The MTP module as stored is 13.5B ("14B"), main + MTP 684.5B (Hugging Face shows "685B").
    assert abs(counts.checkpoint_total / 685e9 - 1) < 0.01
    assert count_parameters(config) == (counts.total, counts.activated)


def test_small_configs_count_what_the_model_holds():
    for config in (tiny_config(), tiny_config(q_lora_rank=None, tie_word_embeddings=True, num_nextn_predict_layers=2)):
        from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM

        model = DeepseekV3ForCausalLM(config)
        held = sum(p.numel() for p in model.parameters())
        counts = parameter_counts(config)
        assert counts.total + counts.mtp_total == held
        assert (counts.total, counts.activated, counts.mtp_total) == (
            closed_form(config)["total"], closed_form(config)["activated"], closed_form(config)["mtp"],
        )  # fmt: skip


@pytest.mark.slow  # slow: a subprocess importing torch
def test_cli_prints_the_counts():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "deepseek_v3" / "params.py"), "--config", str(CONFIG_671B)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "671.03B" in result.stdout and "36.63B" in result.stdout, result.stdout
