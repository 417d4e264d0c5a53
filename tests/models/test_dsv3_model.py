"""The model's own contract: MTP losses (a case checked by hand, and a per-position recomputation of the shifts),
training with the balancing pieces (sequence aux loss through backward, expert-bias updates), deterministic init,
full state dicts, and the meta device."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moe import update_expert_bias
from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM

from .dsv3_testlib import our_model, tiny_config, tokens

pytestmark = pytest.mark.timeout(120)


def test_mtp_losses_by_hand():
    """A zero output head makes every logit 0, so every position's cross entropy is exactly ln(V): the loss sums are
    ln(V) times the counts, which are read off the label mask by hand."""
    config = tiny_config(num_nextn_predict_layers=2, vocab_size=100)
    model = our_model(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 2] = -100  # a target of the main loss (position 1) and of depth 1 (position 0), not of depth 2
    labels[1, 5] = -100  # the last target of every depth
    with torch.no_grad():
        out = model(ids, labels)
    # main: targets labels[:, 1:] -> 2*5 - 2 = 8; depth 1: labels[:, 2:] -> 2*4 - 2 = 6;
    # depth 2: labels[:, 3:] -> 2*3 - 1 = 5
    assert int(out.num_tokens) == 8
    assert [int(n) for n in out.mtp_num_tokens] == [6, 5]
    ln_v = math.log(100)
    assert float(out.lm_loss_sum) == pytest.approx(8 * ln_v, rel=1e-6)
    assert [float(s) for s in out.mtp_loss_sums] == pytest.approx([6 * ln_v, 5 * ln_v], rel=1e-6)
    assert float(out.loss) == pytest.approx(ln_v, rel=1e-6)
    assert float(out.mtp_loss) == pytest.approx(ln_v, rel=1e-6)


def test_mtp_loss_per_position():
    """Depth k at position t: the module sees the previous depth's states at positions <= t and the embeddings of
    tokens k..t+k (rotary positions k..t+k), and its logits score token t+k+1. Recomputed one position at a time
    from the model's own modules on each prefix, with a per-position cross entropy."""
    config = tiny_config(num_nextn_predict_layers=2)
    model = our_model(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    ids, labels = tokens(config, batch=2, seq=9, seed=5, ignore=4)
    with torch.no_grad():
        out = model(ids, labels)
        S = ids.size(1)
        cos, sin = model.rotary(torch.arange(S), torch.float32)
        emb = model.embed_tokens(ids)
        h = emb
        for layer in model.layers:
            h = layer(h, cos, sin)
        prev = model.norm(h)  # [B, S, H], depth 0
        for depth, module in enumerate(model.mtp, start=1):
            states, loss_sum, count = [], 0.0, 0
            for t in range(S - depth):
                x = module(prev[:, : t + 1], emb[:, depth : depth + t + 1], cos[depth : depth + t + 1],
                           sin[depth : depth + t + 1])  # fmt: skip
                states.append(x[:, -1])
                if t + depth + 1 < S:
                    logits = F.linear(x[:, -1], model.lm_head.weight)
                    for b in range(ids.size(0)):
                        target = int(labels[b, t + depth + 1])
                        if target != -100:
                            loss_sum += float(-torch.log_softmax(logits[b].double(), dim=-1)[target])
                            count += 1
            prev = torch.stack(states, dim=1)
            assert int(out.mtp_num_tokens[depth - 1]) == count
            assert float(out.mtp_loss_sums[depth - 1]) == pytest.approx(loss_sum, rel=1e-5)
    means = [float(s) / int(n) for s, n in zip(out.mtp_loss_sums, out.mtp_num_tokens)]
    assert float(out.mtp_loss) == pytest.approx(sum(means) / len(means), rel=1e-6)


def test_training_step_pieces():
    """Backward of lm + weight * mtp reaches the main model through the MTP loss; the sequence aux loss adds router
    gradient; grad-enabled forwards count routed tokens and update_expert_bias moves the bias by the rate."""
    ids, labels = tokens(tiny_config(), batch=2, seq=16, seed=1)

    def router_grad(coeff):
        model = our_model(tiny_config(seq_aux_loss_coeff=coeff, bias_update_speed=0.01)).train()
        out = model(ids, labels)
        (out.loss + model.config.mtp_loss_weight * out.mtp_loss).backward()
        return model, model.moe_layers()[0].router.weight.grad.clone()

    model, grad_without = router_grad(0.0)
    _, grad_with = router_grad(0.5)
    assert not torch.allclose(grad_with, grad_without)
    assert all(p.grad is not None for p in model.mtp.parameters() if p.requires_grad)
    assert len(model.moe_layers()) == 3  # layers 1, 2 and the MTP module
    counts = [layer.router.expert_bias.counts.clone() for layer in model.moe_layers()]
    assert all(int(c.sum()) > 0 for c in counts)
    assert update_expert_bias(model) == 3
    for layer, c in zip(model.moe_layers(), counts):
        torch.testing.assert_close(layer.router.expert_bias.bias, 0.01 * torch.sign(c.mean() - c))


def test_mtp_gradient_reaches_main_model():
    model = our_model(tiny_config())
    ids, labels = tokens(tiny_config(), batch=2, seq=12)
    model(ids, labels).mtp_loss.backward()
    assert model.layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0  # through h^0
    assert model.embed_tokens.weight.grad.abs().sum() > 0


def test_init_is_deterministic_and_dtype_independent():
    config = tiny_config()
    torch.manual_seed(7)
    a = DeepseekV3ForCausalLM(config).full_state_dict()
    torch.manual_seed(7)
    b = DeepseekV3ForCausalLM(config, dtype=torch.bfloat16).full_state_dict()
    torch.manual_seed(8)
    c = DeepseekV3ForCausalLM(config).full_state_dict()
    for key in a:
        assert torch.equal(a[key].to(b[key].dtype), b[key]), key
    assert not torch.equal(a["layers.1.mlp.experts.w13"], c["layers.1.mlp.experts.w13"])
    assert b["layers.1.mlp.router.weight"].dtype == torch.float32
    assert b["layers.1.mlp.router.expert_bias.bias"].dtype == torch.float32
    assert "layers.1.mlp.router.expert_bias.counts" not in a
    std = a["layers.1.mlp.experts.w13"].std()
    assert abs(float(std) - config.initializer_range) < 0.1 * config.initializer_range


def test_full_state_dict_round_trip_and_errors():
    config = tiny_config()
    torch.manual_seed(1)
    src = DeepseekV3ForCausalLM(config)
    torch.manual_seed(2)
    dst = DeepseekV3ForCausalLM(config)
    dst.load_full_state_dict(src.full_state_dict())
    for key, value in src.full_state_dict().items():
        assert torch.equal(dst.full_state_dict()[key], value), key
    sd = src.full_state_dict()
    with pytest.raises(ValueError, match="missing keys.*norm.weight"):
        dst.load_full_state_dict({k: v for k, v in sd.items() if k != "norm.weight"})
    with pytest.raises(ValueError, match="shapes differ.*layers.1.mlp.experts.w2"):
        dst.load_full_state_dict({**sd, "layers.1.mlp.experts.w2": sd["layers.1.mlp.experts.w2"][:4]})


def test_meta_device_allocates_nothing():
    config = tiny_config()
    model = DeepseekV3ForCausalLM(config, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_int32_tokens_give_the_int64_result():
    model = our_model(tiny_config())
    ids, labels = tokens(tiny_config(), batch=2, seq=10)
    with torch.no_grad():
        a, b = model(ids, labels), model(ids.int(), labels.int())
    assert torch.equal(a.logits, b.logits) and torch.equal(a.lm_loss_sum, b.lm_loss_sum)
    assert torch.equal(a.mtp_loss, b.mtp_loss)
