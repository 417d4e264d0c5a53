"""Intranode cases run inside the rank processes of `ranks.RankPool` (see test_intranode.py).

Each case builds random inputs on every rank, gathers them, and compares the buffer's results with the plain
PyTorch reference of `mtdeepep.utils.refs`. Tolerances: dispatch moves bytes, so it must be exact; combine
sums at most R rows in FP32 and rounds once to the output dtype, so it must be within one output rounding
(bf16: relative 2^-8) of a float64 reference.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from mtdeepep.utils import refs

BF16_REL = 2.0**-8  # one bf16 rounding of the FP32 sum


def buffer_for(ctx, num_nvl_bytes: int = 64 << 20, **kwargs) -> deep_ep.Buffer:
    """One buffer per size, reused across cases of the same pool."""
    key = f"buffer-{num_nvl_bytes}-{sorted(kwargs.items())}"
    if key not in ctx.cache:
        ctx.cache[key] = deep_ep.Buffer(ctx.group, num_nvl_bytes, **kwargs)
    return ctx.cache[key]


def gather(ctx, value):
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value, group=ctx.group)
    return out


def make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed, dtype=torch.bfloat16, masked=0.1):
    generator = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_idx = scores.topk(num_topk, dim=1).indices
    drop = torch.rand(num_tokens, num_topk, generator=generator) < masked
    topk_idx = topk_idx.masked_fill(drop, -1)
    topk_weights = torch.rand(num_tokens, num_topk, generator=generator) + 0.1
    return x, topk_idx, topk_weights


def layout_and_dispatch(buffer, x, topk_idx, topk_weights, num_experts, **kwargs):
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
        topk_idx, num_experts
    )
    return buffer.dispatch(
        x,
        num_tokens_per_rank=num_tokens_per_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        **kwargs,
    )


def assert_close_rounding(actual: torch.Tensor, expected: torch.Tensor, rel: float = BF16_REL) -> None:
    diff = (actual.double() - expected.double()).abs()
    bound = rel * expected.double().abs() + 1e-30
    assert bool((diff <= bound).all()), f"max excess {(diff - bound).max().item():.3e}"


# ---------------------------------------------------------------------------------------------------------------
# Layout and dispatch


def layout_matches_reference(ctx):
    buffer = buffer_for(ctx)
    for seed, (tokens, experts, topk) in enumerate([(256, 16, 4), (1000, 64, 8), (1, 8, 8), (333, 8, 1)]):
        experts = experts * ctx.world_size // 2 if experts % ctx.world_size else experts
        _, topk_idx, _ = make_inputs(ctx, tokens, 8, experts, topk, seed, masked=0.2)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
        ref_rank, ref_expert, ref_in_rank = refs.ref_dispatch_layout(topk_idx, experts, ctx.world_size)
        assert per_rdma is None
        assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
        assert torch.equal(per_rank, ref_rank) and torch.equal(per_expert, ref_expert)
        assert torch.equal(in_rank, ref_in_rank)


def check_dispatch(ctx, buffer, num_tokens, hidden, num_experts, num_topk, seed, dtype=torch.bfloat16, masked=0.1,
                   expert_alignment=1):  # fmt: skip
    x, topk_idx, topk_weights = make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed, dtype, masked)
    recv_x, recv_idx, recv_w, counts, handle, event = layout_and_dispatch(
        buffer, x, topk_idx, topk_weights, num_experts, expert_alignment=expert_alignment
    )
    everyone = gather(ctx, (x, topk_idx, topk_weights))
    ref = refs.ref_dispatch(
        [e[0] for e in everyone], [e[1] for e in everyone], [e[2] for e in everyone], num_experts, ctx.rank,
        expert_alignment,
    )  # fmt: skip
    assert torch.equal(recv_x, ref.recv_x), "recv_x differs from the reference"
    assert torch.equal(recv_idx, ref.recv_topk_idx), "recv_topk_idx differs"
    assert torch.equal(recv_w, ref.recv_topk_weights), "recv_topk_weights differs"
    assert counts == ref.num_recv_tokens_per_expert, (counts, ref.num_recv_tokens_per_expert)
    rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = handle
    assert torch.equal(rank_prefix_matrix, ref.rank_prefix_matrix)
    assert torch.equal(recv_src_idx.long(), ref.recv_src_idx)
    assert channel_prefix.shape == recv_channel_prefix.shape == (ctx.world_size, deep_ep.Buffer.num_sms // 2)
    # Upstream's own checks: local ids in [-1, E_local), weights 0 exactly where the id is -1, counts equal to
    # the all-reduced per-expert counts.
    num_local = num_experts // ctx.world_size
    assert bool(((recv_idx >= -1) & (recv_idx < num_local)).all())
    assert bool((recv_w[recv_idx < 0] == 0).all())
    global_counts = (topk_idx.unsqueeze(-1) == torch.arange(num_experts)).sum(dim=(0, 1)).int()
    dist.all_reduce(global_counts, group=ctx.group)
    local_counts = global_counts[ctx.rank * num_local : (ctx.rank + 1) * num_local]
    aligned = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in local_counts.tolist()]
    assert counts == aligned
    # send_head: each token's position among the tokens sent to each rank, -1 where it is not sent.
    for r in range(ctx.world_size):
        sent = in_rank[:, r]
        assert bool((send_head[~sent, r] == -1).all())
        assert torch.equal(send_head[sent, r], torch.arange(int(sent.sum()), dtype=torch.int32))
    return x, topk_idx, topk_weights, recv_x, recv_idx, recv_w, handle, ref


def dispatch_matches_reference(ctx):
    buffer = buffer_for(ctx)
    for seed, shape in enumerate([(128, 256, 16, 4), (300, 96, 32, 8), (64, 7168, 8, 2), (200, 130, 24, 3)]):
        tokens, hidden, experts, topk = shape
        experts = experts if experts % ctx.world_size == 0 else experts * ctx.world_size
        check_dispatch(ctx, buffer, tokens, hidden, experts, topk, seed)
    # float32 and float16 payloads move the same way
    check_dispatch(ctx, buffer, 100, 64, 8, 2, 7, dtype=torch.float32)
    check_dispatch(ctx, buffer, 100, 64, 8, 2, 8, dtype=torch.float16)


def dispatch_segments_constant_per_source(ctx):
    """Upstream's check: rows filled with the source rank id; each source segment of recv_x is that id."""
    buffer = buffer_for(ctx)
    _, topk_idx, topk_weights = make_inputs(ctx, 512, 128, 32, 8, seed=11)
    x = torch.full((512, 128), float(ctx.rank), dtype=torch.bfloat16)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 32)
    prefix = handle[0][:, ctx.rank].tolist()
    for source in range(ctx.world_size):
        begin = prefix[source - 1] if source else 0
        segment = recv_x[begin : prefix[source]]
        assert bool((segment == source).all()), f"segment of source {source} is not constant"


def expert_alignment_rounds_counts(ctx):
    buffer = buffer_for(ctx)
    for alignment in (4, 128):
        check_dispatch(ctx, buffer, 150, 32, 16, 4, seed=20 + alignment, expert_alignment=alignment)


def fp8_dispatch_passes_through(ctx):
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights = make_inputs(ctx, 200, 256, 16, 4, seed=30)
    e4m3, scales = refs.per_token_cast_to_fp8(x.float())
    for layout in ("row", "column"):
        s = scales if layout == "row" else scales.T.contiguous().T  # upstream passes column-major scales
        (recv_data, recv_scales), recv_idx, _, _, handle, _ = layout_and_dispatch(
            buffer, (e4m3, s), topk_idx, topk_weights, 16
        )
        everyone = gather(ctx, (e4m3.view(torch.uint8), scales, topk_idx))
        ref_data = refs.ref_dispatch([e[0] for e in everyone], [e[2] for e in everyone], None, 16, ctx.rank)
        ref_scales = refs.ref_dispatch([e[1] for e in everyone], [e[2] for e in everyone], None, 16, ctx.rank)
        assert recv_data.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
        assert torch.equal(recv_data.view(torch.uint8), ref_data.recv_x), f"fp8 data ({layout}-major scales)"
        assert torch.equal(recv_scales, ref_scales.recv_x), f"scales ({layout}-major)"
        # dequantised rows still represent the sender's bf16 rows within FP8's precision
        # E4M3 keeps 3 mantissa bits (half-ulp 2^-4 relative); values below 2^-6 are subnormal with spacing
        # 2^-9, in units of the block's scale.
        deq = refs.per_token_cast_back(recv_data, recv_scales)
        ref_x = refs.ref_dispatch(gather(ctx, x), [e[2] for e in everyone], None, 16, ctx.rank).recv_x.float()
        bound = 2.0**-4 * ref_x.abs() + 2.0**-10 * recv_scales.repeat_interleave(128, dim=1)
        assert bool(((deq - ref_x).abs() <= bound * 1.001).all())
        # a cached FP8 dispatch reuses the layout
        (cached_data, cached_scales), *_ = buffer.dispatch((e4m3, s), handle=handle)
        assert torch.equal(cached_data.view(torch.uint8), recv_data.view(torch.uint8))
        assert torch.equal(cached_scales, recv_scales)


def cached_dispatch_matches(ctx):
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, 256, 64, 16, 4, seed=40)
    again, recv_idx, recv_w, counts, same_handle, _ = buffer.dispatch(x, handle=handle)
    assert torch.equal(again, recv_x)
    assert recv_idx is None and recv_w is None and counts is None and same_handle is handle
    # a different payload with the same routing (e.g. a gradient) follows the same layout
    y = torch.randn(256, 48)
    recv_y, *_ = buffer.dispatch(y, handle=handle)
    everyone = gather(ctx, (y, topk_idx))
    ref = refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], None, 16, ctx.rank)
    assert torch.equal(recv_y, ref.recv_x)


def num_worst_tokens_pads_outputs(ctx):
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights = make_inputs(ctx, 100, 64, 16, 4, seed=50)
    worst = 100 * ctx.world_size
    recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(
        buffer, x, topk_idx, topk_weights, 16, num_worst_tokens=worst
    )
    everyone = gather(ctx, (x, topk_idx, topk_weights))
    ref = refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], 16, ctx.rank)
    n = ref.recv_x.size(0)
    assert recv_x.size(0) == recv_idx.size(0) == recv_w.size(0) == worst
    assert counts == []
    assert torch.equal(recv_x[:n], ref.recv_x) and torch.equal(recv_idx[:n], ref.recv_topk_idx)
    assert bool((recv_idx[n:] == -1).all()) and bool((recv_w[n:] == 0).all())
    # combine through a worst-case handle uses only the valid rows
    out, _, _ = buffer.combine(recv_x, handle)
    expected = x.double() * handle[4].sum(dim=1, keepdim=True)
    assert_close_rounding(out, expected)


def dispatch_too_few_worst_tokens_is_an_error(ctx):
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights = make_inputs(ctx, 100, 16, 8, 4, seed=51, masked=0.0)
    try:
        layout_and_dispatch(buffer, x, topk_idx, topk_weights, 8, num_worst_tokens=10)
    except deep_ep.GroupMismatchError as error:
        assert "num_worst_tokens=10" in str(error)
    else:
        raise AssertionError("expected GroupMismatchError")
    check_dispatch(ctx, buffer, 64, 16, 8, 2, seed=52)  # the buffer stays usable


# ---------------------------------------------------------------------------------------------------------------
# Combine


def combine_matches_reference(ctx):
    buffer = buffer_for(ctx)
    for seed, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32)):
        x, topk_idx, topk_weights, recv_x, recv_idx, recv_w, handle, ref = check_dispatch(
            ctx, buffer, 300, 160, 16, 4, seed=60 + seed, dtype=dtype
        )
        expert_out = (recv_x.float() * (1.5 + ctx.rank) + 0.25).to(dtype)  # a different "expert" per rank
        combined, combined_w, _ = buffer.combine(expert_out, handle, topk_weights=recv_w)
        everyone = gather(ctx, (expert_out, ref.recv_src_rank, ref.recv_src_idx, recv_w))
        expected, expected_w = refs.ref_combine(
            [e[0] for e in everyone], [e[1] for e in everyone], [e[2] for e in everyone], ctx.rank, 300,
            [e[3] for e in everyone],
        )  # fmt: skip
        expected64 = _ref_combine_f64(everyone, ctx.rank, 300)
        assert combined.dtype == dtype
        assert_close_rounding(combined, expected64, BF16_REL if dtype == torch.bfloat16 else 2.0**-11)
        assert torch.allclose(combined_w, expected_w, rtol=1e-6, atol=0)
        # the combined weights rebuild the original ones (masked slots are 0 everywhere)
        assert torch.allclose(combined_w, topk_weights.masked_fill(topk_idx < 0, 0.0), rtol=1e-6, atol=0)


def _ref_combine_f64(everyone, rank, num_tokens):
    hidden = everyone[0][0].size(1)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float64)
    for expert_out, src_rank, src_idx, _ in everyone:
        mine = src_rank == rank
        out.index_add_(0, src_idx[mine], expert_out[mine].double())
    return out


def combine_accumulates_in_fp32(ctx):
    """1 + 2^-8 + 2^-8 + ... rounds to 1 at every step in bf16 but not in FP32."""
    buffer = buffer_for(ctx)
    num_experts = ctx.world_size * 2
    topk_idx = torch.arange(0, num_experts, 2).repeat(8, 1)  # every token goes to every rank
    x = torch.ones(8, 16, dtype=torch.bfloat16)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, None, num_experts)
    value = 1.0 if ctx.rank == 0 else 2.0**-8
    combined, _, _ = buffer.combine(torch.full_like(recv_x, value), handle)
    exact = 1.0 + (ctx.world_size - 1) * 2.0**-8
    expected = torch.tensor(exact, dtype=torch.float32).bfloat16()
    assert bool((combined == expected).all()), (combined[0, 0].item(), expected.item())
    assert ctx.world_size == 2 or expected.item() != 1.0


def combine_adds_bias(ctx):
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, 128, 64, 8, 2, seed=70)
    generator = torch.Generator().manual_seed(ctx.rank + 71)
    b0 = torch.randn(128, 64, generator=generator).bfloat16()
    b1 = torch.randn(128, 64, generator=generator).bfloat16()
    base = x.double() * handle[4].sum(dim=1, keepdim=True)
    for bias, expected in [(b0, base + b0.double()), ((b0, b1), base + b0.double() + b1.double()),
                           ((None, b1), base + b1.double())]:  # fmt: skip
        combined, _, _ = buffer.combine(recv_x, handle, bias=bias)
        assert_close_rounding(combined, expected)


def async_and_previous_event(ctx):
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights = make_inputs(ctx, 256, 128, 16, 4, seed=80)
    everyone = gather(ctx, (x, topk_idx, topk_weights))
    ref = refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], 16, ctx.rank)
    previous = deep_ep.Buffer.capture()
    assert previous.query()
    per_rank, _, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(
        topk_idx, 16, previous_event=previous, async_finish=True, allocate_on_comm_stream=True
    )
    recv_x, recv_idx, recv_w, counts, handle, dispatch_event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights, previous_event=layout_event, async_finish=True,
    )  # fmt: skip
    combined, _, combine_event = buffer.combine(
        recv_x, handle, previous_event=dispatch_event, async_finish=True, allocate_on_comm_stream=True
    )
    with combine_event:  # leaving the block waits, as EventOverlap's context manager does upstream
        pass
    dispatch_event.current_stream_wait()
    assert torch.equal(recv_x, ref.recv_x) and torch.equal(recv_idx, ref.recv_topk_idx)
    assert_close_rounding(combined, x.double() * in_rank.sum(dim=1, keepdim=True))
    # allocate_on_comm_stream without its prerequisites is refused, as upstream asserts
    try:
        buffer.get_dispatch_layout(topk_idx, 16, allocate_on_comm_stream=True)
    except ValueError:
        pass
    else:
        raise AssertionError("expected ValueError")


def async_runs_off_the_callers_thread(ctx):
    """The caller gets control back while the comm thread still waits for a late peer."""
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, 64, 32, 8, 2, seed=85)
    dist.barrier(group=ctx.group)
    if ctx.rank == 0:
        start = time.perf_counter()
        _, _, event = buffer.combine(recv_x, handle, async_finish=True)
        returned_after = time.perf_counter() - start
        assert not event.query(), "the combine cannot have finished: rank 1 has not joined yet"
        time.sleep(0.3)
        dist.barrier(group=ctx.group)
        event.current_stream_wait()
        assert returned_after < 0.25, returned_after
    else:
        dist.barrier(group=ctx.group)  # join only after rank 0 has checked its event
        buffer.combine(recv_x, handle)


# ---------------------------------------------------------------------------------------------------------------
# Rounds, edge cases


def small_buffer_moves_in_rounds(ctx):
    """A region that holds a few rows forces many rounds; results equal the single-round ones."""
    small = buffer_for(ctx, num_nvl_bytes=4096)
    for seed in range(2):
        x, topk_idx, topk_weights, recv_x, _, recv_w, handle, ref = check_dispatch(
            ctx, small, 200, 96, 16, 4, seed=90 + seed
        )
        combined, combined_w, _ = small.combine(recv_x, handle, topk_weights=recv_w)
        assert_close_rounding(combined, x.double() * handle[4].sum(dim=1, keepdim=True))
        assert torch.allclose(combined_w, topk_weights.masked_fill(topk_idx < 0, 0.0), rtol=1e-6, atol=0)


def region_too_small_for_one_row_says_how_much(ctx):
    tiny = buffer_for(ctx, num_nvl_bytes=1024)
    x, topk_idx, topk_weights = make_inputs(ctx, 16, 7168, 8, 2, seed=95, masked=0.0)
    try:
        layout_and_dispatch(tiny, x, topk_idx, topk_weights, 8)
    except deep_ep.GroupMismatchError as error:
        assert "needs at least" in str(error) and "bytes" in str(error), error
    else:
        raise AssertionError("expected an error naming the bytes needed")


def edge_cases(ctx):
    buffer = buffer_for(ctx)
    E = 4 * ctx.world_size
    # a rank with zero tokens
    tokens = 0 if ctx.rank == ctx.world_size - 1 else 50
    _, _, _, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, tokens, 64, E, 2, seed=100)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert combined.shape == (tokens, 64)
    # every token to one expert (owned by the last rank)
    x = torch.randn(40, 64).bfloat16()
    topk_idx = torch.full((40, 1), E - 1)
    recv_x, recv_idx, _, counts, handle, _ = layout_and_dispatch(buffer, x, topk_idx, None, E)
    expected_rows = 40 * ctx.world_size if ctx.rank == ctx.world_size - 1 else 0
    assert recv_x.size(0) == expected_rows
    if expected_rows:
        assert counts == [0, 0, 0, expected_rows] and bool((recv_idx == 3).all())
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined, x)
    # tokens whose every slot is -1 go nowhere and combine to zero (or to the bias)
    topk_idx = torch.full((30, 4), -1)
    topk_idx[::2, 0] = 0
    x = torch.randn(30, 32).bfloat16()
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, torch.rand(30, 4), E)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined[::2], x[::2]) and bool((combined[1::2] == 0).all())
    # hidden sizes upstream rejects work (96, 7168 and an odd one)
    for hidden in (96, 7168, 7):
        x, topk_idx, topk_weights, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, 24, hidden, E, 3, seed=hidden)
        combined, _, _ = buffer.combine(recv_x, handle)
        assert_close_rounding(combined, x.double() * handle[4].sum(dim=1, keepdim=True))


def local_buffer_tensor_is_the_shared_region(ctx):
    buffer = buffer_for(ctx)
    whole = buffer.get_local_buffer_tensor(torch.uint8)
    assert whole.numel() == buffer.num_nvl_bytes
    view = buffer.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), offset=16)
    view.copy_(torch.arange(32.0).view(4, 8))
    assert torch.equal(buffer.get_local_buffer_tensor(torch.float32)[16:48], torch.arange(32.0))


# ---------------------------------------------------------------------------------------------------------------
# Autograd


class DispatchExpertsCombine(torch.nn.Module):
    """A toy expert-parallel layer: every rank scales its received rows and adds their local weight sum."""

    def __init__(self, buffer, num_experts, rank):
        super().__init__()
        self.buffer, self.num_experts = buffer, num_experts
        self.scale = 1.0 + 0.5 * rank

    def forward(self, x, topk_idx, topk_weights):
        recv_x, _, recv_w, _, handle = deep_ep.dispatch(self.buffer, x, topk_idx, topk_weights, self.num_experts)
        expert_out = recv_x * self.scale + recv_w.sum(dim=1, keepdim=True).to(recv_x.dtype)
        combined, combined_w = deep_ep.combine(self.buffer, expert_out, handle, topk_weights=recv_w)
        return combined, combined_w


def gradients_match_reference(ctx):
    buffer = buffer_for(ctx)
    E, T, H = 4 * ctx.world_size, 96, 32
    x, topk_idx, topk_weights = make_inputs(ctx, T, H, E, 3, seed=110, dtype=torch.float32)
    x.requires_grad_(True)
    topk_weights.requires_grad_(True)
    generator = torch.Generator().manual_seed(ctx.rank + 111)
    grad_out = torch.randn(T, H, generator=generator)
    grad_w = torch.randn(T, 3, generator=generator)
    combined, combined_w = DispatchExpertsCombine(buffer, E, ctx.rank)(x, topk_idx, topk_weights)
    (combined * grad_out).sum().add((combined_w * grad_w).sum()).backward()

    # Reference on this rank's tokens alone: out_t = sum over ranks r reached by t of
    # (x_t * scale_r + sum of t's weights whose expert r owns); combined weights = weights with -1 slots zeroed.
    x_ref = x.detach().double().requires_grad_(True)
    w_ref = topk_weights.detach().double().requires_grad_(True)
    out_ref = torch.zeros(T, H, dtype=torch.float64)
    owner = torch.where(topk_idx >= 0, topk_idx // (E // ctx.world_size), -1)
    for r in range(ctx.world_size):
        reached = (owner == r).any(dim=1, keepdim=True)
        local_w = (w_ref * (owner == r)).sum(dim=1, keepdim=True)
        out_ref = out_ref + reached * (x_ref * (1.0 + 0.5 * r) + local_w)
    w_out_ref = w_ref * (topk_idx >= 0)
    (out_ref * grad_out.double()).sum().add((w_out_ref * grad_w.double()).sum()).backward()
    assert torch.allclose(combined.double(), out_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad.double(), x_ref.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(topk_weights.grad.double(), w_ref.grad, rtol=1e-5, atol=1e-5)


def combine_bias_gradients(ctx):
    buffer = buffer_for(ctx)
    x, topk_idx, topk_weights = make_inputs(ctx, 40, 16, 2 * ctx.world_size, 2, seed=120, dtype=torch.float32)
    recv_x, _, _, _, handle = deep_ep.dispatch(buffer, x, topk_idx, topk_weights, 2 * ctx.world_size)
    bias = torch.randn(40, 16, requires_grad=True)
    expert_out = recv_x.detach().requires_grad_(True)
    combined, _ = deep_ep.combine(buffer, expert_out, handle, bias=bias)
    grad = torch.randn(40, 16)
    (combined * grad).sum().backward()
    assert torch.equal(bias.grad, grad)
    # d combined / d expert row = the gradient of the token it came from
    everyone = gather(ctx, (grad, topk_idx))
    ref = refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], None, 2 * ctx.world_size, ctx.rank)
    assert torch.equal(expert_out.grad, ref.recv_x)


# ---------------------------------------------------------------------------------------------------------------
# Errors and timeouts


def bad_inputs_raise_value_error_before_communicating(ctx):
    """Each rank hits every error locally; no communication happens, so the buffer stays usable."""
    buffer = buffer_for(ctx)
    E = 4 * ctx.world_size
    x, topk_idx, topk_weights = make_inputs(ctx, 32, 128, E, 2, seed=130)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    *_, real_handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, E)
    copied_handle = tuple(t.clone() for t in real_handle)  # same values, but not a handle a dispatch issued
    bad_fp8 = (torch.zeros(32, 96, dtype=torch.float8_e4m3fn), torch.ones(32, 1))
    cases = {
        "expert id >= num_experts": lambda: buffer.get_dispatch_layout(topk_idx.clamp(min=0) + E, E),
        "expert id < -1": lambda: buffer.get_dispatch_layout(topk_idx - 5, E),
        "experts not divisible by ranks": lambda: buffer.get_dispatch_layout(topk_idx, E + 1),
        "topk_idx dtype": lambda: buffer.get_dispatch_layout(topk_idx.int(), E),
        "topk_idx device": lambda: buffer.get_dispatch_layout(topk_idx.to("meta"), E),
        "x dtype": lambda: buffer.dispatch(x.long(), topk_idx=topk_idx, **layout),
        "x shape": lambda: buffer.dispatch(x[0], topk_idx=topk_idx, **layout),
        "x device": lambda: buffer.dispatch(x.to("meta"), topk_idx=topk_idx, **layout),
        "topk_weights shape": lambda: buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights[:, :1], **layout
        ),  # fmt: skip
        "topk_weights dtype": lambda: buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights.double(), **layout
        ),  # fmt: skip
        "topk_idx rows": lambda: buffer.dispatch(x[:16], topk_idx=topk_idx, **layout),
        "fp8 hidden not a multiple of 128": lambda: buffer.dispatch(bad_fp8, topk_idx=topk_idx, **layout),
        "fp8 scales shape": lambda: buffer.dispatch((x.to(torch.float8_e4m3fn), torch.ones(32, 3)), **layout),
        "counts inconsistent": lambda: buffer.dispatch(
            x, num_tokens_per_rank=per_rank + 1, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
        ),  # fmt: skip
        "missing layout": lambda: buffer.dispatch(x, topk_idx=topk_idx),
        "hand-made handle (dispatch)": lambda: buffer.dispatch(x, handle=copied_handle),
        "hand-made handle (combine)": lambda: buffer.combine(x, copied_handle),
        "not a handle": lambda: buffer.combine(x, (1, 2, 3)),
        "expert_alignment": lambda: buffer.dispatch(x, topk_idx=topk_idx, expert_alignment=0, **layout),
    }
    for name, call in cases.items():
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"{name}: no ValueError")
    check_dispatch(ctx, buffer, 32, 128, E, 2, seed=131)  # still in step with the peers


def bad_input_on_one_rank_times_out_the_others(ctx, timeout_s):
    buffer = deep_ep.Buffer(ctx.group, 1 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    try:
        x, topk_idx, topk_weights = make_inputs(ctx, 32, 64, 8, 2, seed=140)
        bad = topk_idx.clone()
        if ctx.rank == 1:
            bad[3, 0] = 99
        start = time.perf_counter()
        try:
            layout_and_dispatch(buffer, x, bad, topk_weights, 8)
        except ValueError as error:
            assert ctx.rank == 1 and "[-1, 8)" in str(error), error
            time.sleep(timeout_s + 1.0)  # stay alive: the peers must time out, not see this rank leave
            return "value-error"
        except deep_ep.CommTimeoutError as error:
            elapsed = time.perf_counter() - start
            assert ctx.rank != 1
            assert "rank(s) [1] did not arrive" in str(error) and "dispatch" in str(error), error
            assert timeout_s <= elapsed < timeout_s + 5, elapsed
            return "timeout"
        raise AssertionError("the dispatch succeeded without rank 1")
    finally:
        buffer.destroy()


def missing_rank_in_combine_times_out(ctx, timeout_s):
    buffer = deep_ep.Buffer(ctx.group, 1 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    try:
        x, topk_idx, topk_weights = make_inputs(ctx, 32, 64, 8, 2, seed=150)
        recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 8)
        if ctx.rank == 0:
            time.sleep(timeout_s + 1.0)  # never joins the combine, but stays alive while the peers wait
            return "skipped"
        try:
            buffer.combine(recv_x, handle)
        except deep_ep.CommTimeoutError as error:
            assert "rank(s) [0] did not arrive" in str(error) and "combine" in str(error), error
            return "timeout"
        raise AssertionError("combine succeeded without rank 0")
    finally:
        buffer.destroy()


def single_rank_group(ctx):
    """A group of one (world slice of this rank) works and moves nothing across processes."""
    group = ctx.cache.setdefault("self-group", [dist.new_group([r]) for r in range(ctx.world_size)])[ctx.rank]
    buffer = deep_ep.Buffer(group, 1 << 20, explicitly_destroy=True)
    try:
        x, topk_idx, topk_weights = make_inputs(ctx, 50, 32, 4, 2, seed=160)
        recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 4)
        sent = (topk_idx >= 0).any(dim=1)
        assert torch.equal(recv_x, x[sent]) and torch.equal(recv_idx, topk_idx[sent])
        combined, _, _ = buffer.combine(recv_x, handle)
        assert torch.equal(combined[sent], x[sent])
    finally:
        buffer.destroy()


def buffer_released_by_python_or_autograd(ctx):
    """A Buffer dropped without destroy() right after async work, or whose last reference is an autograd graph
    (so it dies on its own comm thread), must neither hang nor abort the process."""
    import gc

    for _ in range(2):
        buffer = deep_ep.Buffer(ctx.group, 1 << 22)
        x = torch.randn(64, 32, requires_grad=True)
        topk_idx = torch.randint(0, 2 * ctx.world_size, (64, 2))
        recv_x, _, _, _, handle = deep_ep.dispatch(buffer, x, topk_idx, torch.rand(64, 2), 2 * ctx.world_size)
        out, _ = deep_ep.combine(buffer, recv_x * 2, handle)
        del buffer, recv_x, handle  # the graph now holds the only reference
        out.sum().backward()
        ranks_reached = (topk_idx // 2).sort(dim=1).values.diff(dim=1).ne(0).sum(dim=1, keepdim=True) + 1
        assert torch.equal(x.grad, (2.0 * ranks_reached).expand_as(x))  # d(sum over ranks of 2x)/dx
        del out
        gc.collect()
        buffer = deep_ep.Buffer(ctx.group, 1 << 22)
        *_, event = buffer.get_dispatch_layout(topk_idx, 2 * ctx.world_size, async_finish=True)
        del buffer, event
        gc.collect()


def async_finish_overlaps_the_transfer(ctx):
    """Work between an `async_finish=True` dispatch/combine and its wait overlaps the transfer (see
    `assert_async_overlaps`)."""
    buffer = buffer_for(ctx, num_nvl_bytes=256 << 20)
    x, topk_idx, _ = make_inputs(ctx, 2048, 2048, 8 * ctx.world_size, 4, seed=170)
    layout = buffer.get_dispatch_layout(topk_idx, 8 * ctx.world_size)
    return assert_async_overlaps(ctx, buffer, x, dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                      num_tokens_per_expert=layout[2]))  # fmt: skip


def assert_async_overlaps(ctx, buffer, x, dispatch_kwargs) -> tuple[float, float, float]:
    """Asserts that work between an `async_finish=True` dispatch/combine and its wait overlaps the transfer.

    The rows move on the buffer's comm thread; the caller's work is `time.sleep`, a stand-in for accelerator work
    that frees the core (a CPU-bound computation cannot overlap a CPU copy on a 2-core machine: both need the same
    cores). With work time S ~ t = t(dispatch + combine), serial execution takes t + S; overlapped, it must save at
    least half of the ideal min(t, S). Medians of interleaved repetitions, up to three attempts agreed by all ranks.
    Returns `(t, S, overlapped time)` in seconds.
    """
    import statistics

    def run(work_s: float) -> float:
        dist.barrier(group=ctx.group)
        start = time.perf_counter()
        recv_x, _, _, _, handle, event = buffer.dispatch(x, async_finish=True, **dispatch_kwargs)
        if work_s:
            time.sleep(work_s / 2)
        event.current_stream_wait()
        combined, _, event = buffer.combine(recv_x, handle, async_finish=True)
        if work_s:
            time.sleep(work_s / 2)
        event.current_stream_wait()
        return time.perf_counter() - start

    for _ in range(3):
        work_s = statistics.median(run(0.0) for _ in range(3))
        serial, overlapped = [], []
        for _ in range(5):
            serial.append(run(0.0))
            overlapped.append(run(work_s))
        t_comm, t_overlapped = statistics.median(serial), statistics.median(overlapped)
        saved = t_comm + work_s - t_overlapped
        ok = torch.tensor([int(saved >= 0.5 * min(t_comm, work_s))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctx.group)
        if ok.item():
            break
    assert saved >= 0.5 * min(t_comm, work_s), (
        f"no overlap: {t_overlapped * 1e3:.1f} ms with work vs {t_comm * 1e3:.1f} ms + {work_s * 1e3:.1f} ms"
    )
    return t_comm, work_s, t_overlapped
