"""Tensor + sequence parallelism of the DeepSeek-V3 model against the one-process model (same seed, same batch).

Every rank builds the one-process model and the TP model from the same seed; the TP model's shards must be exact
slices of the one-process weights (layout-independent init). Each data-parallel rank runs its own sequences; the
one-process model runs all of them. Expected: the same LM and MTP loss sums on every rank of a TP group as the
one-process model on that rank's sequences, and every gradient equal once gathered (sharded parameters), summed
over TP (`sequence_parallel_grad` ones) and summed over DP / expert-DP, as the contract's reduction says.

Tolerance (float32): the maths are the same, only the summation order differs (o_proj / w2 / embedding partial
sums added by the reduce-scatter, the cross entropy's max / sum-exp over vocabulary parts, partial gradients summed
over TP): each such sum of n float32 terms moves by a few ulps (~1e-7 relative), amplified by ~10 layers of
normalisation and softmax. rtol 1e-5 on losses (measured: below 1e-6) and rtol 1e-4 relative to each gradient's
largest entry (measured: below 1e-5), as the expert-parallel parity test uses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe import update_expert_bias
from moe.layer.parallel import (
    SequenceShards,
    VocabParallelEmbedding,
    gather_from_sequence_parallel,
    gather_shards,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    vocab_parallel_cross_entropy,
)
from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.tensor_parallel import apply_tensor_parallel, parallelize
from moe.trainer.train.parallel_state import Layout, ParallelState
from tests.models.dsv3_testlib import HF_CASES, rel_err, tiny_config, tokens
from tests.ranks import pool_fixture

TIMEOUT_S = 60
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MTP_WEIGHT = 0.3
CONFIGS = {
    # q LoRA, fused qkv_a_proj, 2 MTP depths (odd lengths 15 and 14: uneven sequence parts), sequence aux loss.
    "qlora": dict(seq_aux_loss_coeff=0.01, num_nextn_predict_layers=2),
    # plain q_proj with biases (unfused), half-layout rope, tied embeddings, two dense layers, two MTP depths.
    "qproj_bias_tied": dict(HF_CASES["qproj_bias_default_unnorm_tied"], seq_aux_loss_coeff=0.01),
}


tp_pools = pool_fixture(comm_timeout_s=TIMEOUT_S, deadline_s=4 * TIMEOUT_S)


def _state(ctx, tp: int, ep: int) -> ParallelState:
    key = ("state", tp, ep)
    if key not in ctx.cache:
        ctx.cache[key] = ParallelState.from_process_group(Layout(world=ctx.world_size, tp=tp, ep=ep))
    return ctx.cache[key]


def _objective(out) -> torch.Tensor:
    return (out.lm_loss_sum + MTP_WEIGHT * sum(out.mtp_loss_sums)) / 64.0


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


# -- the model against the one-process model ----------------------------------------------------------------------


def tp_model_case(ctx, variant: str, tp: int, ep: int) -> dict:
    state = _state(ctx, tp, ep)
    config = tiny_config(**CONFIGS[variant])
    torch.manual_seed(11)
    ref = DeepseekV3ForCausalLM(config).train()
    torch.manual_seed(11)
    model = parallelize(DeepseekV3ForCausalLM(config, ep_group=state.ep_group), state).train()
    with torch.no_grad():  # decisive routing (the same rule on both models), as the expert-parallel test
        for m in (ref, model):
            for name, p in m.named_parameters():
                if "norm" not in name:
                    p.mul_(6.0)
    ref_full = ref.full_state_dict()
    full = model.full_state_dict()  # collective (TP, EP)

    dp = state.layout.dp
    batches = [tokens(config, batch=2, seq=16, seed=40 + r) for r in range(dp)]
    ref_outs = []
    for ids, labels in batches:
        out = ref(ids, labels)
        _objective(out).backward()
        ref_outs.append(out)
    ids, labels = batches[state.dp_rank]
    out = model(ids, labels)
    _objective(out).backward()

    # Collectives first: gradients to their full, reduced form; the expert bias update over the token group.
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        shard = getattr(p, "tensor_parallel_shard", None)
        if shard is not None:
            grads[name] = _all_reduce(gather_shards(g, shard, state.tp_group), state.dp_group)
        elif getattr(p, "sequence_parallel_grad", False):
            grads[name] = _all_reduce(_all_reduce(g.clone(), state.tp_group), state.dp_group)
        else:
            assert getattr(p, "expert_parallel", False), name
            grads[name] = _all_reduce(g.clone(), state.expert_dp_group)
    update_expert_bias(model, state.token_group)
    update_expert_bias(ref)
    torch.manual_seed(99)
    fresh = parallelize(DeepseekV3ForCausalLM(config, ep_group=state.ep_group), state)
    fresh.load_full_state_dict(ref_full)  # written by the one-process model, loaded at TP (x EP)
    round_trip = fresh.full_state_dict()

    # Checks.
    assert full.keys() == ref_full.keys()
    for key in full:
        assert torch.equal(full[key], ref_full[key]), key
        assert torch.equal(round_trip[key], ref_full[key]), key
    expected = ref_outs[state.dp_rank]
    errs = {}
    for what, mine, theirs in [
        ("lm_loss_sum", out.lm_loss_sum, expected.lm_loss_sum),
        *[(f"mtp_loss_sum_{d}", a, b) for d, (a, b) in enumerate(zip(out.mtp_loss_sums, expected.mtp_loss_sums))],
    ]:
        torch.testing.assert_close(mine, theirs, rtol=LOSS_RTOL, atol=0, msg=lambda m, w=what: f"{w}: {m}")
        errs[what] = rel_err(mine, theirs)
    assert out.num_tokens == expected.num_tokens and out.mtp_num_tokens == expected.mtp_num_tokens
    v0 = model.vocab_start
    logits, ref_logits = out.logits.detach(), expected.logits.detach()
    torch.testing.assert_close(logits, ref_logits[..., v0 : v0 + logits.size(-1)], rtol=LOSS_RTOL,
                               atol=LOSS_RTOL * float(ref_logits.abs().max()))  # fmt: skip
    assert any(layer.metrics.losses for layer in model.moe_layers())  # the sequence aux loss was on
    ref_params = dict(ref.named_parameters())
    grad_err = 0.0
    tags = {"sharded": 0, "sequence_parallel_grad": 0, "expert": 0}
    for name, p in model.named_parameters():
        ref_grad = ref_params[name].grad
        if getattr(p, "expert_parallel", False):
            layer = next(m for m in model.moe_layers() if any(q is p for q in m.experts.parameters()))
            ref_grad = ref_grad[layer.local_expert_start : layer.local_expert_start + layer.num_local_experts]
            tags["expert"] += 1
        else:
            tags["sharded" if hasattr(p, "tensor_parallel_dim") else "sequence_parallel_grad"] += 1
        scale = float(ref_grad.abs().max())
        torch.testing.assert_close(grads[name], ref_grad, rtol=GRAD_RTOL, atol=GRAD_RTOL * scale,
                                   msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
        grad_err = max(grad_err, rel_err(grads[name], ref_grad))
    for a, b in zip(model.moe_layers(), ref.moe_layers()):
        torch.testing.assert_close(a.router.expert_bias.bias, b.router.expert_bias.bias, rtol=0, atol=0)
    return {"loss_rel_err": errs, "grad_rel_err": grad_err, "tags": tags, "lm_loss_sum": float(out.lm_loss_sum)}


@pytest.mark.parametrize(  # qlora (two MTP depths) runs again on 4 ranks below: slow here
    "variant", [pytest.param(v, marks=[pytest.mark.slow] if v == "qlora" else []) for v in sorted(CONFIGS)]
)
def test_tp2_matches_one_process(tp_pools, variant):
    results = tp_pools[2].run(tp_model_case, variant, 2, 1)
    assert results[0]["lm_loss_sum"] == results[1]["lm_loss_sum"]  # the loss is the same on the TP ranks
    assert all(r["tags"]["sharded"] > 0 and r["tags"]["sequence_parallel_grad"] > 0 for r in results)
    print(variant, "TP2", [(r["loss_rel_err"], r["grad_rel_err"]) for r in results])


@pytest.mark.slow  # slow: 4-rank TP x EP
@pytest.mark.parametrize("tp, ep", [(2, 2), (2, 4), (4, 1)])
def test_four_ranks_match_one_process(tp_pools, tp, ep):
    # TP 2 x DP 2 folded into EP 2 x expert-DP 2 (EP = the TP pairs) or EP 4 (spanning TP and DP); TP 4 (one head).
    results = tp_pools[4].run(tp_model_case, "qlora", tp, ep)
    sums = [r["lm_loss_sum"] for r in results]
    assert all(sums[i] == sums[i - i % tp] for i in range(4))  # the loss is the same on the TP ranks
    print(f"qlora TP{tp}xEP{ep}", [(r["loss_rel_err"], r["grad_rel_err"]) for r in results])


# -- building blocks -------------------------------------------------------------------------------------------------


def vocab_parallel_case(ctx) -> dict:
    gen = torch.Generator().manual_seed(5)
    V, H, N = 48, 8, 37
    weight = torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (N,), generator=gen)
    logits = torch.randn(N, V, generator=gen) * 4
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::5] = -100
    grad_out = torch.rand(N, generator=gen)
    Vr, r = V // ctx.world_size, ctx.rank

    # Embedding: partial sums add up to F.embedding; gradient of the local rows.
    emb = VocabParallelEmbedding.from_embedding(torch.nn.Embedding.from_pretrained(weight, freeze=False), r,
                                                ctx.world_size)  # fmt: skip
    part = emb(ids)
    (part * grad_out[:, None]).sum().backward()
    total = _all_reduce(part.detach().clone(), ctx.group)
    ref_w = weight.clone().requires_grad_(True)
    (F.embedding(ids, ref_w) * grad_out[:, None]).sum().backward()
    torch.testing.assert_close(total, F.embedding(ids, weight), rtol=0, atol=0)
    torch.testing.assert_close(emb.weight.grad, ref_w.grad[r * Vr : (r + 1) * Vr], rtol=1e-6, atol=1e-6)

    # Cross entropy against F.cross_entropy (float32 and bfloat16 logits).
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-5)):
        full = logits.to(dtype).clone().requires_grad_(True)
        ref = F.cross_entropy(full.float(), targets, ignore_index=-100, reduction="none")
        (ref * grad_out).sum().backward()
        local = full.detach()[:, r * Vr : (r + 1) * Vr].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, targets, r * Vr, ctx.group)
        (loss * grad_out).sum().backward()
        assert loss.dtype == torch.float32 and local.grad.dtype == dtype
        torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
        assert torch.all(loss[targets == -100] == 0)
        torch.testing.assert_close(local.grad, full.grad[:, r * Vr : (r + 1) * Vr], rtol=tol, atol=tol)
    return True


def test_vocab_parallel_embedding_and_cross_entropy(tp_pools):
    assert all(tp_pools[2].run(vocab_parallel_case))


def sequence_mappings_case(ctx, length: int) -> bool:
    gen = torch.Generator().manual_seed(length)
    shards = SequenceShards.split(length, ctx.group)
    x_full = torch.randn(3, length, 5, generator=gen)
    w = torch.randn(3, length, 5, generator=gen)
    # gather: the whole sequence from the parts; backward sums the ranks' gradients of their copy.
    x_local = shards.local(x_full).clone().requires_grad_(True)
    gathered = gather_from_sequence_parallel(x_local, shards)
    assert torch.equal(gathered, x_full)
    (gathered * w * (ctx.rank + 1)).sum().backward()
    total = sum(range(1, ctx.world_size + 1))
    torch.testing.assert_close(x_local.grad, shards.local(w) * total)
    # reduce-scatter: this rank's part of the sum of the ranks' partial tensors; backward all-gathers.
    partial = (x_full * (ctx.rank + 1)).requires_grad_(True)
    mine = reduce_scatter_to_sequence_parallel(partial, shards)
    torch.testing.assert_close(mine, shards.local(x_full) * total)
    (mine * shards.local(w)).sum().backward()
    torch.testing.assert_close(partial.grad, w)
    # reshard (gather, slice, scatter) keeps the gradient exact.
    x_local2 = shards.local(x_full).clone().requires_grad_(True)
    new = SequenceShards.split(length - 1, ctx.group)
    out = scatter_to_sequence_parallel(gather_from_sequence_parallel(x_local2, shards)[:, : length - 1], new)
    assert torch.equal(out, new.local(x_full[:, : length - 1]))
    (out * new.local(w[:, : length - 1])).sum().backward()
    expected = F.pad(w[:, : length - 1], (0, 0, 0, 1))
    torch.testing.assert_close(x_local2.grad, shards.local(expected))
    return True


@pytest.mark.parametrize("length", [8, 7])
def test_sequence_parallel_mappings(tp_pools, length):
    assert all(tp_pools[2].run(sequence_mappings_case, length))


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_attention_heads=3, num_key_value_heads=3), "num_attention_heads=3"),
        (dict(vocab_size=127), "vocab_size=127"),
        (dict(intermediate_size=95), r"intermediate_size=95 \(dense MLP\)"),
    ],
)
def test_sizes_not_divisible_by_tp_are_refused_before_communication(overrides, message):
    model = DeepseekV3ForCausalLM(tiny_config(**overrides))
    # No process group exists: the check must come before any collective or group query.
    with pytest.raises(ValueError, match=f"tensor parallelism over 2 ranks needs these divisible by 2: .*{message}"):
        apply_tensor_parallel(model, None, 0, 2)
    with pytest.raises(ValueError, match=message):
        parallelize(model, ParallelState(Layout(world=2, tp=2)))


# -- DTensor evaluation ------------------------------------------------------------------------------------------


def dtensor_mla_case(ctx) -> dict:
    """torch's `parallelize_module` on MLA's up / output projections (no sequence parallelism): the maths match
    the one-process attention, but the weights become DTensors, and a `linear_fn` hook (the FP8 seam) sees them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from moe.trainer.models.deepseek_v3.attention import MultiHeadLatentAttention
    from moe.trainer.models.deepseek_v3.rope import RotaryEmbedding

    config = tiny_config()
    torch.manual_seed(3)
    ref = MultiHeadLatentAttention(config)
    torch.manual_seed(3)
    attn = MultiHeadLatentAttention(config)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    parallelize_module(attn, mesh, {"q_b_proj": ColwiseParallel(), "kv_b_proj": ColwiseParallel(),
                                    "o_proj": RowwiseParallel()})  # fmt: skip
    attn.num_heads //= ctx.world_size
    seen = []

    def linear_fn(x, w, b=None):
        seen.append((type(x).__name__, type(w).__name__))
        return F.linear(x, w, b)

    # As the FP8 recipes' Linear subclass does: the GEMM through the hook (ColwiseParallel's input / output
    # hooks stay around the module's forward).
    proj = attn.q_b_proj
    proj.forward = lambda x: linear_fn(x, proj.weight, proj.bias)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, config.hidden_size, generator=gen)
    cos, sin = RotaryEmbedding(config.rope_parameters, config.qk_rope_head_dim)(torch.arange(16), torch.float32)
    y_ref, y = ref(x, cos, sin), attn(x, cos, sin)
    y.sum().backward()
    y_ref.sum().backward()
    grad = attn.kv_b_proj.weight.grad
    return {
        "out_rel_err": rel_err(y, y_ref),
        "weight_is_dtensor": isinstance(attn.q_b_proj.weight, DTensor),
        "output_is_dtensor": isinstance(y, DTensor),
        "grad_is_dtensor": isinstance(grad, DTensor),
        "kv_b_grad_rel_err": rel_err(grad.full_tensor(), ref.kv_b_proj.weight.grad),
        "linear_fn_calls": seen,
    }


def test_dtensor_parallelize_module_on_mla(tp_pools):
    for r in tp_pools[2].run(dtensor_mla_case):
        assert r["out_rel_err"] < 1e-5 and r["kv_b_grad_rel_err"] < 1e-5
        # What made us keep plain local shards (see moe/trainer/models/deepseek_v3/tensor_parallel.py): the parameters
        # and their gradients are DTensors, and the FP8 recipes' GEMM hook gets DTensor operands.
        assert r["weight_is_dtensor"] and r["grad_is_dtensor"]
        assert r["linear_fn_calls"] == [("DTensor", "DTensor")]
        print(r)
