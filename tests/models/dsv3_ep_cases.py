"""Cases run inside every rank of a 2-rank pool (test_dsv3_expert_parallel.py).

Each rank builds the one-process model and the expert-parallel one from the same seed, and runs its own half of the
batch (data parallel over the EP ranks). Expected: the EP model holds the same weights (layout-independent init);
per rank the same logits and losses as the one-process model on that half; each rank's expert gradients equal the
one-process model's for those experts accumulated over both halves; replicated gradients summed over the ranks equal
the one-process model's; the full state dict round trips. All collectives run before the assertions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe import update_expert_bias
from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM

from .dsv3_testlib import tiny_config, tokens

RTOL = 1e-5  # float32, same maths; the EP combine sums the same float32 terms in another order


def _loss(out, config):
    return out.loss + config.mtp_loss_weight * out.mtp_loss


def ep_matches_one_process(ctx) -> None:
    config = tiny_config(seq_aux_loss_coeff=0.01, num_nextn_predict_layers=2)
    torch.manual_seed(11)
    ref = DeepseekV3ForCausalLM(config).train()
    ref_next_draw = torch.rand(())
    torch.manual_seed(11)
    ep = DeepseekV3ForCausalLM(config, ep_group=ctx.group).train()
    # Building takes one draw of the global generator whatever the layout (the trainer's later draws agree).
    assert torch.equal(torch.rand(()), ref_next_draw)
    with torch.no_grad():  # weights large enough for decisive routing; the same on both (a deterministic rule)
        for model in (ref, ep):
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(6.0)

    halves = [tokens(config, batch=2, seq=16, seed=20 + r) for r in range(ctx.world_size)]
    ref_outs = []
    for ids, labels in halves:
        out = ref(ids, labels)
        _loss(out, config).backward()
        ref_outs.append(out)
    ids, labels = halves[ctx.rank]
    out = ep(ids, labels)
    _loss(out, config).backward()

    # Collectives first.
    full = ep.full_state_dict()
    expert_keys = {k for k in full if ".experts." in k}
    replicated = {n: p.grad.clone() for n, p in ep.named_parameters() if ".experts." not in n}
    for grad in replicated.values():
        dist.all_reduce(grad, group=ctx.group)
    update_expert_bias(ep, dp_group=ctx.group)
    update_expert_bias(ref)
    torch.manual_seed(99)
    fresh = DeepseekV3ForCausalLM(config, ep_group=ctx.group)
    fresh.load_full_state_dict(full)
    round_trip = fresh.full_state_dict()

    # Checks.
    ref_full = ref.full_state_dict()
    for key in full:
        assert torch.equal(full[key], ref_full[key]), key
        assert torch.equal(round_trip[key], full[key]), key
    expected = ref_outs[ctx.rank]
    torch.testing.assert_close(out.logits, expected.logits, rtol=RTOL, atol=RTOL * float(expected.logits.abs().max()))
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=0)
    torch.testing.assert_close(out.mtp_loss, expected.mtp_loss, rtol=RTOL, atol=0)
    assert any(layer.metrics.losses for layer in ep.moe_layers())  # the sequence aux loss was on
    ref_params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        grad, ref_grad = p.grad, ref_params[name].grad
        if name in replicated:
            grad = replicated[name]
        else:
            layer = next(m for m in ep.moe_layers() if any(q is p for q in m.experts.parameters()))
            ref_grad = ref_grad[layer.local_expert_start : layer.local_expert_start + layer.num_local_experts]
        scale = float(ref_grad.abs().max())
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}")
    assert expert_keys and all(full[k].size(0) == config.n_routed_experts for k in expert_keys)
    for a, b in zip(ep.moe_layers(), ref.moe_layers()):
        torch.testing.assert_close(a.router.expert_bias.bias, b.router.expert_bias.bias, rtol=0, atol=0)
