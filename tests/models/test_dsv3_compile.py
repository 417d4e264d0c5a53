"""`[training] compile` (moe/trainer/models/deepseek_v3/compile.py): the model with its attention modules compiled by
inductor trains like the eager model.

Tolerances: inductor fuses the element-wise chains and reorders float32 reductions (the RMSNorm means, the softmax
sums), so each fused result differs from eager by a few float32 ulps (~1e-7 relative); through the layers and three
AdamW steps the loss stays within 1e-5 relative (measured ~1e-7) and the first step's gradients within 1e-4
(measured ~1e-6; a wrong fusion would be off by far more).
"""

from __future__ import annotations

import copy

import pytest
import torch

from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.compile import compile_model

from .dsv3_testlib import rel_err, tiny_config, tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # compiling takes about a minute on 2 cores


def _train(model: DeepseekV3ForCausalLM, ids, labels, steps: int):
    """`steps` AdamW steps on one batch: the losses and the first step's gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first_grads = [], None
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = model(ids, labels)
        loss = out.loss + model.config.mtp_loss_weight * out.mtp_loss
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, first_grads


def test_compiled_attention_trains_like_eager():
    config = tiny_config()  # with one MTP depth: its attention is compiled too
    torch.manual_seed(0)
    eager = DeepseekV3ForCausalLM(config).train()
    compiled = copy.deepcopy(eager)
    names = compile_model(compiled)
    assert names == [f"layers.{i}.self_attn" for i in range(config.num_hidden_layers)] + ["mtp.0.self_attn"]
    ids, labels = tokens(config, batch=2, seq=32)
    eager_losses, eager_grads = _train(eager, ids, labels, steps=3)
    compiled_losses, compiled_grads = _train(compiled, ids, labels, steps=3)
    for e, c in zip(eager_losses, compiled_losses, strict=True):
        assert abs(c - e) <= 1e-5 * abs(e)
    for e, c in zip(eager_grads, compiled_grads, strict=True):
        assert rel_err(c, e) < 1e-4
