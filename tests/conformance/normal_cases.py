"""Normal-mode (layout, dispatch, combine, autograd, errors) cases, written once for every topology.

Each case runs in the rank processes of a `RankPool` (see test_normal.py) as `case(ctx, topo)`, builds random
inputs on every rank, gathers them and compares the buffer's results with `mtdeepep.utils.refs` (tolerances in
common.py). The cases that tests/cuda runs on a GPU as well (layout, dispatch and combine, FP8, alignment,
num_worst_tokens, FP32 accumulation, bias, events, timeouts) keep their tensors on the topology's placement
(placement.py): inputs made on the host and moved there, results copied back to be compared; their parameters
(routing, dtypes, `size`) give the GPU tests upstream's sizes and a skewed routing.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import time

import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from mtdeepep.utils import fp8, refs

from ..cuda.gpu import named_ranks
from .common import (
    all_reduce_sum,
    assert_async_overlaps,
    assert_combine_close,
    assert_value_errors,
    barrier,
    check_dispatch,
    first_error,
    gather,
    identity_partials,
    layout_and_dispatch,
    layout_kwargs,
    make_inputs,
    node_partials_f64,
    reference_dispatch,
    tokens_in_rank,
)
from .topology import Topology

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Sizes of the shared cases, (tokens, more tokens per rank, hidden, experts, top-k, seed): 'small' for the CPU
# topologies; 'upstream' for a GPU: upstream's hidden 7168 (fp32: 4096) and a hidden whose rows are no multiple of
# 16 bytes (the copies' tail).
COMBINE_SIZES = {
    "small": {name: [(300, 0, 160, 16, 4, 60 + i)] for i, name in enumerate(DTYPES)},
    "upstream": {
        "bfloat16": [(1024, 37, 7168, 64, 6, 20), (1024, 37, 777, 64, 6, 21)],
        "float32": [(1024, 37, 4096, 64, 6, 20), (1024, 37, 1001, 64, 6, 21)],
    },
}
FP8_SIZES = {"small": (200, 0, 256, 16, 4, 30), "upstream": (512, 11, 7168, 64, 8, 40)}

# ---------------------------------------------------------------------------------------------------------------
# Layout and dispatch


def layout_matches_reference(ctx, topo: Topology, routing: str = "uniform"):
    """`get_dispatch_layout` against `refs.ref_dispatch_layout`, synchronous and async (after a previous event,
    allocated on the comm stream): odd and empty shapes, upstream's setting (4096 tokens, top-8 of 256 experts) and
    a count that differs per rank."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    assert buffer.get_num_rdma_ranks() == topo.num_nodes and buffer.get_rdma_rank() == ctx.rank // topo.node_size
    assert buffer.get_root_rdma_rank(True) == ctx.rank // topo.node_size * topo.node_size
    assert buffer.get_root_rdma_rank(False) == 0
    # (tokens, experts, top-k, seed, masked)
    shapes = [(256, 16, 4, 0, 0.2), (1000, 64, 8, 1, 0.2), (1, 8, 8, 2, 0.2), (333, 8, 1, 3, 0.2), (0, 8, 2, 4, 0.2),
              (4096, 256, 8, 10, 0.1), (37 + ctx.rank, 16, 3, 11, 0.1)]  # fmt: skip
    for tokens, experts, topk, seed, masked in shapes:
        _, topk_idx, _ = make_inputs(ctx, tokens, 8, experts, topk, seed, masked=masked, routing=routing)
        ref_rank, ref_expert, ref_in_rank = refs.ref_dispatch_layout(topk_idx, experts, ctx.world_size)
        for async_finish in (False, True):
            previous = deep_ep.Buffer.capture() if async_finish else None
            per_rank, per_node, per_expert, in_rank, event = buffer.get_dispatch_layout(
                placement.to(topk_idx), experts, previous_event=previous, async_finish=async_finish,
                allocate_on_comm_stream=async_finish,
            )  # fmt: skip
            if async_finish:
                event.current_stream_wait()
            else:
                assert event.query()
            placement.assert_on_device(per_rank, per_node, per_expert, in_rank)
            assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
            per_rank, per_node, per_expert, in_rank = placement.host((per_rank, per_node, per_expert, in_rank))
            what = f"({tokens} tokens, async={async_finish})"
            assert torch.equal(per_rank, ref_rank), f"num_tokens_per_rank differs {what}"
            assert torch.equal(per_expert, ref_expert), f"num_tokens_per_expert differs {what}"
            assert torch.equal(in_rank, ref_in_rank), f"is_token_in_rank differs {what}"
            if not topo.internode:
                assert per_node is None  # upstream: no per-node counts within one node
                continue
            # A token counts once per node that one of its ranks is on, however many.
            expected = ref_in_rank.view(tokens, topo.num_nodes, topo.node_size).any(dim=2).sum(dim=0)
            assert per_node.dtype == torch.int32 and per_node.tolist() == expected.tolist(), (per_node, expected)


def dispatch_matches_reference(ctx, topo):
    buffer = topo.buffer(ctx)
    for seed, (tokens, hidden, experts, topk) in enumerate([(128, 256, 16, 4), (300, 96, 32, 8), (64, 7168, 8, 2),
                                                            (200, 130, 24, 3)]):  # fmt: skip
        experts = experts if experts % ctx.world_size == 0 else experts * ctx.world_size
        check_dispatch(ctx, topo, buffer, tokens, hidden, experts, topk, seed)
    # float32 and float16 payloads move the same way
    check_dispatch(ctx, topo, buffer, 100, 64, 8, 2, 7, dtype=torch.float32)
    check_dispatch(ctx, topo, buffer, 100, 64, 8, 2, 8, dtype=torch.float16)


def dispatch_without_topk(ctx, topo):
    """Layout only (upstream's `with_topk=False`): rows and per-expert counts still arrive, top-k outputs are None."""
    buffer = topo.buffer(ctx)
    x, topk_idx, _ = make_inputs(ctx, 150, 64, 16, 4, seed=9)
    recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(buffer, x, topk_idx, None, 16, with_topk=False)
    everyone = gather(ctx, (x, topk_idx))
    ref = refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], None, 16, ctx.rank)
    assert recv_idx is None and recv_w is None
    assert torch.equal(recv_x, ref.recv_x) and counts == ref.num_recv_tokens_per_expert
    global_counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=16).int()
    dist.all_reduce(global_counts, group=ctx.group)
    assert counts == global_counts.view(ctx.world_size, -1)[ctx.rank].tolist()
    combined, weights, _ = buffer.combine(recv_x, handle)
    assert weights is None
    assert_combine_close(combined, identity_partials(topo, x, tokens_in_rank(ctx, topk_idx, 16)), torch.bfloat16)


def dispatch_segments_constant_per_source(ctx, topo):
    """Upstream's check: rows filled with the source rank id; each source's segment of recv_x is that id."""
    buffer = topo.buffer(ctx)
    _, topk_idx, topk_weights = make_inputs(ctx, 512, 128, 32, 8, seed=11)
    x = torch.full((512, 128), float(ctx.rank), dtype=torch.bfloat16)
    recv_x, _, _, _, _, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 32)
    everyone = gather(ctx, topk_idx)
    prefix = refs.ref_dispatch(gather(ctx, x), everyone, None, 32, ctx.rank).rank_prefix_matrix[:, ctx.rank].tolist()
    for source in range(ctx.world_size):
        segment = recv_x[prefix[source - 1] if source else 0 : prefix[source]]
        assert segment.numel() and bool((segment == source).all()), f"segment of source {source} is not constant"


def expert_alignment_rounds_counts(ctx, topo):
    """Per-expert counts rounded up to `expert_alignment` (and the rows as the reference aligns them)."""
    buffer = topo.buffer(ctx)
    for alignment, (tokens, hidden, experts, topk, seed) in ((4, (150, 32, 16, 4, 24)), (128, (150, 32, 16, 4, 148)),
                                                             (64, (300, 256, 32, 4, 30))):  # fmt: skip
        d = check_dispatch(ctx, topo, buffer, tokens, hidden, experts, topk, seed=seed, expert_alignment=alignment)
        assert all(c % alignment == 0 for c in d.counts), d.counts


def fp8_dispatch_passes_through(ctx, topo, routing: str = "uniform", size: str = "small"):
    """FP8 rows `(float8_e4m3fn [T, H], float32 scales [T, H / 128])`, scales row- and column-major (upstream passes
    column-major): bytes and scales exactly the reference's, received scales row-major, dequantised rows within FP8's
    precision; a cached FP8 dispatch. `size`: 'small', or 'upstream' (hidden 7168, top-8 of 64 experts)."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    tokens, step, hidden, experts, topk, seed = FP8_SIZES[size]
    x, topk_idx, topk_weights = make_inputs(ctx, tokens + step * ctx.rank, hidden, experts, topk, seed=seed,
                                            routing=routing)  # fmt: skip
    e4m3, scales = fp8.per_token_cast_to_fp8(x.float())
    everyone = gather(ctx, (e4m3.view(torch.uint8), scales, topk_idx, x))
    ref_data = refs.ref_dispatch([e[0] for e in everyone], [e[2] for e in everyone], None, experts, ctx.rank).recv_x
    ref_scales = refs.ref_dispatch([e[1] for e in everyone], [e[2] for e in everyone], None, experts, ctx.rank).recv_x
    ref_x = refs.ref_dispatch([e[3] for e in everyone], [e[2] for e in everyone], None, experts, ctx.rank).recv_x
    ref_x = ref_x.float()
    for layout in ("row", "column"):
        s = scales if layout == "row" else scales.T.contiguous().T  # upstream passes column-major scales
        pair = placement.to(e4m3, s)
        (recv_data, recv_scales), recv_idx, recv_w, _, handle, _ = layout_and_dispatch(
            buffer, pair, *placement.to(topk_idx, topk_weights), experts
        )
        placement.assert_on_device(recv_data, recv_scales, recv_idx, recv_w)
        assert recv_data.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
        assert recv_scales.is_contiguous(), "received scales are row-major"
        recv_data, recv_scales = placement.host((recv_data, recv_scales))
        assert torch.equal(recv_data.view(torch.uint8), ref_data), f"fp8 data ({layout}-major scales)"
        assert torch.equal(recv_scales, ref_scales), f"scales ({layout}-major)"
        # Dequantised rows still represent the sender's bf16 rows within FP8's precision: E4M3 keeps 3 mantissa
        # bits (half-ulp 2^-4 relative); values below 2^-6 are subnormal with spacing 2^-9, in units of the scale.
        deq = fp8.per_token_cast_back(recv_data, recv_scales)
        bound = 2.0**-4 * ref_x.abs() + 2.0**-10 * recv_scales.repeat_interleave(128, dim=1)
        assert bool(((deq - ref_x).abs() <= bound * 1.001).all())
        # a cached FP8 dispatch reuses the layout
        cached_data, cached_scales = placement.host(buffer.dispatch(pair, handle=handle)[0])
        assert torch.equal(cached_data.view(torch.uint8), ref_data), "cached fp8 data"
        assert torch.equal(cached_scales, ref_scales), "cached scales"


def cached_dispatch_matches(ctx, topo):
    buffer = topo.buffer(ctx)
    d = check_dispatch(ctx, topo, buffer, 256, 64, 16, 4, seed=40)
    again, recv_idx, recv_w, counts, same_handle, event = buffer.dispatch(d.x, handle=d.handle)
    assert torch.equal(again, d.recv_x) and event.query()
    assert recv_idx is None and recv_w is None and counts is None and same_handle is d.handle
    y = torch.randn(256, 48)  # a different payload with the same routing (e.g. a gradient)
    recv_y, *_ = buffer.dispatch(y, handle=d.handle)
    everyone = gather(ctx, (y, d.topk_idx))
    ref = refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], None, 16, ctx.rank)
    assert torch.equal(recv_y, ref.recv_x)


def num_worst_tokens_pads_outputs(ctx, topo):
    """`num_worst_tokens`: outputs sized for the worst case (no host sync for the count); the valid rows first,
    then ids -1 and weights 0; the count list empty; combine through that handle uses only the valid rows."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    for tokens, hidden, experts in ((100, 64, 16), (256, 512, 32)):
        x, topk_idx, topk_weights = make_inputs(ctx, tokens, hidden, experts, 4, seed=50)
        worst = tokens * ctx.world_size
        recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(
            buffer, *placement.to(x, topk_idx, topk_weights), experts, num_worst_tokens=worst
        )
        ref = reference_dispatch(ctx, x, topk_idx, topk_weights, experts)
        n = ref.recv_x.size(0)
        got_x, got_idx, got_w = placement.host((recv_x, recv_idx, recv_w))
        assert got_x.size(0) == got_idx.size(0) == got_w.size(0) == worst and counts == []
        assert torch.equal(got_x[:n], ref.recv_x) and torch.equal(got_idx[:n], ref.recv_topk_idx)
        assert torch.equal(got_w[:n], ref.recv_topk_weights)
        assert bool((got_idx[n:] == -1).all()) and bool((got_w[n:] == 0).all()), "padding rows"
        out, _, _ = buffer.combine(recv_x, handle)  # combine through a worst-case handle uses only the valid rows
        partials = identity_partials(topo, x, tokens_in_rank(ctx, topk_idx, experts))
        assert_combine_close(placement.host(out), partials, torch.bfloat16)


def num_worst_tokens_too_small_raises_on_every_rank(ctx, topo):
    """Too small a bound, for every rank or for some only: every rank raises GroupMismatchError (naming the bound)
    before any token bytes move (see `first_error` for where), and the buffer stays usable, also for a cached
    dispatch of a handle from before the errors and of one from after them. Twice: an error leaves no trace."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    x, topk_idx, topk_weights = make_inputs(ctx, 100, 16, 8, 4, seed=51, masked=0.0)
    x, topk_idx, topk_weights = placement.to(x, topk_idx, topk_weights)
    num_recv = all_reduce_sum(ctx, placement.host(buffer.get_dispatch_layout(topk_idx, 8)[0]))
    assert bool((num_recv > 10).all())
    *_, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 8)
    x2, topk_idx2, topk_weights2 = placement.to(*make_inputs(ctx, 100, 16, 8, 2, seed=52, masked=0.0))
    num_recv2 = all_reduce_sum(ctx, placement.host(buffer.get_dispatch_layout(topk_idx2, 8)[0]))
    median = int(num_recv2.median())
    over = [r for r in range(ctx.world_size) if num_recv2[r] > median]
    assert over and len(over) < ctx.world_size, num_recv2

    def refused(name: str, bound: int, call) -> None:
        error = first_error(topo, deep_ep.GroupMismatchError, call, placement.synchronize,
                            lambda: buffer.get_dispatch_layout(topk_idx, 8))  # fmt: skip
        assert error is not None, f"{name}: expected GroupMismatchError"
        if name != "cached":
            assert f"num_worst_tokens={bound}" in str(error), (name, error)
        barrier(ctx)

    for _ in range(2):
        refused("every rank over", 10, lambda: layout_and_dispatch(buffer, x, topk_idx, topk_weights, 8,
                                                                   num_worst_tokens=10))  # fmt: skip
        refused("some ranks over", median, lambda: layout_and_dispatch(buffer, x2, topk_idx2, topk_weights2, 8,
                                                                      num_worst_tokens=median))  # fmt: skip
        refused("cached", 10, lambda: buffer.dispatch(x, handle=handle, num_worst_tokens=10))
    d = check_dispatch(ctx, topo, buffer, 64, 16, 8, 2, seed=53)
    refused("cached", 10, lambda: buffer.dispatch(d.inputs[0], handle=d.handle, num_worst_tokens=10))
    check_dispatch(ctx, topo, buffer, 64, 16, 8, 2, seed=54)


# ---------------------------------------------------------------------------------------------------------------
# Combine


def combine_matches_reference(ctx, topo, dtype_names=("bfloat16", "float16", "float32"), routing: str = "uniform",
                              size: str = "small"):  # fmt: skip
    """Dispatch, then combine of per-rank "expert" outputs with the received weights: within the bound of common.py;
    the combined weights rebuild the original ones; results own their memory; a cached dispatch gives the same rows.
    `size`: 'small', or 'upstream' (hidden 7168 for bf16 / 4096 for fp32, and one whose rows are no multiple of 16
    bytes, ~1000 tokens a rank, top-6 of 64 experts)."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        for tokens, step, hidden, experts, topk, seed in COMBINE_SIZES[size][dtype_name]:
            num_tokens = tokens + step * ctx.rank
            d = check_dispatch(ctx, topo, buffer, num_tokens, hidden, experts, topk, seed=seed, dtype=dtype,
                               routing=routing)  # fmt: skip
            expert_out = (d.recv_x.float() * (1.5 + ctx.rank) + 0.25).to(dtype)  # a different "expert" per rank
            combined, combined_w, event = buffer.combine(expert_out, d.handle, topk_weights=d.recv_w)
            assert combined_w.dtype == torch.float32 and event.query()
            placement.assert_on_device(combined, combined_w)
            assert combined.shape == (num_tokens, hidden)
            expert_out_h, combined_h, combined_w_h = placement.host((expert_out, combined, combined_w))
            partials = node_partials_f64(ctx, topo, expert_out_h, d.ref.recv_src_rank, d.ref.recv_src_idx, num_tokens)
            assert_combine_close(combined_h, partials, dtype)
            everyone = gather(ctx, (d.ref.recv_src_rank, d.ref.recv_src_idx, placement.host(d.recv_w)))
            _, expected_w = refs.ref_combine(
                gather(ctx, expert_out_h), [e[0] for e in everyone], [e[1] for e in everyone], ctx.rank, num_tokens,
                [e[2] for e in everyone],
            )  # fmt: skip
            assert torch.allclose(combined_w_h, expected_w, rtol=1e-6, atol=0)
            # the combined weights rebuild the original ones (masked slots are 0 everywhere)
            expected_w = d.topk_weights.masked_fill(d.topk_idx < 0, 0.0)
            assert torch.allclose(combined_w_h, expected_w, rtol=1e-6, atol=0), "combined weights"
            # Results own their memory: the next calls (reusing the buffer's scratch) leave them unchanged.
            kept = (combined_h.clone(), placement.host(d.recv_x).clone())
            buffer.combine(torch.zeros_like(expert_out), d.handle)
            buffer.dispatch(torch.zeros_like(d.inputs[0]), handle=d.handle)
            assert torch.equal(placement.host(combined), kept[0]) and torch.equal(placement.host(d.recv_x), kept[1])
            # Cached mode: the handle's layout again, same rows.
            cached, *_ = buffer.dispatch(d.inputs[0], handle=d.handle)
            assert torch.equal(placement.host(cached), d.ref.recv_x), "cached dispatch differs"


def combine_accumulates_in_fp32(ctx, topo):
    """Every token reaches every rank; rank 0 returns 1, the others 2^-8. Summed row by row in bf16 that stays 1;
    summed in FP32 per node, rounded, then summed in FP32 across nodes (and rounded), it does not."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    num_experts = ctx.world_size * 2
    for tokens, hidden in ((8, 16), (64, 256)):
        topk_idx = torch.arange(0, num_experts, 2).repeat(tokens, 1)  # every token goes to every rank
        x = torch.ones(tokens, hidden, dtype=torch.bfloat16)
        recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, *placement.to(x, topk_idx), None, num_experts)
        value = 1.0 if ctx.rank == 0 else 2.0**-8
        combined = placement.host(buffer.combine(torch.full_like(recv_x, value), handle)[0])
        node_sums = [
            torch.tensor([1.0 if r == 0 else 2.0**-8 for r in range(n * topo.node_size, (n + 1) * topo.node_size)])
            .sum()
            .to(torch.bfloat16 if topo.internode else torch.float32)  # one node: no rounding before the last one
            for n in range(topo.num_nodes)
        ]
        expected = torch.stack(node_sums).float().sum().bfloat16()
        assert bool((combined == expected).all()), (combined[0, 0].item(), expected.item())
        # 2 ranks on one node: 1 + 2^-8 rounds to 1 in bf16 as well, so only larger groups tell FP32 from bf16.
        assert ctx.world_size == 2 or expected.item() > 1.0


def combine_adds_bias(ctx, topo):
    """`bias=b0` or `bias=(b0, b1)` (either may be None) is added to the FP32 sum before its one rounding."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    for tokens, hidden, experts, topk, seed in ((128, 64, 8, 2, 70), (200, 384, 16, 3, 60)):
        d = check_dispatch(ctx, topo, buffer, tokens, hidden, experts, topk, seed=seed)
        generator = torch.Generator().manual_seed(ctx.rank + seed + 1)
        b0 = torch.randn(tokens, hidden, generator=generator).bfloat16()
        b1 = torch.randn(tokens, hidden, generator=generator).bfloat16()
        b0_d, b1_d = placement.to(b0, b1)
        partials = identity_partials(topo, d.x, d.in_rank)
        for bias, extra in [(b0_d, b0.double()), ((b0_d, b1_d), b0.double() + b1.double()),
                            ((b0_d, None), b0.double()), ((None, b1_d), b1.double())]:  # fmt: skip
            combined, _, _ = buffer.combine(d.recv_x, d.handle, bias=bias)
            assert_combine_close(placement.host(combined), partials, torch.bfloat16, extra)


def async_and_previous_event(ctx, topo):
    """async_finish returns events that complete; the comm stream waits for `previous_event`: x is written on the
    current stream behind a ~50 ms sleep kernel (on a GPU) and the async dispatch must still read the new x (without
    the wait it reads the old random x); the returned events make the current stream wait; results as without
    them. allocate_on_comm_stream without its prerequisites is refused."""
    placement = topo.placement
    buffer = topo.buffer(ctx)
    for tokens, hidden, experts, seed in ((256, 128, 16, 80), (512, 1024, 32, 70)):
        x, topk_idx, topk_weights = make_inputs(ctx, tokens, hidden, experts, 4, seed=seed)
        stale = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1 + ctx.rank)).bfloat16()
        ref = reference_dispatch(ctx, x, topk_idx, topk_weights, experts)
        x_d, idx_d, w_d = placement.to(stale, topk_idx, topk_weights)
        x_new = placement.to(x)
        barrier(ctx)
        placement.busy_stream(100_000_000)  # ~50 ms of GPU clock cycles on the current stream
        x_d.copy_(x_new)
        previous = deep_ep.Buffer.capture()
        if not placement.on_gpu:
            assert previous.query()  # the CPU executor's "stream" has no work queued: complete at once
        per_rank, per_node, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(
            idx_d, experts, previous_event=previous, async_finish=True, allocate_on_comm_stream=True
        )
        recv_x, recv_idx, _, _, handle, dispatch_event = buffer.dispatch(
            x_d, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx_d, topk_weights=w_d, previous_event=layout_event,
            async_finish=True, allocate_on_comm_stream=True,
        )  # fmt: skip
        combined, _, combine_event = buffer.combine(
            recv_x, handle, previous_event=dispatch_event, async_finish=True, allocate_on_comm_stream=True
        )
        with combine_event:  # leaving the block waits, as EventOverlap's context manager does upstream
            pass
        dispatch_event.current_stream_wait()
        got_x, got_idx, got_combined, got_in_rank = placement.host((recv_x, recv_idx, combined, in_rank))
        assert torch.equal(got_x, ref.recv_x), "the async dispatch did not wait for previous_event (stale rows)"
        assert torch.equal(got_idx, ref.recv_topk_idx)
        ref_in_rank = tokens_in_rank(ctx, topk_idx, experts)
        assert torch.equal(got_in_rank, ref_in_rank), "is_token_in_rank of the async layout"
        assert_combine_close(got_combined, identity_partials(topo, x, ref_in_rank), torch.bfloat16)
        placement.synchronize()
        assert layout_event.query() and dispatch_event.query() and combine_event.query()
    # allocate_on_comm_stream without its prerequisites is refused, as upstream asserts
    try:
        buffer.get_dispatch_layout(idx_d, experts, allocate_on_comm_stream=True)
    except ValueError:
        pass
    else:
        raise AssertionError("allocate_on_comm_stream without previous_event and async_finish was accepted")


def async_runs_off_the_callers_thread(ctx, topo):
    """The caller gets control back while the comm thread still waits for a late peer."""
    buffer = topo.buffer(ctx)
    d = check_dispatch(ctx, topo, buffer, 64, 32, 8, 2, seed=85)
    dist.barrier(group=ctx.group)
    if ctx.rank == 0:
        start = time.perf_counter()
        combined, _, event = buffer.combine(d.recv_x, d.handle, async_finish=True)
        returned_after = time.perf_counter() - start
        assert not event.query(), "the combine cannot have finished: the other ranks have not joined yet"
        time.sleep(0.3)
        dist.barrier(group=ctx.group)
        event.current_stream_wait()
        assert returned_after < 0.25, returned_after
        assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)
    else:
        dist.barrier(group=ctx.group)  # join only after rank 0 has checked its event
        buffer.combine(d.recv_x, d.handle)


def async_finish_overlaps_the_transfer(ctx, topo):
    """Work between an `async_finish=True` dispatch/combine and its wait overlaps the transfer (see
    `assert_async_overlaps`; internode the caller waits only for the count and metadata exchanges)."""
    buffer = topo.buffer(ctx, num_nvl_bytes=256 << 20)
    x, topk_idx, _ = make_inputs(ctx, 2048, 2048, 32, 4, seed=170)
    return assert_async_overlaps(ctx, buffer, x, layout_kwargs(buffer, topk_idx, 32))


# ---------------------------------------------------------------------------------------------------------------
# Rounds, edge cases


class _ReceivedView(torch.autograd.Function):
    """What a MoE layer does with an async dispatch's outputs before they are complete (moe/layer/dispatcher/flex.py's
    phase mark, moe/layer/phase_timer.py `_BackwardMark`): forward returns views of them, made inside a custom
    Function."""

    @staticmethod
    def forward(ctx, x, recv_x):
        return recv_x.view_as(recv_x)

    @staticmethod
    def backward(ctx, grad):
        return grad.sum(dim=0, keepdim=True).expand(1, grad.size(1)).clone(), None


def async_outputs_are_not_modified_in_place_after_return(ctx, topo):
    """The outputs an async dispatch or combine hands out are written later by the transfer, as a comm stream would
    write them: autograd never sees an in-place change of them (their version counter stays), so a view of them made
    in a custom Function right away is still usable after the wait (the trainer's use, which failed with "Output 0 of
    _DispatchGrad is a view and its base ... has been modified inplace", of the dispatcher's own autograd Function
    then). Outputs out of the default region."""
    _check_async_outputs_unversioned(ctx, topo, topo.buffer(ctx))


def async_outputs_staged_in_rounds_are_not_modified_in_place(ctx, topo):
    """As above, with outputs allocated apart from a region too small to hold them (4 KiB: moved in rounds)."""
    _check_async_outputs_unversioned(ctx, topo, topo.buffer(ctx, num_nvl_bytes=4096))


def _check_async_outputs_unversioned(ctx, topo, buffer) -> None:
    x, topk_idx, topk_weights = make_inputs(ctx, 384, 256, 16, 4, seed=97)
    ref = reference_dispatch(ctx, x, topk_idx, topk_weights, 16)
    source = torch.zeros(1, x.size(1), requires_grad=True)
    recv_x, _, recv_w, _, handle, event = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 16,
                                                              async_finish=True)  # fmt: skip
    viewed = _ReceivedView.apply(source, recv_x)  # before the rows arrived (or not: either way the same)
    event.current_stream_wait()
    # Fresh outputs: any in-place write, before or after the return, would have counted.
    assert (recv_x._version, recv_w._version) == (0, 0), "an async dispatch output was modified in place"
    assert torch.equal(recv_x, ref.recv_x)
    viewed.index_select(0, torch.arange(recv_x.size(0) - 1, -1, -1)).float().sum().backward()
    assert source.grad is not None
    combined, combined_w, event = buffer.combine(recv_x, handle, topk_weights=recv_w, async_finish=True)
    event.current_stream_wait()
    assert (combined._version, combined_w._version) == (0, 0), "an async combine output was modified in place"
    assert_combine_close(combined, identity_partials(topo, x, tokens_in_rank(ctx, topk_idx, 16)), torch.bfloat16)


def sparse_node_traffic_keeps_its_handle(ctx, topo):
    """Internode, a source node that sends one row or none to a node (the trainer's skewed routing at step 4): the
    differentiable dispatch op accepts the outputs (no two of them share memory) and the handle stays right after
    later dispatches reuse the engine's scratch rows: the combine of the first dispatch equals its reference."""
    from mtdeepep import autograd as ep_autograd

    buffer = topo.buffer(ctx)
    E, K, T, H = 4 * ctx.world_size, 2, 24, 64
    experts_per_node = E // topo.num_nodes
    node = ctx.rank // topo.node_size
    generator = torch.Generator().manual_seed(3000 + ctx.rank)
    # Every token to two experts of its own node, except rank 0's first token, which also goes to the next node.
    own = node * experts_per_node + torch.stack([torch.randperm(experts_per_node, generator=generator)[:K]
                                                 for _ in range(T)])  # fmt: skip
    topk_idx = own.long()
    if ctx.rank == 0:
        topk_idx[0, 1] = experts_per_node  # an expert of node 1
    x = torch.randn(T, H, generator=generator).bfloat16().requires_grad_()
    topk_weights = torch.rand(T, K, generator=generator).requires_grad_()
    recv_x, _, recv_w, _, handle = ep_autograd.dispatch(buffer, x, topk_idx, topk_weights, E)
    # Other dispatches, with other routing, in between: they overwrite the engine's temporaries.
    for seed in range(2):
        other_x, other_idx, other_w = make_inputs(ctx, 96, H, E, K, seed=300 + seed)
        layout_and_dispatch(buffer, other_x, other_idx, other_w, E)
    combined, _ = ep_autograd.combine(buffer, recv_x.float(), handle)
    in_rank = tokens_in_rank(ctx, topk_idx, E)
    assert_combine_close(combined.bfloat16(), identity_partials(topo, x.detach(), in_rank), torch.bfloat16)
    (combined.sum() + recv_w.sum()).backward()
    assert x.grad is not None and topk_weights.grad is not None


def small_buffer_moves_in_rounds(ctx, topo):
    """A region that holds a few rows forces many rounds; results equal the single-round ones."""
    small = topo.buffer(ctx, num_nvl_bytes=4096)
    for seed in range(2):
        d = check_dispatch(ctx, topo, small, 200, 96, 16, 4, seed=90 + seed)
        combined, combined_w, _ = small.combine(d.recv_x, d.handle, topk_weights=d.recv_w)
        assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)
        expected_w = d.topk_weights.masked_fill(d.topk_idx < 0, 0.0)
        assert torch.allclose(combined_w.cpu(), expected_w.cpu(), rtol=1e-6, atol=0)


def region_too_small_for_one_row_says_how_much(ctx, topo):
    """A region smaller than one row fails on every rank, naming the bytes needed (where a node has several ranks:
    a node of one rank moves its rows without the region)."""
    tiny = topo.buffer(ctx, num_nvl_bytes=1024)
    x, topk_idx, topk_weights = make_inputs(ctx, 16, 7168, 8, 2, seed=95, masked=0.0)
    try:
        layout_and_dispatch(tiny, x, topk_idx, topk_weights, 8)
    except deep_ep.GroupMismatchError as error:
        assert "needs at least" in str(error) and "bytes" in str(error), error
    else:
        raise AssertionError("expected an error naming the bytes needed")


def edge_cases(ctx, topo):
    buffer = topo.buffer(ctx)
    E = 4 * ctx.world_size
    # a rank with zero tokens
    tokens = 0 if ctx.rank == ctx.world_size - 1 else 50
    d = check_dispatch(ctx, topo, buffer, tokens, 64, E, 2, seed=100)
    combined, _, _ = buffer.combine(d.recv_x, d.handle)
    assert combined.shape == (tokens, 64)
    # every token to one expert, owned by the last rank (one node receives everything)
    x = torch.randn(40, 64).bfloat16()
    recv_x, recv_idx, _, counts, handle, _ = layout_and_dispatch(buffer, x, torch.full((40, 1), E - 1), None, E)
    expected_rows = 40 * ctx.world_size if ctx.rank == ctx.world_size - 1 else 0
    assert recv_x.size(0) == expected_rows
    if expected_rows:
        assert counts == [0, 0, 0, expected_rows] and bool((recv_idx == 3).all())
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined, x)
    # tokens whose every slot is -1 go nowhere and combine to zero
    topk_idx = torch.full((30, 4), -1)
    topk_idx[::2, 0] = 0
    x = torch.randn(30, 32).bfloat16()
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, torch.rand(30, 4), E)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined[::2], x[::2]) and bool((combined[1::2] == 0).all())
    # hidden sizes upstream rejects work (96, 7168 and odd ones), and float64 payloads move as bytes
    for hidden in (96, 7168, 7):
        d = check_dispatch(ctx, topo, buffer, 24, hidden, E, 3, seed=hidden)
        combined, _, _ = buffer.combine(d.recv_x, d.handle)
        assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)
    check_dispatch(ctx, topo, buffer, 24, 5, E, 3, seed=8, dtype=torch.float64)


def local_buffer_tensor_is_the_shared_region(ctx, topo):
    buffer = topo.buffer(ctx)
    whole = buffer.get_local_buffer_tensor(torch.uint8)
    assert whole.numel() == buffer.num_nvl_bytes
    view = buffer.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), offset=16)
    view.copy_(torch.arange(32.0).view(4, 8))
    assert torch.equal(buffer.get_local_buffer_tensor(torch.float32)[16:48], torch.arange(32.0))


# ---------------------------------------------------------------------------------------------------------------
# Autograd


def gradients_match_reference(ctx, topo):
    """deep_ep.dispatch / deep_ep.combine around a toy expert layer, against a plain float64 computation: every
    rank scales its received rows and adds their local weight sum."""
    buffer = topo.buffer(ctx)
    E, T, H = 4 * ctx.world_size, 96, 32
    x, topk_idx, topk_weights = make_inputs(ctx, T, H, E, 3, seed=110, dtype=torch.float32)
    x.requires_grad_(True)
    topk_weights.requires_grad_(True)
    generator = torch.Generator().manual_seed(ctx.rank + 111)
    grad_out, grad_w = torch.randn(T, H, generator=generator), torch.randn(T, 3, generator=generator)
    scale = 1.0 + 0.5 * ctx.rank
    recv_x, _, recv_w, _, handle = deep_ep.dispatch(buffer, x, topk_idx, topk_weights, E)
    expert_out = recv_x * scale + recv_w.sum(dim=1, keepdim=True)
    combined, combined_w = deep_ep.combine(buffer, expert_out, handle, topk_weights=recv_w)
    (combined * grad_out).sum().add((combined_w * grad_w).sum()).backward()

    # Reference on this rank's tokens alone: out_t = sum over the ranks r reached by t of (x_t * scale_r + t's
    # weights of r's experts); combined weights = weights with -1 slots zeroed.
    x_ref = x.detach().double().requires_grad_(True)
    w_ref = topk_weights.detach().double().requires_grad_(True)
    out_ref = torch.zeros(T, H, dtype=torch.float64)
    owner = torch.where(topk_idx >= 0, topk_idx // (E // ctx.world_size), -1)
    for r in range(ctx.world_size):
        reached = (owner == r).any(dim=1, keepdim=True)
        out_ref = out_ref + reached * (x_ref * (1.0 + 0.5 * r) + (w_ref * (owner == r)).sum(dim=1, keepdim=True))
    w_out_ref = w_ref * (topk_idx >= 0)
    (out_ref * grad_out.double()).sum().add((w_out_ref * grad_w.double()).sum()).backward()
    assert torch.allclose(combined.double(), out_ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad.double(), x_ref.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(topk_weights.grad.double(), w_ref.grad, rtol=1e-5, atol=1e-5)


def combine_bias_gradients(ctx, topo):
    buffer = topo.buffer(ctx)
    E = 2 * ctx.world_size
    x, topk_idx, topk_weights = make_inputs(ctx, 40, 16, E, 2, seed=120, dtype=torch.float32)
    recv_x, _, _, _, handle = deep_ep.dispatch(buffer, x, topk_idx, topk_weights, E)
    bias = torch.randn(40, 16, requires_grad=True)
    expert_out = recv_x.detach().requires_grad_(True)
    combined, _ = deep_ep.combine(buffer, expert_out, handle, bias=bias)
    grad = torch.randn(40, 16)
    (combined * grad).sum().backward()
    assert torch.equal(bias.grad, grad)
    # d combined / d expert row = the gradient of the token it came from
    everyone = gather(ctx, (grad, topk_idx))
    ref = refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], None, E, ctx.rank)
    assert torch.equal(expert_out.grad, ref.recv_x)


def buffer_released_by_python_or_autograd(ctx, topo):
    """A Buffer dropped without destroy() right after async work, or whose last reference is an autograd graph
    (so it dies on its own comm thread), must neither hang nor abort the process."""
    for _ in range(2):
        buffer = topo.new_buffer(ctx, 1 << 22)
        x = torch.randn(64, 32, requires_grad=True)
        topk_idx = torch.randint(0, 2 * ctx.world_size, (64, 2))
        recv_x, _, _, _, handle = deep_ep.dispatch(buffer, x, topk_idx, torch.rand(64, 2), 2 * ctx.world_size)
        out, _ = deep_ep.combine(buffer, recv_x * 2, handle)
        del buffer, recv_x, handle  # the graph now holds the only reference
        out.sum().backward()
        ranks_reached = tokens_in_rank(ctx, topk_idx, 2 * ctx.world_size).sum(dim=1, keepdim=True)
        assert torch.equal(x.grad, (2.0 * ranks_reached).expand_as(x))  # d(sum over ranks of 2x)/dx
        del out
        gc.collect()
        buffer = topo.new_buffer(ctx, 1 << 22)
        *_, event = buffer.get_dispatch_layout(topk_idx, 2 * ctx.world_size, async_finish=True)
        del buffer, event
        gc.collect()


# ---------------------------------------------------------------------------------------------------------------
# Errors and timeouts


def bad_inputs_raise_value_error_before_communicating(ctx, topo):
    """Each rank hits every error locally; nothing is sent, so the buffer stays in step with its peers."""
    buffer = topo.buffer(ctx)
    E = 4 * ctx.world_size
    x, topk_idx, topk_weights = make_inputs(ctx, 32, 128, E, 2, seed=130)
    layout = layout_kwargs(buffer, topk_idx, E)
    per_node = layout.pop("num_tokens_per_rdma_rank")
    per_rank, in_rank, per_expert = layout["num_tokens_per_rank"], layout["is_token_in_rank"], layout[
        "num_tokens_per_expert"]  # fmt: skip
    *_, real_handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, E)
    copied_handle = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in real_handle)  # not a dispatch's
    # a handle of the other mode: internode for an intranode topology (one rank per node) and vice versa
    other_mode = ctx.cache.setdefault(
        f"other-mode-{topo}",
        deep_ep.Buffer(ctx.group, 1 << 20, **({} if topo.internode else {"num_ranks_per_node": 1})),
    )
    *_, other_mode_handle, _ = layout_and_dispatch(other_mode, x, topk_idx, topk_weights, E)
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
        "topk_weights without topk_idx": lambda: buffer.dispatch(x, topk_weights=topk_weights, **layout),
        "topk_idx rows": lambda: buffer.dispatch(x[:16], topk_idx=topk_idx, **layout),
        "fp8 hidden not a multiple of 128": lambda: buffer.dispatch(bad_fp8, topk_idx=topk_idx, **layout),
        "fp8 scales shape": lambda: buffer.dispatch((x.to(torch.float8_e4m3fn), torch.ones(32, 3)), **layout),
        "counts inconsistent": lambda: buffer.dispatch(
            x, num_tokens_per_rank=per_rank + 1, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
        ),  # fmt: skip
        "missing layout": lambda: buffer.dispatch(x, topk_idx=topk_idx),
        "cached with top-k": lambda: buffer.dispatch(x, handle=real_handle, topk_idx=topk_idx),
        "hand-made handle (dispatch)": lambda: buffer.dispatch(x, handle=copied_handle),
        "hand-made handle (combine)": lambda: buffer.combine(x, copied_handle),
        "handle of the other mode": lambda: buffer.combine(x, other_mode_handle),
        "not a handle": lambda: buffer.combine(x, (1, 2, 3)),
        "expert_alignment": lambda: buffer.dispatch(x, topk_idx=topk_idx, expert_alignment=0, **layout),
        "num_worst_tokens": lambda: buffer.dispatch(x, topk_idx=topk_idx, num_worst_tokens=-1, **layout),
    }
    if topo.internode:
        # (Intranode, a previous_event of the wrong type fails with AttributeError instead: not checked there.)
        cases.update({
            "previous_event type": lambda: buffer.dispatch(x, topk_idx=topk_idx, previous_event=object(), **layout),
            "rdma counts inconsistent": lambda: buffer.dispatch(x, num_tokens_per_rdma_rank=per_node + 1, **layout),
            "rdma counts shape": lambda: buffer.dispatch(
                x, num_tokens_per_rdma_rank=torch.zeros(topo.num_nodes + 1, dtype=torch.int32), **layout
            ),
        })  # fmt: skip
    recv_x, _, recv_w, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, E)
    cases.update({
        "combine x rows": lambda: buffer.combine(recv_x[1:], handle),
        "combine x dtype": lambda: buffer.combine(recv_x.long(), handle),
        "combine weights rows": lambda: buffer.combine(recv_x, handle, topk_weights=recv_w[1:]),
        "bias shape": lambda: buffer.combine(recv_x, handle, bias=torch.zeros(31, 128, dtype=torch.bfloat16)),
        "bias dtype": lambda: buffer.combine(recv_x, handle, bias=torch.zeros(32, 128)),
        "cached x rows": lambda: buffer.dispatch(x[1:], handle=handle),
    })  # fmt: skip
    assert_value_errors(cases)
    check_dispatch(ctx, topo, buffer, 32, 128, E, 2, seed=131)  # still in step with the peers


def _destroy_at(buffer: deep_ep.Buffer, release: float) -> None:
    """Destroy only once every rank is done waiting: a destroyed peer would end their waits early (a CommError
    saying so) instead of letting them time out."""
    time.sleep(max(0.0, release - time.perf_counter()))
    buffer.destroy()


def _timeout_outcome(topo, error: deep_ep.CommTimeoutError, phase: str) -> str:
    """'network' or 'node-local [late ranks]': where a rank timed out and whom it names. Internode messages name
    the stage; an intranode buffer has only the node-local one. The CUDA executor's messages name the ranks that did
    not arrive in their own words (`named_ranks`); it runs on one node."""
    message = str(error)
    if topo.placement.on_gpu:
        return f"node-local {named_ranks(message) or message}"
    assert phase in message, message
    if " stopped: " in message:  # another rank's published timeout ended this rank's wait: what that rank reported
        message = message.partition(" stopped: ")[2]
    if topo.internode:
        assert f"internode {phase}" in message, message
        if "network stage" in message:  # names the ranks that did not reach the operation (from the store)
            late = re.search(r"rank\(s\) ((?:\d+ \(at operation #\d+\)(?:, )?)+) did not arrive", message)
            assert late, message
            ranks = [int(r) for r in re.findall(r"(\d+) \(at operation", late.group(1))]
            return f"network {ranks}"
        assert "node-local stage" in message, message
    late = re.search(r"rank\(s\) \[([0-9, ]*)\] did not arrive", message)
    assert late, message
    ranks = [int(r) for r in late.group(1).split(",")]
    node = re.search(r"local rank i is group rank (\d+) \+ i", message)  # internode: ranks local to the node
    return f"node-local {[r + int(node.group(1)) for r in ranks] if node else ranks}"


def _still_works(ctx, topo) -> None:
    """After a timeout every rank's device is not hung (its synchronisation returns) and a fresh buffer dispatches
    right."""
    barrier(ctx)
    topo.placement.synchronize()
    check_dispatch(ctx, topo, topo.buffer(ctx, 16 << 20), 64, 256, 16, 2, seed=119)


def bad_input_outcomes(topo) -> list[str]:
    """What `bad_input_on_one_rank_times_out_the_others` returns on each rank: where it timed out and whom it names.
    Internode, every operation begins with the operation check over the whole group: the others wait there for
    rank 1. 2x2: rank 3 starts late; the first of ranks 0 and 2 to time out publishes its report, which stops it."""
    stage = "network" if topo.internode else "node-local"
    return [f"{stage} [1]", "value-error"] + [f"{stage} [1]"] * (topo.world_size - 2)


def bad_input_on_one_rank_times_out_the_others(ctx, topo, timeout_s):
    """Rank 1 refuses its input before sending anything; the others time out after about `timeout_s`, naming the
    stage they were waiting in and the ranks they waited for; then every rank uses its device again. With 3 or
    more ranks every waiter but the first is stopped by a peer, and must still name rank 1. Internode, every
    operation begins with the operation check over the whole group, which rank 1 never joins. 2x2: rank 3 starts
    late, so that the timeout of rank 0 or 2, published in the store, stops rank 3's wait first: rank 3 then raises
    a CommTimeoutError too, carrying that rank's report."""
    placement = topo.placement
    buffer = topo.new_buffer(ctx, 1 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    release = time.perf_counter() + 2 * timeout_s + 0.5 + 2 * placement.timeout_slack_s
    try:
        x, topk_idx, topk_weights = make_inputs(ctx, 32, 64, 8, 2, seed=140)
        bad = topk_idx.clone()
        if ctx.rank == 1:
            bad[3, 0] = 99
        x, bad, topk_weights = placement.to(x, bad, topk_weights)
        start = time.perf_counter()
        late_starter = 3 if str(topo) == "internode-2x2" else None
        if ctx.rank == late_starter:
            time.sleep(0.4 * timeout_s)
        try:
            layout_and_dispatch(buffer, x, bad, topk_weights, 8)
            placement.synchronize()
        except ValueError as error:
            assert ctx.rank == 1 and "[-1, 8)" in str(error), error
            outcome = "value-error"
        except deep_ep.CommTimeoutError as error:
            elapsed = time.perf_counter() - start
            assert ctx.rank != 1
            # About the timeout: a rank that another rank's published timeout stops may end a little before its own.
            assert 0.8 * timeout_s <= elapsed < 2 * timeout_s + placement.timeout_slack_s, elapsed
            outcome = _timeout_outcome(topo, error, "dispatch")
            # Internode, every operation starts with the operation check over the whole group (rank 1 never joins it).
            assert not outcome.startswith("network") or "operation check" in str(error), error
            assert ctx.rank != late_starter or " stopped: " in str(error), error  # stopped by a peer's timeout
        else:
            raise AssertionError("the dispatch succeeded without rank 1")
    finally:
        _destroy_at(buffer, release)
    _still_works(ctx, topo)
    return outcome


def missing_in_combine_outcomes(topo) -> list[str]:
    """What `missing_rank_in_combine_times_out` returns on each rank (internode, every combine starts with the
    operation check over the whole group: it names rank 0)."""
    stage = "network" if topo.internode else "node-local"
    return ["skipped"] + [f"{stage} [0]"] * (topo.world_size - 1)


def missing_rank_in_combine_times_out(ctx, topo, timeout_s, async_finish=False):
    """Rank 0 never joins the combine; the others time out naming the stage they were waiting in (see `first_error`
    for where a GPU raises it); then every rank uses its device again. With `async_finish` the call returns at once
    and the event's wait raises the timeout."""
    placement = topo.placement
    buffer = topo.new_buffer(ctx, 1 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    release = time.perf_counter() + 2 * timeout_s + 1.0 + placement.timeout_slack_s  # the dispatch takes a few ms
    outcome = "skipped"
    try:
        x, topk_idx, topk_weights = placement.to(*make_inputs(ctx, 32, 64, 8, 2, seed=150))
        recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 8)
        if ctx.rank != 0:
            state = {}

            def call():
                start = time.perf_counter()
                _, _, state["event"] = buffer.combine(recv_x, handle, async_finish=async_finish)
                assert async_finish or placement.on_gpu, "combine returned without rank 0"
                assert time.perf_counter() - start < timeout_s / 2 or not async_finish, "async combine blocked"
                if not placement.on_gpu:
                    state["event"].current_stream_wait()

            error = first_error(topo, deep_ep.CommTimeoutError, call, lambda: state["event"].current_stream_wait(),
                                placement.synchronize, lambda: buffer.get_dispatch_layout(topk_idx, 8))  # fmt: skip
            assert error is not None, "combine succeeded without rank 0"
            outcome = _timeout_outcome(topo, error, "combine")
            if outcome.startswith("network"):  # internode, every operation starts with the operation check
                assert "operation check" in str(error), error
            elif topo.internode:
                assert "node 0" in str(error), error
    finally:
        _destroy_at(buffer, release)
    _still_works(ctx, topo)
    return outcome


# ---------------------------------------------------------------------------------------------------------------
# Set-up


def single_rank_group(ctx, topo):
    """A group of one (a slice of the world: this rank alone) works and moves nothing across processes."""
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


def node_layout_is_validated(ctx, topo):
    """Bad node sizes fail on every rank before any communication; LOCAL_WORLD_SIZE is the default node size."""
    for bad in (3, 0, -2, 2.0):
        try:
            deep_ep.Buffer(ctx.group, 1 << 20, num_ranks_per_node=bad)
        except ValueError as error:
            assert "num_ranks_per_node" in str(error), error
        else:
            raise AssertionError(f"num_ranks_per_node={bad}: no ValueError")
    previous = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(topo.node_size)
    try:
        buffer = deep_ep.Buffer(ctx.group, 1 << 20, explicitly_destroy=True)
        assert buffer.get_num_rdma_ranks() == topo.num_nodes
        check_dispatch(ctx, topo, buffer, 40, 32, 8, 2, seed=5)
        buffer.destroy()
    finally:
        if previous is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = previous
    # The ranks of a node must share a host: seen through the host names the ranks exchange at set-up.
    real_gethostname = socket.gethostname
    try:
        socket.gethostname = lambda: f"host-{ctx.rank % 2}"  # nodes of 2 would span two hosts
        try:
            deep_ep.Buffer(ctx.group, 1 << 20, num_ranks_per_node=2)
        except ValueError as error:
            assert "node 0" in str(error) and "num_ranks_per_node" in str(error), error
        else:
            raise AssertionError("a node spanning two hosts was accepted")
        socket.gethostname = lambda: f"host-{ctx.rank // 2}"  # nodes of 2 on a host each
        buffer = deep_ep.Buffer(ctx.group, 1 << 20, num_ranks_per_node=2, explicitly_destroy=True)
        check_dispatch(ctx, Topology(ctx.world_size, ranks_per_node=2), buffer, 40, 32, 8, 2, seed=6)
        buffer.destroy()
    finally:
        socket.gethostname = real_gethostname
