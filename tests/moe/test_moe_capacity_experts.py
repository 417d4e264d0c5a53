"""Capacity policies and padding plans; the three expert implementations against each other."""

from __future__ import annotations

import pytest
import torch

import moe.layer.experts as experts_mod
from moe.layer.capacity import apply_capacity, expert_capacity, pad_rows, plan_padding, unpad_rows
from moe.layer.experts import SwiGLUExperts, grouped_mm_available

from .moe_testlib import assert_close, ref_capacity_keep, sqnr_db, swiglu_row

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------------------------------------
# Capacity
# ---------------------------------------------------------------------------------------------------------------


def test_expert_capacity_formula():
    assert expert_capacity(16, 8, 2, 1.0) == 4
    assert expert_capacity(10, 8, 2, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(16, 8, 2, 1.25) == 5
    assert expert_capacity(100, 64, 8, 0.5) == 7  # ceil(6.25)


def _routing(T, E, K, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    probs = torch.rand(T, K, generator=gen)
    return probs, idx


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity", [1, 3, 100])
def test_apply_capacity_matches_reference(policy, capacity):
    T, E, K = 24, 6, 2
    probs, idx = _routing(T, E, K, seed=capacity)
    res = apply_capacity(probs, idx, E, capacity, policy)
    keep = ref_capacity_keep(idx.tolist(), probs.tolist(), E, capacity, policy)
    assert res.keep_TK.tolist() == keep
    assert res.num_dropped == sum(not k for row in keep for k in row)
    assert torch.equal(res.topk_idx_TK, torch.where(res.keep_TK, idx, -1))
    assert torch.equal(res.probs_TK, probs * res.keep_TK)
    counts = torch.bincount(res.topk_idx_TK[res.keep_TK], minlength=E)
    assert int(counts.max()) <= capacity
    if capacity == 100:
        assert res.num_dropped == 0
    else:
        assert res.num_dropped > 0


def test_apply_capacity_probs_policy_prefers_high_probs_and_keeps_grad():
    idx = torch.zeros(4, 1, dtype=torch.long)  # all four tokens want expert 0
    probs = torch.tensor([[0.1], [0.9], [0.5], [0.7]], requires_grad=True)
    res = apply_capacity(probs, idx, 2, 2, "probs")
    assert res.keep_TK.flatten().tolist() == [False, True, False, True]
    res.probs_TK.sum().backward()
    assert probs.grad.flatten().tolist() == [0.0, 1.0, 0.0, 1.0]
    res = apply_capacity(probs, idx, 2, 2, "position")
    assert res.keep_TK.flatten().tolist() == [True, True, False, False]


def test_apply_capacity_ignores_already_dropped_slots():
    idx = torch.tensor([[0, -1], [0, 1], [-1, 1]])
    probs = torch.rand(3, 2)
    res = apply_capacity(probs, idx, 2, 1, "position")
    assert res.topk_idx_TK.tolist() == [[0, -1], [-1, 1], [-1, -1]]
    assert res.num_dropped == 2


def test_pad_plan_pads_and_truncates():
    counts = [3, 0, 6, 2]
    plan = plan_padding(counts, 4)
    assert plan.num_dropped == 2
    x = torch.randn(11, 5, requires_grad=True)
    padded = pad_rows(x, plan).view(4, 4, 5)
    assert torch.equal(padded[0, :3], x[:3].detach()) and padded[0, 3].abs().sum() == 0
    assert padded[1].abs().sum() == 0
    assert torch.equal(padded[2], x[3:7].detach())  # rows 7, 8 truncated
    back = unpad_rows(padded.flatten(0, 1), plan)
    expected = x.detach().clone()
    expected[7:9] = 0
    assert torch.equal(back, expected)
    back.sum().backward()
    assert x.grad[:, 0].tolist() == [1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1]


# ---------------------------------------------------------------------------------------------------------------
# Experts
# ---------------------------------------------------------------------------------------------------------------

L, H, F_HID = 4, 32, 16


def _experts(impl, **kw):
    torch.manual_seed(0)
    return SwiGLUExperts(L, H, F_HID, impl=impl, init_std=0.3, **kw)


def _run(module, x, counts, grad):
    x = x.clone().requires_grad_()
    y = module(x, counts)
    y.backward(grad)
    return y.detach(), x.grad, module.w13.grad, module.w2.grad


def _ref_rows(module, x, counts):
    rows, start = [], 0
    for e, c in enumerate(counts):
        for n in range(start, start + c):
            rows.append(swiglu_row(x[n].double(), module.w13[e].double(), module.w2[e].double()))
        start += c
    return torch.stack(rows)


COUNTS = [[5, 0, 9, 2], [0, 0, 0, 7], [3, 3, 3, 3]]


@pytest.mark.parametrize("counts", COUNTS, ids=str)
def test_expert_impls_agree(counts):
    N = sum(counts)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(N, H, generator=gen), torch.randn(N, H, generator=gen)
    loop = _run(_experts("loop"), x, counts, grad)
    assert_close(loop[0], _ref_rows(_experts("loop"), x, counts), msg="loop vs per-row reference")
    for impl, kw in [("grouped", {}), ("padded", {"padded_alignment": 8})]:
        module = _experts(impl, **kw)
        got = _run(module, x, counts, grad)
        for name, a, b in zip(["y", "dx", "dw13", "dw2"], got, loop):
            assert_close(a, b, msg=f"{impl} {name}")
        assert module.last_num_dropped == 0
    # Experts without tokens still get a (zero) gradient.
    for e, c in enumerate(counts):
        if c == 0:
            assert loop[2][e].abs().sum() == 0 and loop[3][e].abs().sum() == 0


def test_every_expert_gets_a_grad_even_with_no_rows_at_all():
    for impl in ("grouped", "loop", "padded"):
        module = _experts(impl)
        x = torch.randn(0, H, requires_grad=True)
        y = module(x, [0, 0, 0, 0])
        (y.sum() + 0.0 * x.sum()).backward()
        assert module.w13.grad is not None and module.w2.grad is not None, impl
        assert module.w13.grad.abs().sum() == 0


def test_grouped_falls_back_to_loop_when_grouped_mm_unusable(monkeypatch):
    counts = [4, 1, 0, 6]
    gen = torch.Generator().manual_seed(2)
    x, grad = torch.randn(11, H, generator=gen), torch.randn(11, H, generator=gen)
    expected = _run(_experts("loop"), x, counts, grad)
    monkeypatch.setattr(experts_mod, "grouped_mm_available", lambda device_type, dtype: False)
    got = _run(_experts("grouped"), x, counts, grad)
    for a, b in zip(got, expected):
        assert_close(a, b, msg="fallback")


def test_grouped_mm_probe_and_unaligned_shapes():
    available = grouped_mm_available("cpu", torch.float32)
    assert isinstance(available, bool)
    assert grouped_mm_available("cpu", torch.float64) is False  # _grouped_mm takes no float64
    # H = 30 float32 rows are not 16-byte aligned: the grouped path must fall back and still be right.
    torch.manual_seed(0)
    odd = SwiGLUExperts(2, 30, 10, impl="grouped", init_std=0.3)
    ref = SwiGLUExperts(2, 30, 10, impl="loop", init_std=0.3)
    ref.load_state_dict(odd.state_dict())
    x = torch.randn(7, 30)
    assert_close(odd(x, [3, 4]), ref(x, [3, 4]), msg="unaligned")


def test_grouped_experts_float64_and_bf16():
    counts = [2, 5, 0, 3]
    x = torch.randn(10, H, dtype=torch.float64)
    m64 = SwiGLUExperts(L, H, F_HID, impl="grouped", dtype=torch.float64)
    assert_close(m64(x, counts), _ref_rows(m64, x, counts), rtol=1e-10, atol=1e-12, msg="float64")
    mbf = SwiGLUExperts(L, H, F_HID, impl="grouped", dtype=torch.bfloat16, init_std=0.3)
    ref = _ref_rows(mbf, x.bfloat16(), counts)
    out = mbf(x.bfloat16(), counts)
    assert out.dtype == torch.bfloat16
    # bf16 rounds the input, the weights and both intermediate products (8-bit mantissa): ~40 dB expected.
    assert sqnr_db(ref, out) > 30


def test_padded_experts_truncate_and_count_drops():
    counts = [10, 1, 2, 3]  # mean 4; factor 1.0 and alignment 4 -> length 4: expert 0 loses 6 rows
    module = _experts("padded", padded_factor=1.0, padded_alignment=4)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, H, generator=gen)
    y = module(x, counts)
    assert module.last_num_dropped == 6
    full = _experts("loop")(x, counts)
    kept = torch.tensor([True] * 4 + [False] * 6 + [True] * 6)
    assert_close(y[kept], full[kept], msg="kept rows")
    assert y[~kept].abs().sum() == 0
    with pytest.raises(ValueError, match="must have 4 entries summing to 16"):
        module(x, [10, 1, 2])


def test_aligned_row_positions():
    positions, padded = experts_mod.aligned_row_positions([5, 0, 9, 2], 4, torch.device("cpu"))
    assert padded == [8, 0, 12, 4]
    assert positions.tolist() == [0, 1, 2, 3, 4] + list(range(8, 17)) + [20, 21]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_alignment_changes_no_result(dtype):
    """Padding every expert's rows to a multiple of 8 (zero rows, sliced off) gives the unpadded values and
    gradients up to the GEMMs' summation order (their blocking depends on the row count)."""
    counts = [5, 0, 9, 2]
    gen = torch.Generator().manual_seed(4)
    x, grad = torch.randn(16, H, generator=gen).to(dtype), torch.randn(16, H, generator=gen).to(dtype)
    plain = _experts("grouped", row_alignment=1, dtype=dtype)
    aligned = _experts("grouped", row_alignment=8, dtype=dtype)
    aligned.load_state_dict(plain.state_dict())
    expected, got = _run(plain, x, counts, grad), _run(aligned, x, counts, grad)
    for name, a, b in zip(["y", "dx", "dw13", "dw2"], got, expected):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, name
        if dtype == torch.float32:
            assert_close(a, b, msg=name)  # float32 reassociation over K <= 32 terms: far inside 1e-4 / 1e-5
        else:  # one BF16 rounding of results that may be summed in another order: 2^-8 relative
            assert sqnr_db(b.float(), a.float()) > 40, name
    assert experts_mod.default_row_alignment(torch.device("cpu"), torch.bfloat16) == 32
    assert experts_mod.default_row_alignment(torch.device("cpu"), torch.float32) == 1
    with pytest.raises(ValueError, match="row_alignment must be >= 1"):
        _experts("grouped", row_alignment=0)
