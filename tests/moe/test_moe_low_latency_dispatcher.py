"""The 'flex_ll' dispatcher (mtdeepep low-latency mode, inference only) against 'alltoall'.

Multi-rank cases run at 2 and 4 ranks in the one launcher's `RankPool` (processes started once per world size for
this module, gloo on 127.0.0.1); the single-process tests at the bottom cover the registry, the no-group path and
the argument checks.

Tolerance. Both dispatchers feed the experts bitwise the same rows in the same order (checked), so the expert
outputs are identical; only the combine differs: 'alltoall' adds the weighted rows of a token in expert-id order,
the low-latency combine in slot order, both in FP32, each rounding once to bfloat16. Different FP32 summation orders
differ by a few FP32 ulps, which after rounding to bfloat16 is at most one bfloat16 ulp of the routed sum
(<= 2^-7 of its magnitude). The layer then adds the shared expert in bfloat16, which can carry that one ulp and
round once more: the bound is `2^-7 * (|routed| + |output|)` per element (plus 1e-30 for exact zeros). (With these
small top-k the two sums have so far come out bitwise equal; the bound is what the design guarantees.)
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from moe import MoEConfig, MoELayer
from moe.layer.dispatcher import available_dispatchers, build_dispatcher
from moe.layer.dispatcher.alltoall import AllToAllDispatcher
from moe.layer.dispatcher.buffers import default_ep_buffers
from moe.layer.dispatcher.flex_ll import FlexLowLatencyDispatcher, low_latency_rdma_bytes
from mtdeepep.utils.fp8 import per_token_cast_back, per_token_cast_to_fp8
from tests.ranks import world_size_params

pytestmark = pytest.mark.timeout(300)

H, E, T_MAX = 64, 8, 16
BASE = dict(hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=16, init_method_std=0.2)
BF16_ULP = 2.0**-7  # bfloat16 spacing relative to the magnitude (8 significant bits)
TOKENS_PER_RANK = [7, 0, 11, 4]  # rank 1 dispatches nothing


def ll_config(**overrides) -> MoEConfig:
    """A config naming 'flex_ll' with this module's T_max."""
    fields = {**BASE, "moe_flex_ll_num_max_dispatch_tokens_per_rank": T_MAX, **overrides}
    return MoEConfig(moe_token_dispatcher_type="flex_ll", **fields)


def assert_within_bf16_ulp(actual, expected, routed, msg=""):
    """|actual - expected| <= 2^-7 * (|routed| + |expected|) elementwise (see the module docstring)."""
    assert actual.dtype == expected.dtype == torch.bfloat16, f"{msg}: dtypes {actual.dtype}, {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg}: shapes {actual.shape}, {expected.shape}"
    diff = (actual.double() - expected.double()).abs()
    bound = BF16_ULP * (routed.double().abs() + expected.double().abs()) + 1e-30
    worst = (diff - bound).max().item() if diff.numel() else 0.0
    assert worst <= 0, f"{msg}: differs beyond one bfloat16 ulp (by {worst:.3e}; {int((diff > 0).sum())} differ)"


def tokens(rank: int, num_tokens: int, hidden: int = H, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# Multi-rank cases (run inside every rank; collectives before assertions)
# ---------------------------------------------------------------------------------------------------------------

LAYER_VARIANTS = {
    "top3_shared_overlap": dict(
        moe_router_topk=3, moe_shared_expert_intermediate_size=24, moe_shared_expert_overlap=True
    ),
    "capacity_drops_slots": dict(moe_expert_capacity_factor=0.5, moe_shared_expert_intermediate_size=24),
    "loop_experts_top1": dict(moe_grouped_gemm=False, moe_router_topk=1, moe_router_pre_softmax=True),
    "padded_bmm_truncates": dict(
        moe_padded_batch_gemm=True, moe_padded_batch_gemm_factor=0.5, moe_padded_batch_gemm_alignment=1
    ),
}


def layer_matches_alltoall(ctx, variant: str):
    """A bfloat16 MoELayer built with 'flex_ll' gives the 'alltoall' layer's output on the same weights, under
    no_grad; one rank has no tokens. The 'flex_ll' layer comes from the registry, its buffer from the group's default
    EPBuffers."""
    kw = LAYER_VARIANTS[variant]
    gc.collect()  # the default EPBuffers of earlier cases' layers are gone
    torch.manual_seed(5)
    a2a = MoELayer(MoEConfig(**BASE, **kw), ep_group=ctx.group, dtype=torch.bfloat16)
    ll = MoELayer(ll_config(**kw), ep_group=ctx.group, dtype=torch.bfloat16)
    ll.load_state_dict(a2a.state_dict())
    disp = ll.dispatcher
    lazy = disp.ep_buffers is default_ep_buffers(ctx.group) and disp.ep_buffers.buffers() == []
    x = tokens(ctx.rank, TOKENS_PER_RANK[ctx.rank % 4], seed=len(variant))
    with torch.no_grad():
        out_a = a2a(x)
        out_l = ll(x)
        m_a, m_l = a2a.metrics, ll.metrics
        out_l2 = ll(x)  # again: the buffer's halves alternate between calls
        shared = a2a.shared_experts(x) if a2a.shared_experts is not None else torch.zeros_like(x)
    total_dropped = torch.tensor([m_l.num_dropped_tokens])
    dist.all_reduce(total_dropped, group=ctx.group)

    assert isinstance(disp, FlexLowLatencyDispatcher) and lazy, "registry-built, default buffer made on first use"
    assert disp.buffer.low_latency_mode and disp.buffer.num_rdma_bytes == low_latency_rdma_bytes(
        T_MAX, H, ctx.world_size, E
    )
    routed = out_a.double() - shared.double()
    assert_within_bf16_ulp(out_l, out_a, routed, msg=f"{variant} output")
    assert torch.equal(out_l, out_l2), "a second call gives the same output"
    assert torch.equal(m_l.tokens_per_expert, m_a.tokens_per_expert)
    assert m_l.num_dropped_tokens == m_a.num_dropped_tokens
    if "capacity" in variant or "truncates" in variant:
        assert total_dropped.item() > 0, "the variant must drop slots"


def dispatcher_rows_match_alltoall(ctx):
    """Dispatcher level, on a given buffer: the experts get bitwise the 'alltoall' rows (same order), counts agree,
    masked (-1) slots and a fully masked token are skipped, the combine is within one bfloat16 ulp; a second
    dispatcher with a smaller T_max shares the buffer; then the refusals (all ranks raise, nothing communicated)."""
    R = ctx.world_size
    hint = low_latency_rdma_bytes(T_MAX, H, R, E)
    buffer = deep_ep.Buffer(ctx.group, 0, hint, low_latency_mode=True, explicitly_destroy=True)
    try:
        T, K = [9, 0, 13, 5][ctx.rank % 4], 3
        gen = torch.Generator().manual_seed(40 + ctx.rank)
        x = tokens(ctx.rank, T, seed=4)
        idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]  # distinct experts per token
        if T:
            idx[0, 1:] = -1
            idx[-1] = -1
        probs = torch.rand(T, K, generator=gen)
        scale_H = torch.linspace(0.5, 1.5, H)
        results = []
        dispatchers = [
            AllToAllDispatcher(num_experts=E, ep_group=ctx.group),
            FlexLowLatencyDispatcher(num_experts=E, hidden_size=H, buffer=buffer, num_max_dispatch_tokens_per_rank=16),
            FlexLowLatencyDispatcher(num_experts=E, hidden_size=H, buffer=buffer, num_max_dispatch_tokens_per_rank=13),
        ]
        with torch.no_grad():
            for disp in dispatchers:
                res = disp.dispatch(x, probs, idx)
                y = torch.tanh(res.expert_input_NH.float() * scale_H).to(torch.bfloat16)
                results.append((res.expert_input_NH, res.tokens_per_expert, disp.combine(y, res.handle)))

        errors = refusals(ctx, buffer, x, probs, idx)
    finally:
        buffer.destroy()

    (rows_a, counts_a, out_a) = results[0]
    for rows, counts, out in results[1:]:
        assert counts == counts_a, f"tokens per expert {counts} != {counts_a}"
        assert torch.equal(rows, rows_a), "expert input rows differ"
        assert_within_bf16_ulp(out, out_a, out_a, msg="combined output")
        if T:
            assert torch.count_nonzero(out[-1]) == 0, "a fully masked token combines to zero"
    return errors


def refusals(ctx, buffer, x, probs, idx) -> dict[str, str]:
    """Every rank makes the same bad calls, each refused before it communicates."""
    disp = FlexLowLatencyDispatcher(num_experts=E, hidden_size=H, buffer=buffer, num_max_dispatch_tokens_per_rank=4)
    big = tokens(ctx.rank, 5, seed=9)
    big_idx = torch.zeros(5, 1, dtype=torch.int64)
    calls = {
        "training": lambda: disp.dispatch(x, probs.clone().requires_grad_(), idx),
        "float32": lambda: disp.dispatch(x.float(), probs, idx),
        "too many tokens": lambda: disp.dispatch(big, torch.ones(5, 1), big_idx),
        "wrong hidden": lambda: disp.dispatch(x[:, :8], probs, idx),
        "normal-mode buffer": lambda: FlexLowLatencyDispatcher(num_experts=E, hidden_size=H, buffer=normal),
        "small buffer": lambda: FlexLowLatencyDispatcher(
            num_experts=E, hidden_size=H, buffer=buffer, num_max_dispatch_tokens_per_rank=T_MAX + 1
        ),
    }
    normal = deep_ep.Buffer(ctx.group, 1 << 16, explicitly_destroy=True)
    errors = {}
    try:
        for name, call in calls.items():
            try:
                call()
            except (ValueError, RuntimeError) as error:
                errors[name] = f"{type(error).__name__}: {error}"
            else:
                errors[name] = "no error"
        # The combine refuses autograd too (after a complete dispatch, so the buffer stays usable).
        with torch.no_grad():
            res = disp.dispatch(x[:4], probs[:4], idx[:4])
        y = res.expert_input_NH.float().requires_grad_()
        try:
            disp.combine(y, res.handle)
            errors["training combine"] = "no error"
        except RuntimeError as error:
            errors["training combine"] = f"RuntimeError: {error}"
        with torch.no_grad():
            disp.combine(y, res.handle)  # fine without autograd
    finally:
        normal.destroy()
    return errors


def fp8_rows_are_the_dequantised_cast(ctx):
    """`use_fp8=True`: the experts get bitwise the per-token E4M3 round trip of the tokens (as 'alltoall' on the
    round-tripped tokens gives them); the combine matches that reference within one bfloat16 ulp."""
    Hf = 128
    T, K = [6, 11, 0, 3][ctx.rank % 4], 2
    x = tokens(ctx.rank, T, hidden=Hf, seed=6)
    gen = torch.Generator().manual_seed(60 + ctx.rank)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]  # distinct experts per token
    probs = torch.rand(T, K, generator=gen)
    x_q = per_token_cast_back(*per_token_cast_to_fp8(x)).to(torch.bfloat16)
    ll = FlexLowLatencyDispatcher(
        num_experts=E, hidden_size=Hf, ep_group=ctx.group, num_max_dispatch_tokens_per_rank=T_MAX, use_fp8=True
    )
    results = []
    with torch.no_grad():
        for disp, inp in ((AllToAllDispatcher(num_experts=E, ep_group=ctx.group), x_q), (ll, x)):
            res = disp.dispatch(inp, probs, idx)
            results.append((res.expert_input_NH, disp.combine(res.expert_input_NH * 2, res.handle)))
    (rows_a, out_a), (rows_l, out_l) = results
    assert rows_l.dtype == torch.bfloat16 and torch.equal(rows_l, rows_a), "dequantised FP8 rows differ"
    assert_within_bf16_ulp(out_l, out_a, out_a, msg="fp8 combine")


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=world_size_params(2, 4), ids=lambda n: f"{n}ranks")
def pool(request, rank_pools):
    return rank_pools[request.param]


@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
def test_layer_matches_alltoall(pool, variant):
    pool.run(layer_matches_alltoall, variant)


def test_dispatcher_rows_match_alltoall_and_refusals(pool):
    for rank, errors in enumerate(pool.run(dispatcher_rows_match_alltoall)):
        assert errors["training"].startswith("RuntimeError") and "'flex'" in errors["training"], (rank, errors)
        assert errors["training combine"].startswith("RuntimeError") and "inference only" in errors["training combine"]
        assert errors["float32"].startswith("ValueError") and "bfloat16" in errors["float32"], errors
        assert (
            errors["too many tokens"].startswith("ValueError")
            and "num_max_dispatch_tokens_per_rank=4" in errors["too many tokens"]
        )
        assert errors["wrong hidden"].startswith("ValueError"), errors
        assert (
            errors["normal-mode buffer"].startswith("ValueError") and "low_latency_mode" in errors["normal-mode buffer"]
        )
        assert errors["small buffer"].startswith("ValueError") and "num_rdma_bytes" in errors["small buffer"]


def test_fp8_rows_are_the_dequantised_cast(pool):
    pool.run(fp8_rows_are_the_dequantised_cast)


# Single process ----------------------------------------------------------------------------------------------


def test_registry_builds_flex_ll():
    assert "flex_ll" in available_dispatchers()
    disp = build_dispatcher(ll_config(moe_flex_ll_num_max_dispatch_tokens_per_rank=32))
    assert isinstance(disp, FlexLowLatencyDispatcher) and disp.supports_async
    assert disp.num_max_dispatch_tokens_per_rank == 32 and not disp.use_fp8 and disp.buffer is None


def test_single_process_layer_equals_alltoall():
    """Without a group the rows are regrouped locally and combined as 'alltoall' does: bitwise the same output."""
    kw = LAYER_VARIANTS["top3_shared_overlap"]
    torch.manual_seed(3)
    a2a = MoELayer(MoEConfig(**BASE, **kw), dtype=torch.bfloat16)
    ll = MoELayer(ll_config(**kw), dtype=torch.bfloat16)
    ll.load_state_dict(a2a.state_dict())
    x = tokens(0, 12)
    with torch.no_grad():
        assert torch.equal(ll(x), a2a(x))


def test_single_process_fp8_rows_are_the_dequantised_cast():
    x = tokens(0, 10, hidden=128)
    idx = torch.tensor([[e % E, (e + 3) % E] for e in range(10)])
    probs = torch.rand(10, 2)
    ll = FlexLowLatencyDispatcher(num_experts=E, hidden_size=128, use_fp8=True)
    a2a = AllToAllDispatcher(num_experts=E)
    with torch.no_grad():
        rows = ll.dispatch(x, probs, idx).expert_input_NH
        expected = a2a.dispatch(per_token_cast_back(*per_token_cast_to_fp8(x)).to(torch.bfloat16), probs, idx)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, expected.expert_input_NH)
    assert not torch.equal(rows, a2a.dispatch(x, probs, idx).expert_input_NH), "FP8 must round something"


def test_training_and_dtype_refused_in_one_process():
    layer = MoELayer(ll_config(), dtype=torch.bfloat16)
    x = tokens(0, 5)
    with pytest.raises(RuntimeError, match="inference only.*'flex'"):
        layer(x)  # grad enabled: the router's weights make the routing probabilities require grad
    with torch.no_grad(), pytest.raises(ValueError, match="bfloat16"):
        MoELayer(ll_config())(x.float())
    with torch.no_grad(), pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        layer(tokens(0, T_MAX + 1))
    with torch.inference_mode():
        assert layer(x).shape == x.shape


def test_constructor_checks():
    with pytest.raises(ValueError, match="positive int"):
        FlexLowLatencyDispatcher(num_experts=E, hidden_size=H, num_max_dispatch_tokens_per_rank=0)
    with pytest.raises(ValueError, match="hidden_size % 128"):
        FlexLowLatencyDispatcher(num_experts=E, hidden_size=100, use_fp8=True)
