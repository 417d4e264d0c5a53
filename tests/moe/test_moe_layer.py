"""Single-process MoELayer against the dense per-token reference (outputs, losses, gradients)."""

from __future__ import annotations

import pytest
import torch

from moe import MoEConfig, MoELayer
from moe.layer.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from moe.layer.dispatcher.alltoall import regroup_index

from .moe_testlib import SIGMOID_V3, SMALL_LAYER, assert_close, layer_grads, layer_params_double, moe_config, ref_moe

pytestmark = pytest.mark.timeout(120)

H, E = SMALL_LAYER["hidden_size"], SMALL_LAYER["num_moe_experts"]

VARIANTS = {
    "softmax_top2_aux": dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    "softmax_pre_top3_scaled": dict(
        moe_router_topk=3, moe_router_pre_softmax=True, moe_router_topk_scaling_factor=1.5, moe_aux_loss_coeff=0.1
    ),
    "softmax_groups": dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_aux_loss_coeff=0.01),
    "sigmoid_v3": SIGMOID_V3,
    "sigmoid_top1": dict(moe_router_score_function="sigmoid", moe_router_topk=1, moe_aux_loss_coeff=0.01),
    "capacity_probs": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="probs", moe_aux_loss_coeff=0.01),
    "capacity_position_padded": dict(
        moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True
    ),
    "shared_overlap": dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_overlap=True),
    "allgather_shared": dict(moe_token_dispatcher_type="allgather", moe_shared_expert_intermediate_size=24),
    "loop_experts": dict(moe_grouped_gemm=False, moe_z_loss_coeff=1e-2),
    "padded_bmm_dropless": dict(moe_padded_batch_gemm=True, moe_padded_batch_gemm_alignment=8),
}


def _make(variant: str, seed: int = 0) -> tuple[MoEConfig, MoELayer]:
    cfg = moe_config(SMALL_LAYER, **VARIANTS[variant])
    torch.manual_seed(seed)
    layer = MoELayer(cfg)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.bias.copy_(torch.randn(E) * 0.05)
    return cfg, layer


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layer_matches_dense_reference(variant):
    cfg, layer = _make(variant)
    B, S = 3, 8
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=gen).requires_grad_()
    grad_out = torch.randn(B, S, H, generator=gen)

    out = layer(x)
    (out * grad_out).sum().backward()

    params = layer_params_double(layer)
    x_ref = x.detach().double().requires_grad_()
    bias = None if layer.router.expert_bias is None else layer.router.expert_bias.bias
    out_ref, losses_ref, dropped_ref = ref_moe(x_ref.view(B * S, H), params, cfg, num_seqs=B, expert_bias=bias)
    ((out_ref * grad_out.double().view(B * S, H)).sum() + sum(losses_ref.values(), torch.zeros(()))).backward()

    assert_close(out.view(B * S, H), out_ref, msg="output")
    assert_close(x.grad, x_ref.grad, msg="input grad")
    for name, grad in layer_grads(layer).items():
        assert_close(grad, params[name].grad, msg=f"grad {name}")
    assert set(layer.metrics.losses) == set(losses_ref)
    for name, value in losses_ref.items():
        assert_close(layer.metrics.losses[name], value, msg=f"loss {name}")
    assert layer.metrics.num_dropped_tokens == dropped_ref
    if "capacity" in variant:
        assert dropped_ref > 0, "the capacity variants are meant to drop something"
    assert int(layer.metrics.tokens_per_expert.sum()) == B * S * cfg.moe_router_topk


def test_layer_2d_input_and_bf16_weights():
    torch.manual_seed(0)
    layer = MoELayer(moe_config(SMALL_LAYER), dtype=torch.bfloat16)
    x = torch.randn(10, H, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert layer.router.weight.dtype == torch.float32 and layer.router.weight.grad is not None
    assert layer.experts.w13.grad.dtype == torch.bfloat16


def _with_and_without(option: str, num_tokens: int, expert_grad, **overrides) -> list[tuple[torch.Tensor, ...]]:
    """`(output, input grad, expert_grad(layer))` of one forward + backward (a sum of squares) with the boolean
    `option` off, then on; same weights (MoEConfig's default init) and tokens."""
    results = []
    for value in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(
            moe_config(SMALL_LAYER, init_method_std=MoEConfig.init_method_std, **{option: value}, **overrides)
        )
        x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, expert_grad(layer)))
    return results


def test_shared_expert_overlap_does_not_change_results():
    off, on = _with_and_without(
        "moe_shared_expert_overlap", 12, lambda layer: layer.shared_experts.w13.grad,
        moe_shared_expert_intermediate_size=24,
    )  # fmt: skip
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_padding_to_capacity_matches_unpadded():
    off, on = _with_and_without(
        "moe_pad_expert_input_to_capacity", 16, lambda layer: layer.experts.w13.grad, moe_expert_capacity_factor=1.25
    )
    for a, b in zip(off, on):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_eval_no_grad_attaches_nothing_and_counts_nothing():
    cfg, layer = _make("sigmoid_v3")
    layer.eval()
    with torch.no_grad():
        out = layer(torch.randn(2, 8, H))
    assert not out.requires_grad
    assert float(layer.router.expert_bias.counts.sum()) == 0.0


def test_regroup_index_orders_chunks_by_expert():
    # 2 source ranks x 3 local experts; rows arrive as [src0: e0 e1 e2][src1: e0 e1 e2].
    counts_RL = torch.tensor([[2, 0, 1], [1, 2, 1]])
    rows = ["s0e0a", "s0e0b", "s0e2a", "s1e0a", "s1e1a", "s1e1b", "s1e2a"]
    index = regroup_index(counts_RL)
    assert [rows[i] for i in index.tolist()] == ["s0e0a", "s0e0b", "s1e0a", "s1e1a", "s1e1b", "s0e2a", "s1e2a"]


@pytest.mark.parametrize("dispatcher_cls", [AllToAllDispatcher, AllGatherDispatcher])
def test_single_process_dispatch_and_combine(dispatcher_cls):
    T, K, Hd, Ex = 6, 2, 4, 5
    disp = dispatcher_cls(num_experts=Ex)
    x = torch.randn(T, Hd)
    idx = torch.tensor([[3, 0], [0, -1], [4, 3], [1, 0], [-1, -1], [3, 2]])
    probs = torch.rand(T, K)
    res = disp.dispatch(x, probs, idx)
    assert res.tokens_per_expert == [3, 1, 1, 3, 1]
    # Rows grouped by expert, in token order within an expert.
    expected_tokens = [0, 1, 3, 3, 5, 0, 2, 5, 2]
    assert torch.equal(res.expert_input_NH, x[expected_tokens])
    # Identity experts: combine gives sum over kept slots of prob * x.
    out = disp.combine(res.expert_input_NH, res.handle)
    weight_T = (probs * (idx >= 0)).sum(dim=1, keepdim=True)
    torch.testing.assert_close(out, x * weight_T)
