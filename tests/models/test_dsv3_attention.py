"""MLA's attention core in its two forms (moe/models/deepseek_v3/attention.py): explicit GEMMs and softmax over the
unpadded values (short float32 CPU sequences) and `F.scaled_dot_product_attention` over values zero-padded to the
query/key head dim; and the rule that picks one. Both forms compute the same function, so outputs and gradients
must agree to float32 rounding (the two sum the products in another order: measured ~1e-7 relative). Also the
RoPE rotation in its complex (float32) and real (BF16) forms."""

from __future__ import annotations

import pytest
import torch

from moe.models.deepseek_v3 import attention
from moe.models.deepseek_v3.attention import MultiHeadLatentAttention, explicit_core
from moe.models.deepseek_v3.rope import RotaryEmbedding, apply_rope

from .dsv3_testlib import rel_err, tiny_config

CPU = torch.device("cpu")


def test_rule_explicit_for_short_float32_cpu_sequences_only():
    # The kept probabilities (S per head and token) no larger than flash's q, k and padded v (3 * Dq).
    assert explicit_core(128, 128, torch.float32, CPU)
    assert explicit_core(384, 128, torch.float32, CPU) and not explicit_core(385, 128, torch.float32, CPU)
    assert explicit_core(576, 192, torch.float32, CPU)  # DeepSeek-V3's head dim (128 + 64)
    assert not explicit_core(128, 128, torch.bfloat16, CPU)  # BF16 scores would be rounded before the softmax
    assert not explicit_core(128, 128, torch.float32, torch.device("cuda"))  # GPUs: SDPA's fused kernels


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
def test_explicit_core_matches_sdpa(monkeypatch, seq):
    config = tiny_config()
    torch.manual_seed(0)
    attn = MultiHeadLatentAttention(config)
    rotary = RotaryEmbedding(config.rope_parameters, config.qk_rope_head_dim)
    x = torch.randn(2, seq, config.hidden_size)
    grad = torch.randn(2, seq, config.hidden_size)
    assert explicit_core(seq, config.qk_head_dim, torch.float32, CPU)
    explicit = _attention_step(attn, x, grad, rotary)
    monkeypatch.setattr(attention, "explicit_core", lambda *args: False)
    sdpa = _attention_step(attn, x, grad, rotary)
    for e, s in zip(explicit, sdpa, strict=True):
        assert rel_err(e, s) < 1e-5


@pytest.mark.parametrize("offset", [0, 1])  # 1: pairs not aligned to two elements (the complex view needs a copy)
def test_rope_complex_form_is_the_rotation(offset):
    """The interleaved float32 RoPE (a complex multiplication) rotates each pair `(x[2j], x[2j+1])` by its angle and
    keeps the pairs in place; the BF16 (real) form gives the same rotation in the half layout."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8 + offset, generator=gen)[..., offset:]
    angles = torch.arange(5.0)[:, None] * torch.rand(4, generator=gen)[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    first, second = x1 * c - x2 * s, x2 * c + x1 * s
    assert rel_err(apply_rope(x, cos, sin, True), torch.stack((first, second), -1).flatten(-2)) < 1e-6
    half = apply_rope(x.bfloat16(), cos.bfloat16(), sin.bfloat16(), True).float()
    assert rel_err(half, torch.cat((first, second), -1)) < 2e-2  # BF16 rounding of inputs and results
