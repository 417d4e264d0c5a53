"""Importing the official release format: FP8 E4M3 weights with 128x128 block `weight_scale_inv`, a sharded index,
legacy `rope_scaling`, MTP weights under `model.layers.{num_hidden_layers}` with their embedding/head copies.

The checkpoint is built here with an independent block quantiser (plain torch: scale = block amax / 448). Bounds:
E4M3 has 3 mantissa bits, so a dequantised value is within 2^-4 of the original, relatively, plus half the smallest
subnormal step (2^-10 * scale) in absolute terms; the import itself must be exact (`q * scale` per block).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from moe.trainer.models.deepseek_v3 import read_model_dir
from moe.trainer.models.deepseek_v3.hf import dequantize_fp8, import_hf, to_hf_state_dict

from .dsv3_testlib import our_model, tiny_config, tokens

pytestmark = pytest.mark.timeout(120)

BLOCK = 128
# GEMM reduction dims multiples of 128; kv_a_proj_with_mqa has 128 + 64 = 192 rows (a partial block, as the
# release's 576) and the vocabulary 320 rows.
FP8_SHAPES = dict(
    vocab_size=320, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
    q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
)  # fmt: skip


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent 128x128 block quantiser: (e4m3 [M, K], float32 scale_inv [ceil(M/128), ceil(K/128)])."""
    M, K = w.shape
    rows, cols = -(-M // BLOCK), -(-K // BLOCK)
    scale = torch.empty(rows, cols)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def expand(scale: torch.Tensor, M: int, K: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0)[:M].repeat_interleave(BLOCK, 1)[:, :K]


def is_quantised_in_release(key: str, t: torch.Tensor) -> bool:
    # Every linear projection (attention, MLPs, experts, eh_proj); not the embedding, router, norms or heads.
    return t.dim() == 2 and "proj" in key and key.endswith(".weight")


def write_release_checkpoint(path, hf_state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """FP8 + scales in two shards with an index, legacy config.json; returns the float originals."""
    path.mkdir()
    originals, tensors = {}, {}
    for key, t in hf_state.items():
        if is_quantised_in_release(key, t):
            originals[key] = t
            tensors[key], tensors[key + "_scale_inv"] = quantise(t)
        else:
            tensors[key] = t
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: tensors[k].contiguous() for k in names}, str(path / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: n for n, names in shards.items() for k in names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = config.to_hf_dict()
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope if rope["type"] != "default" else None
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [BLOCK, BLOCK]}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    return originals


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_release_import(tmp_path, dtype):
    config = tiny_config(**FP8_SHAPES)
    ours = our_model(config, dtype=dtype)
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(5.0)
    hf_state = to_hf_state_dict(ours.full_state_dict(), config)
    assert hf_state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (192, 256)
    originals = write_release_checkpoint(tmp_path / "release", hf_state, config)
    messages = []
    import_hf(tmp_path / "release", tmp_path / "ckpt", fp8_dtype=torch.float32, log=messages.append)
    assert any(f"dequantised {len(originals)} FP8 weights" in m for m in messages), messages
    assert not any("initialised freshly" in m for m in messages)  # the MTP layer was in the checkpoint

    state, imported = read_model_dir(tmp_path / "ckpt")
    assert imported.rope_parameters == config.rope_parameters
    back = to_hf_state_dict(state, imported)
    for key, w in originals.items():
        got = back[key]
        assert got.dtype == torch.float32, key
        q, scale = quantise(w)
        exact = q.float() * expand(scale, *w.shape)
        assert torch.equal(got, exact), key
        bound = w.float().abs() * 2**-4 + expand(scale, *w.shape) * 2**-10
        assert ((got - w.float()).abs() <= bound).all(), key
    # Not quantised in the release: exact, in the dtype found.
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.gate.e_score_correction_bias", "model.norm.weight"):
        assert back[key].dtype == hf_state[key].dtype and torch.equal(back[key], hf_state[key]), key

    model = our_model(imported, state)
    ids, labels = tokens(config, batch=1, seq=8)
    with torch.no_grad():
        out = model(ids, labels)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.mtp_loss)


def test_default_dequant_dtype_is_the_checkpoints(tmp_path):
    config = tiny_config(**FP8_SHAPES, num_nextn_predict_layers=0)
    hf_state = to_hf_state_dict(our_model(config, dtype=torch.bfloat16).full_state_dict(), config)
    write_release_checkpoint(tmp_path / "release", hf_state, config)
    messages = []
    import_hf(tmp_path / "release", tmp_path / "ckpt", log=messages.append)
    assert any("to torch.bfloat16" in m for m in messages), messages
    state, _ = read_model_dir(tmp_path / "ckpt")
    assert state["layers.0.self_attn.qkv_a_proj.weight"].dtype == torch.bfloat16


def test_fp8_errors():
    w = torch.randn(200, 130)
    q, scale = quantise(w)
    with pytest.raises(ValueError, match="has no w_scale_inv"):
        dequantize_fp8({"w": q}, torch.float32)
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        dequantize_fp8({"w": q, "w_scale_inv": scale[:1]}, torch.float32)
    with pytest.raises(ValueError, match="scales no tensor"):
        dequantize_fp8({"v_scale_inv": scale}, torch.float32)
