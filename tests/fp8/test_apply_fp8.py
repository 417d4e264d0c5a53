"""`apply_fp8` on the tiny DeepSeek-V3 model: what is switched, what is not, parameters and state-dict keys kept,
and a training step whose forward and backward GEMMs really go through the FP8 GEMM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.layer.experts import SwiGLUMLP
from moe.layer.fp8 import Fp8SwiGLUExperts, gemm
from moe.layer.fp8.convert import Fp8Linear, Fp8SwiGLUMLP, apply_fp8, fp8_moe_options
from moe.layer.router import TopKRouter
from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.norm import RMSNorm
from tests.train.train_cases import TINY


def tiny_model(seed: int = 0, recipe: str | None = None) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(DeepseekV3Config.from_toml(TINY), moe_options=fp8_moe_options(recipe))


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_apply_fp8_switches_the_gemms_and_keeps_everything_else(recipe):
    model = tiny_model(recipe=recipe)
    before = model.state_dict(keep_vars=True)
    kept_types = {n: type(m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, RMSNorm, TopKRouter))}
    conv = apply_fp8(model, recipe)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)  # the same Parameter objects: FP32 master weights
    assert all(p.dtype == torch.float32 for p in model.parameters())

    modules = dict(model.named_modules())
    for name, kind in kept_types.items():  # embedding, norms and routers untouched
        assert type(modules[name]) is kind and not hasattr(modules[name], "linear_fn"), name
    assert type(model.lm_head) is nn.Linear and not hasattr(model.lm_head, "linear_fn")
    assert "lm_head" not in conv.linears

    cfg = model.config
    attn = ["qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj"]
    expected = [f"layers.{i}.self_attn.{p}" for i in range(cfg.num_hidden_layers) for p in attn]
    expected += [f"mtp.0.{n}" for n in ("eh_proj",)] + [f"mtp.0.self_attn.{p}" for p in attn]
    assert sorted(conv.linears) == sorted(expected)
    assert all(type(modules[n]) is Fp8Linear and hasattr(modules[n], "linear_fn") for n in conv.linears)
    moe_layers = [n for n, m in model.named_modules() if m in model.moe_layers()]
    assert conv.experts == [f"{n}.experts" for n in moe_layers]
    assert conv.fp8_dispatch == moe_layers and conv.high_precision_dispatch == []
    assert all(modules[n].dispatcher.use_fp8 and modules[n].config.moe_flex_use_fp8 for n in moe_layers)
    assert all(isinstance(modules[n], Fp8SwiGLUExperts) for n in conv.experts)
    dense_mlps = [n for n, m in model.named_modules() if type(m) is SwiGLUMLP]
    assert dense_mlps == []  # every dense MLP and shared expert was switched
    assert sorted(conv.mlps) == sorted(["layers.0.mlp", *(f"{n}.shared_experts" for n in moe_layers)])
    assert all(type(modules[n]) is Fp8SwiGLUMLP and modules[n].linear_fns for n in conv.mlps)

    with pytest.raises(ValueError, match="already"):
        apply_fp8(model, recipe)


def test_apply_fp8_leaves_the_dispatch_as_the_model_was_built():
    """The wire format is a build-time choice (`fp8_moe_options`): the converter reports it and rewrites no config."""
    model = tiny_model()
    configs = {n: m.config for n, m in model.named_modules() if m in model.moe_layers()}
    conv = apply_fp8(model, "blockwise")
    assert conv.fp8_dispatch == [] and conv.high_precision_dispatch == list(configs)
    modules = dict(model.named_modules())
    assert all(modules[n].config is c and not modules[n].dispatcher.use_fp8 for n, c in configs.items())
    assert fp8_moe_options("none") == {"moe_flex_use_fp8": False}


def test_apply_fp8_rejects_unknown_recipe():
    with pytest.raises(ValueError, match="fp8 recipe"):
        apply_fp8(nn.Linear(4, 4), "mxfp8")


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_training_step_runs_its_gemms_in_fp8(recipe, monkeypatch):
    """Every FP8 GEMM of the forward has its input- and weight-gradient GEMM in FP8 in the backward; the loss is
    the FP32 model's up to the FP8 error, and FP8 changes it (the GEMMs are not silently FP32)."""
    model, ref = tiny_model(recipe=recipe), tiny_model()
    apply_fp8(model, recipe)
    calls = []
    real = gemm.scaled_matmul

    def counting(a, b):
        calls.append((a.q.dtype, b.q.dtype))
        return real(a, b)

    monkeypatch.setattr(gemm, "scaled_matmul", counting)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids)
    forward_calls = len(calls)
    (out.loss + 0.3 * out.mtp_loss).backward()
    backward_calls = len(calls) - forward_calls
    # At least the 4 attention projections of 5 layers (4 + MTP) and 2 GEMMs per dense MLP and shared expert.
    assert forward_calls >= 5 * 4 + 2 * 4
    assert backward_calls == 2 * forward_calls
    assert all(d == (torch.float8_e4m3fn, torch.float8_e4m3fn) for d in calls)
    assert all(p.grad is not None for n, p in model.named_parameters() if "expert_bias" not in n)
    with torch.no_grad():
        ref_loss = ref(ids, labels=ids).loss
    assert 0 < abs(float(out.loss.detach()) - float(ref_loss)) < 0.02 * float(ref_loss)


def test_tensor_parallel_mlp_is_switched_through_the_hook():
    """The TP dense MLP (a `SwiGLUMLP` subclass) keeps its class and runs its GEMMs through the FP8 hook."""
    from moe.layer.experts import SwiGLUMLP
    from moe.layer.parallel.layers import ParallelSwiGLUMLP

    torch.manual_seed(0)
    mlp = ParallelSwiGLUMLP.from_mlp(SwiGLUMLP(128, 256), rank=0, size=1)
    holder = torch.nn.ModuleDict({"mlp": mlp})
    conv = apply_fp8(holder, "blockwise")
    assert conv.mlps == ["mlp"] and type(mlp) is ParallelSwiGLUMLP and set(mlp.linear_fns) == {"w13", "w2"}
    x = torch.randn(64, 128)
    out = SwiGLUMLP.forward(mlp, x)  # the base forward (the TP forward adds only the sequence collectives)
    ref = swiglu_reference(x, mlp)
    assert out.shape == ref.shape and not torch.equal(out, ref)  # FP8 rounding happened
    snr = 10 * torch.log10(ref.square().sum() / (out - ref).square().sum())
    assert snr > 22  # one E4M3 rounding of each operand per GEMM (tests/fp8/test_fp8_numerics.py)


def swiglu_reference(x, mlp):
    from moe.layer.experts import swiglu

    return swiglu(x @ mlp.w13) @ mlp.w2
