"""MLA's attention core under its backends (moe/trainer/models/deepseek_v3/attention.py): 'unfused' (explicit GEMMs and
softmax over the unpadded values), 'sdpa' (`F.scaled_dot_product_attention` over values zero-padded to the
query/key head dim) and 'auto' (the rule that picks one). Both forms compute the same function, so outputs and
gradients must agree to float32 rounding (the two sum the products in another order: measured ~1e-7 relative)."""

from __future__ import annotations

import pytest
import torch

from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.attention import MultiHeadLatentAttention, unfused_core
from moe.trainer.models.deepseek_v3.rope import RotaryEmbedding

from .dsv3_testlib import rel_err, tiny_config

CPU = torch.device("cpu")


def test_auto_is_unfused_for_short_float32_cpu_sequences_only():
    # The kept probabilities (S per head and token) no larger than flash's q, k and padded v (3 * Dq).
    assert unfused_core("auto", 128, 128, torch.float32, CPU)
    assert unfused_core("auto", 384, 128, torch.float32, CPU) and not unfused_core("auto", 385, 128, torch.float32, CPU)
    assert unfused_core("auto", 576, 192, torch.float32, CPU)  # DeepSeek-V3's head dim (128 + 64)
    assert not unfused_core("auto", 128, 128, torch.bfloat16, CPU)  # BF16 scores would be rounded before the softmax
    assert not unfused_core("auto", 128, 128, torch.float32, torch.device("cuda"))  # GPUs: SDPA's fused kernels
    assert unfused_core("unfused", 4096, 128, torch.bfloat16, CPU) and not unfused_core(
        "sdpa", 8, 128, torch.float32, CPU
    )


def test_the_default_backend_is_sdpa_and_the_model_sets_every_layer():
    model = DeepseekV3ForCausalLM(tiny_config(), device="meta")
    mla = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    assert len(mla) == 4 and {m.attention_backend for m in mla} == {"sdpa"}  # 3 layers and the MTP depth
    model.set_attention_backend("auto")
    assert {m.attention_backend for m in mla} == {"auto"}
    with pytest.raises(ValueError, match="attention backend must be one of"):
        model.set_attention_backend("flash")


def _attention_step(attn: MultiHeadLatentAttention, x_BSH: torch.Tensor, grad_BSH: torch.Tensor, rotary):
    """Output, input gradient and parameter gradients of one forward + backward."""
    attn.zero_grad(set_to_none=True)
    x = x_BSH.detach().requires_grad_(True)
    cos, sin = rotary(torch.arange(x.size(1)), torch.float32)
    out = attn(x, cos, sin)
    out.backward(grad_BSH)
    return [out.detach(), x.grad] + [p.grad for p in attn.parameters()]


# Two positions at least: with one, the q and k gradients are zero in exact arithmetic (the softmax of one score
# is 1), so only float32 noise would be compared.
@pytest.mark.parametrize("seq", [2, 9, 48])
def test_unfused_core_matches_sdpa(seq):
    config = tiny_config()
    torch.manual_seed(0)
    attn = MultiHeadLatentAttention(config)
    rotary = RotaryEmbedding(config.rope_parameters, config.qk_rope_head_dim)
    x = torch.randn(2, seq, config.hidden_size)
    grad = torch.randn(2, seq, config.hidden_size)
    attn.attention_backend = "unfused"
    unfused = _attention_step(attn, x, grad, rotary)
    attn.attention_backend = "sdpa"
    sdpa = _attention_step(attn, x, grad, rotary)
    for u, s in zip(unfused, sdpa, strict=True):
        assert rel_err(u, s) < 1e-5
