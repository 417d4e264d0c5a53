"""The 'flex' (mtdeepep) dispatcher in one process: row expansion, dispatch/combine, parity with 'alltoall'.

Multi-rank parity (EP 1 on a real one-rank Buffer, EP 2, EP 4) is in `moe_dist_cases.py` (cases named `*flex*`).
"""

from __future__ import annotations

import pytest
import torch

import mtdeepep as deep_ep
from moe import MoELayer
from moe.layer.dispatcher import build_dispatcher
from moe.layer.dispatcher.alltoall import AllToAllDispatcher
from moe.layer.dispatcher.base import weighted_scatter_sum
from moe.layer.dispatcher.flex import FlexDispatcher, expand_by_local_expert, nvl_bytes_hint

from .moe_testlib import SIGMOID_V3, SMALL_LAYER, assert_close, moe_config

pytestmark = pytest.mark.timeout(120)

H, E = SMALL_LAYER["hidden_size"], SMALL_LAYER["num_moe_experts"]

VARIANTS = {
    "top2_aux_z": dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    "top3_shared_overlap": dict(
        moe_router_topk=3, moe_shared_expert_intermediate_size=24, moe_shared_expert_overlap=True
    ),
    "sigmoid_v3_groups": {**SIGMOID_V3, "moe_router_enable_expert_bias": False},
    "capacity_probs": dict(moe_expert_capacity_factor=0.5, moe_aux_loss_coeff=0.01),
    "padded_bmm": dict(moe_padded_batch_gemm=True, moe_padded_batch_gemm_alignment=8),
    "loop_experts_top1": dict(moe_grouped_gemm=False, moe_router_topk=1, moe_router_pre_softmax=True),
}


def _layer(dispatcher: str, variant: str, dtype=torch.float32) -> MoELayer:
    cfg = moe_config(SMALL_LAYER, moe_token_dispatcher_type=dispatcher, **VARIANTS[variant])
    torch.manual_seed(0)
    return MoELayer(cfg, dtype=dtype)


def test_expand_by_local_expert_one_row_per_token_and_local_expert():
    # 4 received tokens, top-3, 2 local experts; -1 = the slot's expert lives on another rank (or was dropped).
    recv_idx = torch.tensor([[1, -1, 0], [0, 1, -1], [-1, -1, -1], [1, 0, -1]])
    recv_w = torch.tensor([[0.5, 0.0, 0.25], [0.1, 0.2, 0.0], [0.0, 0.0, 0.0], [0.3, 0.4, 0.0]], requires_grad=True)
    rows, experts, weights = expand_by_local_expert(recv_idx, recv_w)
    # Expert 0's rows first, each expert's rows in received order; token 2 (nothing local) gets no row.
    assert rows.tolist() == [0, 1, 3, 0, 1, 3]
    assert experts.tolist() == [0, 0, 0, 1, 1, 1]
    assert weights.tolist() == pytest.approx([0.25, 0.1, 0.4, 0.5, 0.2, 0.3])
    weights.sum().backward()
    assert recv_w.grad.tolist() == [[1, 0, 1], [1, 1, 0], [0, 0, 0], [1, 1, 0]]


def test_single_process_dispatch_and_combine():
    T, K, Hd = 6, 2, 4
    disp = FlexDispatcher(num_experts=5, hidden_size=Hd)
    assert disp.buffer is None, "no EP group: no buffer, no communication"
    x = torch.randn(T, Hd)
    idx = torch.tensor([[3, 0], [0, -1], [4, 3], [1, 0], [-1, -1], [3, 2]])
    probs = torch.rand(T, K)
    res = disp.dispatch(x, probs, idx)
    assert res.tokens_per_expert == [3, 1, 1, 3, 1]
    assert torch.equal(res.expert_input_NH, x[[0, 1, 3, 3, 5, 0, 2, 5, 2]])
    out = disp.combine(res.expert_input_NH * 2, res.handle)  # experts that double their input
    torch.testing.assert_close(out, 2 * x * (probs * (idx >= 0)).sum(dim=1, keepdim=True))
    assert torch.count_nonzero(out[4]) == 0, "a token with every slot dropped combines to zero"


def test_combine_weights_and_sums_in_float32_then_rounds_once():
    disp = FlexDispatcher(num_experts=8, hidden_size=1)
    res = disp.dispatch(torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 8), torch.arange(8).view(1, 8))
    y = torch.tensor([[256.0]] + [[1.0]] * 7, dtype=torch.bfloat16)  # one row per expert
    out = disp.combine(y, res.handle)
    # In bfloat16, 256 + 1 rounds back to 256 at every step; in float32 the sum is 263, rounded once.
    assert out.dtype == torch.bfloat16
    assert out.item() == torch.tensor(263.0).to(torch.bfloat16).item() != 256.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_scatter_sum_matches_autograd_and_keeps_only_the_rows(dtype):
    """The combine's weighted sum equals the plain autograd formula bit for bit (values and both gradients), and
    keeps for backward only the rows in their dtype, the weights and the token ids: not the float32 copy of the
    rows nor the float32 product `index_add` would keep."""
    gen = torch.Generator().manual_seed(0)
    M, T, Hd = 300, 100, 64
    rows = torch.randn(M, Hd, generator=gen).to(dtype).requires_grad_()
    weights = torch.rand(M, generator=gen).requires_grad_()
    token = torch.randint(0, T, (M,), generator=gen)
    grad = torch.randn(T, Hd, generator=gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = weighted_scatter_sum(rows, weights, token, T)
    expected = torch.zeros(T, Hd).index_add(0, token, rows.float() * weights.unsqueeze(1))
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    got_grads = torch.autograd.grad(out, (rows, weights), grad)
    expected_grads = torch.autograd.grad(expected, (rows, weights), grad)
    for got, want in zip(got_grads, expected_grads):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert sum(t.numel() * t.element_size() for t in saved) == (
        rows.numel() * rows.element_size() + weights.numel() * 4 + token.numel() * 8
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_flex_layer_matches_alltoall_in_one_process(variant):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 10, H, generator=gen)
    grad_out = torch.randn(2, 10, H, generator=gen)
    results = []
    for disp in ("alltoall", "flex"):
        layer = _layer(disp, variant)
        x_in = x.clone().requires_grad_()
        out = layer(x_in)
        (out * grad_out).sum().backward()
        grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
        results.append((out.detach(), x_in.grad, grads, layer.metrics))
    (out_a, gx_a, grads_a, m_a), (out_f, gx_f, grads_f, m_f) = results
    assert_close(out_f, out_a, msg="output")
    assert_close(gx_f, gx_a, msg="x grad")
    assert grads_f.keys() == grads_a.keys() and "router.weight" in grads_f
    for name in grads_a:
        assert_close(grads_f[name], grads_a[name], msg=f"{name} grad")
    assert m_f.num_dropped_tokens == m_a.num_dropped_tokens
    assert m_f.losses.keys() == m_a.losses.keys()


def test_flex_layer_bf16_matches_alltoall():
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    outs = [_layer(disp, "top3_shared_overlap", dtype=torch.bfloat16)(x) for disp in ("alltoall", "flex")]
    assert outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])


def test_registry_and_layer_seam():
    cfg = moe_config(SMALL_LAYER, moe_token_dispatcher_type="flex")
    disp = build_dispatcher(cfg)
    assert isinstance(disp, FlexDispatcher) and disp.hidden_size == H and disp.num_local_experts == E
    own = FlexDispatcher(num_experts=E, hidden_size=H)
    assert MoELayer(cfg, dispatcher=own).dispatcher is own
    with pytest.raises(ValueError, match="num_moe_experts"):
        MoELayer(cfg, dispatcher=AllToAllDispatcher(num_experts=2 * E))


def test_nvl_bytes_hint_covers_float32_rows_of_both_configs():
    for ranks in (1, 2, 4, 8):
        hint = nvl_bytes_hint(H, ranks)
        for config in (deep_ep.Buffer.get_dispatch_config(ranks), deep_ep.Buffer.get_combine_config(ranks)):
            assert hint >= config.get_nvl_buffer_size_hint(H * 4, ranks)
        assert nvl_bytes_hint(2 * H, ranks) > hint
