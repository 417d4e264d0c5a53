"""Parity with transformers' DeepseekV3ForCausalLM (5.23) in float32, both directions of the checkpoint conversion.

Tolerance: the two models do the same float32 maths in a different order (fused projections, grouped expert GEMMs,
the combine's summation order, SDPA kernels), so results agree to float32 rounding accumulated over a few layers:
relative 1e-5 of the logits' scale is the bound asserted (measured: a few 1e-7). The loss is compared at 1e-5
relative as well.
"""

from __future__ import annotations

import pytest
import torch

from moe.trainer.models.deepseek_v3 import read_model_dir
from moe.trainer.models.deepseek_v3.hf import export_hf, import_hf
from moe.trainer.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_dir import write_model_dir

from .dsv3_testlib import HF_CASES, hf_model, our_model, rel_err, tiny_config, tokens

pytestmark = pytest.mark.timeout(120)
transformers = pytest.importorskip("transformers")

LOGITS_RTOL = 1e-5
LOSS_RTOL = 1e-5


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_import_matches_transformers(case, tmp_path):
    config = tiny_config(**HF_CASES[case])
    hf = hf_model(config, seed=1)
    hf.save_pretrained(tmp_path / "hf")
    messages = []
    import_hf(tmp_path / "hf", tmp_path / "ckpt", log=messages.append)
    # transformers saves no MTP layers: the import says it initialised them.
    assert any("MTP" in m and "initialised freshly" in m for m in messages), messages
    state, imported = read_model_dir(tmp_path / "ckpt")
    assert imported.to_hf_dict() == config.to_hf_dict()
    ours = our_model(config, state)

    ids, labels = tokens(config, batch=3, seq=24, seed=2)
    with torch.no_grad():
        expected = hf(input_ids=ids, labels=labels)
        got = ours(ids, labels)
    assert got.logits.dtype == torch.float32
    assert rel_err(got.logits, expected.logits) < LOGITS_RTOL
    assert abs(float(got.loss) - float(expected.loss)) < LOSS_RTOL * float(expected.loss)
    assert int(got.num_tokens) == int((labels[:, 1:] != -100).sum())


def test_group_limit_changes_some_choices():
    """The parity config's groups really mask experts: for some token the group-limited top-k differs from a
    plain top-k of the same biased scores (so the parity test exercises the group rule)."""
    config = tiny_config(**HF_CASES["qlora_yarn_norm_groups"])
    hf = hf_model(config, seed=1)
    ours = our_model(config)
    ours.load_full_state_dict(_state_from_hf(hf, config))
    routed = {}
    layer = ours.layers[config.first_k_dense_replace].mlp
    hook = layer.router.register_forward_hook(lambda m, args, out: routed.update(x=args[0], out=out))
    ids, _ = tokens(config, batch=3, seq=24, seed=2)
    with torch.no_grad():
        ours(ids)
    hook.remove()
    scores = torch.sigmoid(routed["out"].logits_TE) + layer.router.expert_bias.bias
    plain = scores.topk(config.num_experts_per_tok, dim=-1).indices.sort(dim=-1).values
    grouped = routed["out"].topk_idx_TK.sort(dim=-1).values
    assert (plain != grouped).any(dim=-1).sum() > 0


def _state_from_hf(hf, config):
    from moe.trainer.models.deepseek_v3.hf import from_hf_state_dict

    return from_hf_state_dict(dict(hf.state_dict()), config, log=lambda m: None)


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_export_loads_in_transformers(case, tmp_path):
    """Our weights, exported, give transformers the same logits; the MTP modules' weights load into
    transformers' MtpModel under the official keys and give the same MTP logits."""
    config = tiny_config(**HF_CASES[case])
    torch.manual_seed(3)
    ours = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, and a non-zero expert bias
        for name, p in ours.named_parameters():
            p.mul_(10.0 if "norm" not in name else 1.0)
        for layer in ours.moe_layers():
            layer.router.expert_bias.bias.normal_(0, 0.05)
    write_model_dir(tmp_path / "ckpt", ours.full_state_dict(), config)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=200_000)  # several shards + an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.dtype == torch.float32

    ids, labels = tokens(config, batch=2, seq=20, seed=4)
    with torch.no_grad():
        expected = hf(input_ids=ids, labels=labels, output_hidden_states=True)
        got = ours(ids, labels)
    assert rel_err(got.logits, expected.logits) < LOGITS_RTOL
    assert abs(float(got.loss) - float(expected.loss)) < LOSS_RTOL * float(expected.loss)
    _check_mtp_against_transformers(hf, ours, config, ids, labels, expected.hidden_states[-1], got)


def _check_mtp_against_transformers(hf, ours, config, ids, labels, last_hidden, got):
    """transformers' MtpModel (depth k: embedding of token t+k at position t+k, hidden of the previous depth) on the
    whole shifted sequence: its per-depth mean cross entropy equals ours."""
    from transformers.modeling_layers import MtpModel

    # transformers finds the MTP keys through the main model's ignore patterns, written for the 671B model's layer 61.
    N = config.num_hidden_layers
    hf._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{N + k}\..*" for k in range(config.num_nextn_predict_layers)
    ]
    mtp = MtpModel.from_pretrained(hf).eval()
    S = ids.size(1)
    hidden = last_hidden
    with torch.no_grad():
        for depth in range(1, config.num_nextn_predict_layers + 1):
            length = S - depth
            positions = torch.arange(depth, S).unsqueeze(0)
            hidden = mtp.forward_layer(depth - 1, hidden[:, :length], positions, None, input_ids=ids[:, depth:])
            logits = mtp._project_to_logits(hidden)[:, : length - 1]
            targets = labels[:, depth + 1 :]
            expected = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
            )
            ours_mean = got.mtp_loss_sums[depth - 1] / got.mtp_num_tokens[depth - 1]
            assert abs(float(ours_mean) - float(expected)) < LOSS_RTOL * float(expected), depth


@pytest.mark.slow  # slow: the hf.py CLI twice
def test_cli_round_trip_is_lossless_in_bfloat16(tmp_path):
    """save_pretrained (bfloat16) -> `hf.py import` -> `hf.py export`: every tensor transformers wrote comes back
    bitwise, in its dtype (no silent casts); the export adds the MTP layer the import initialised."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    config = tiny_config(num_nextn_predict_layers=1)
    hf_model(config, seed=5).to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    script = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "hf.py"
    for args in (["import", "--hf", tmp_path / "hf", "--out", tmp_path / "ckpt"],
                 ["export", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "hf2"]):  # fmt: skip
        result = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        if args[0] == "import":
            assert "initialised freshly" in result.stdout, result.stdout
    state, _ = read_model_dir(tmp_path / "ckpt")
    assert state["layers.1.self_attn.qkv_a_proj.weight"].dtype == torch.bfloat16
    assert state["layers.1.mlp.router.expert_bias.bias"].dtype == torch.float32
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = load_file(str(tmp_path / "hf2" / "model.safetensors"))
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    assert set(exported) - set(original) == {k for k in exported if k.startswith(mtp_prefix)}
    assert set(original) <= set(exported)
    for key, value in original.items():
        if key.endswith("e_score_correction_bias"):  # always float32 (an exact upcast of the bfloat16 values)
            assert exported[key].dtype == torch.float32 and torch.equal(exported[key], value.float()), key
        else:
            assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key


def _sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * torch.log10(ref.square().sum() / (ref - x).square().sum().clamp(min=1e-300)))


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_bfloat16_is_as_accurate_as_transformers(case):
    """In bfloat16 both models round differently, so they are compared with the float32 result instead: ours must
    be as close to it as transformers' bfloat16 model is (SQNR of the logits within 3 dB; measured 24.2 vs 23.3 dB and
    37.6 vs 37.9 dB: a routing flip or two on these decisive random weights dominates)."""
    from moe.trainer.models.deepseek_v3.hf import from_hf_state_dict

    config = tiny_config(**HF_CASES[case])
    hf = hf_model(config, seed=1)
    state = from_hf_state_dict(dict(hf.state_dict()), config, log=lambda m: None)
    ours = our_model(config, state, dtype=torch.bfloat16)
    hf16 = hf_model(config, seed=1).to(torch.bfloat16)
    for name, buf in hf16.named_buffers():  # transformers keeps this buffer in float32 (from_pretrained does)
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()
    ids, labels = tokens(config, batch=3, seq=24, seed=2)
    with torch.no_grad():
        truth, got, theirs = hf(input_ids=ids).logits, ours(ids, labels), hf16(input_ids=ids).logits
    assert got.logits.dtype == torch.bfloat16 and torch.isfinite(got.loss)
    assert _sqnr_db(truth, got.logits) > _sqnr_db(truth, theirs) - 3.0


def test_eos_token_id_carries_through_import_and_export(tmp_path):
    """transformers' config.json `eos_token_id` survives `import_hf` into our config.json (tokenizer.json copied
    along) and `export_hf` writes it back; an export of a checkpoint without one in its config takes its tokenizer's
    <|endoftext|>, and one with neither writes null (not transformers' default id 1, which would end generation
    at an arbitrary token)."""
    import json

    from moe.trainer.models.deepseek_v3.model_tokens import END_OF_TEXT, eos_token_id

    def hf_config(path):
        return json.loads((path / "config.json").read_text())

    tokenizer_json = json.dumps({"added_tokens": [{"id": 3, "content": END_OF_TEXT, "special": True}]})
    config = tiny_config()
    hf = hf_model(config, seed=1)
    hf.config.eos_token_id = 7
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(tokenizer_json)
    import_hf(tmp_path / "hf", tmp_path / "ckpt", log=lambda m: None)
    assert hf_config(tmp_path / "ckpt")["eos_token_id"] == 7
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == tokenizer_json
    assert eos_token_id(tmp_path / "ckpt") == 7  # config.json before the tokenizer's token
    export_hf(tmp_path / "ckpt", tmp_path / "hf2")
    assert hf_config(tmp_path / "hf2")["eos_token_id"] == 7
    assert (tmp_path / "hf2" / "tokenizer.json").read_text() == tokenizer_json
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf2").eos_token_id == 7

    # A trainer checkpoint: no eos in config.json, the tokenizer beside the weights.
    state, _ = read_model_dir(tmp_path / "ckpt")
    write_model_dir(tmp_path / "trained", state, config, write_extra=lambda d: (d / "tokenizer.json").write_text(
        tokenizer_json))  # fmt: skip
    assert "eos_token_id" not in hf_config(tmp_path / "trained")
    export_hf(tmp_path / "trained", tmp_path / "hf3")
    assert hf_config(tmp_path / "hf3")["eos_token_id"] == 3

    write_model_dir(tmp_path / "bare", state, config)
    export_hf(tmp_path / "bare", tmp_path / "hf4")
    assert hf_config(tmp_path / "hf4")["eos_token_id"] is None
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf4").eos_token_id is None
    import_hf(tmp_path / "hf4", tmp_path / "bare2", log=lambda m: None)
    assert "eos_token_id" not in hf_config(tmp_path / "bare2")
