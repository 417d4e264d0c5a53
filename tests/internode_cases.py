"""Internode (two-stage) cases run inside the rank processes of `ranks.RankPool` (see test_internode.py).

Four ranks of this host are split into nodes with `num_ranks_per_node` (2: two nodes of two ranks; 1: four nodes
of one rank), so both stages run: the network stage over torch.distributed (gloo) and the node-local stage over
shared memory. Every case takes `per_node` and compares with `mtdeepep.utils.refs` and, where the results must be
identical, with an intranode Buffer over the same four ranks.

Tolerances: dispatch moves bytes, so it must be exact. Combine rounds twice: each node's partial sum (an FP32 sum
of the rows of that node's ranks) is rounded once to x's dtype before the network stage, and the FP32 sum of the
node partials (plus bias) is rounded once more. With u the unit roundoff of the dtype (bf16 2^-8, fp16 2^-11),
`|out - S| <= u |S| + u (1 + u) sum_n |P_n|` where S is the exact sum and P_n the exact partial of node n; the FP32
additions add at most `R * 2^-24 * sum |rows|`. `node_partials_f64` computes the P_n in float64.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from intranode_cases import assert_async_overlaps, gather, make_inputs

import mtdeepep as deep_ep
from mtdeepep._setup import check_nodes_share_hosts
from mtdeepep.utils import refs

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def buffer_for(ctx, per_node: int, num_nvl_bytes: int = 64 << 20) -> deep_ep.Buffer:
    """One buffer per layout, reused across the cases of the pool (per_node = ranks per node)."""
    key = f"internode-{per_node}-{num_nvl_bytes}"
    if key not in ctx.cache:
        ctx.cache[key] = deep_ep.Buffer(ctx.group, num_nvl_bytes, num_ranks_per_node=per_node)
    return ctx.cache[key]


def intranode_buffer(ctx) -> deep_ep.Buffer:
    """The single-node buffer over the same ranks: the results internode must reproduce."""
    return buffer_for(ctx, ctx.world_size)


def layout_and_dispatch(buffer, x, topk_idx, topk_weights, num_experts, with_topk=True, **kwargs):
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    topk = dict(topk_idx=topk_idx, topk_weights=topk_weights) if with_topk else {}
    return buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, **topk, **kwargs,
    )  # fmt: skip


def node_partials_f64(ctx, per_node, expert_out, src_rank, src_idx, num_tokens) -> torch.Tensor:
    """`[num_nodes, T, H]` float64: for each node, the exact sum of the rows its ranks send back to this rank."""
    everyone = gather(ctx, (expert_out, src_rank, src_idx))
    partials = torch.zeros(ctx.world_size // per_node, num_tokens, expert_out.size(1), dtype=torch.float64)
    for j, (rows, ranks, idx) in enumerate(everyone):
        mine = ranks == ctx.rank
        partials[j // per_node].index_add_(0, idx[mine], rows[mine].double())
    return partials


def assert_two_roundings(actual, partials, dtype, extra=None):
    """`actual` vs the exact sum of `partials` (+ `extra`), within the bound of the module docstring."""
    u = UNIT_ROUNDOFF[dtype]
    exact = partials.sum(dim=0) + (0 if extra is None else extra)
    magnitude = partials.abs().sum(dim=0) + (0 if extra is None else extra.abs())
    bound = u * exact.abs() + u * (1 + u) * partials.abs().sum(dim=0) + 4 * 2.0**-24 * magnitude + 1e-30
    excess = (actual.double() - exact).abs() - bound
    assert bool((excess <= 0).all()), f"max excess {excess.max().item():.3e}"


def check_dispatch(ctx, buffer, per_node, num_tokens, hidden, num_experts, num_topk, seed, dtype=torch.bfloat16,
                   masked=0.1, expert_alignment=1):  # fmt: skip
    """Dispatch on the internode buffer; every output equal to the reference and to the intranode buffer's."""
    x, topk_idx, topk_weights = make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed, dtype, masked)
    recv_x, recv_idx, recv_w, counts, handle, event = layout_and_dispatch(
        buffer, x, topk_idx, topk_weights, num_experts, expert_alignment=expert_alignment
    )
    assert event.query()
    everyone = gather(ctx, (x, topk_idx, topk_weights))
    ref = refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], num_experts, ctx.rank, expert_alignment)
    assert torch.equal(recv_x, ref.recv_x), "recv_x differs from the reference"
    assert torch.equal(recv_idx, ref.recv_topk_idx), "recv_topk_idx differs"
    assert torch.equal(recv_w, ref.recv_topk_weights), "recv_topk_weights differs"
    assert counts == ref.num_recv_tokens_per_expert, (counts, ref.num_recv_tokens_per_expert)
    # The handle: is_token_in_rank first, upstream's recv_gbl_rank_prefix_sum at [-4], then the sources of the rows.
    assert isinstance(handle, tuple) and len(handle) == 8 and handle[0] is not None
    assert torch.equal(handle[-4], ref.rank_prefix_matrix[:, ctx.rank])
    assert torch.equal(handle.recv_src_meta.long(), torch.stack([ref.recv_src_rank, ref.recv_src_idx], dim=1))
    # Identical to the single-node path on the same ranks and inputs.
    single = layout_and_dispatch(
        intranode_buffer(ctx), x, topk_idx, topk_weights, num_experts, expert_alignment=expert_alignment
    )
    for ours, theirs in zip((recv_x, recv_idx, recv_w, counts), single[:4]):
        assert ours == theirs if isinstance(ours, list) else torch.equal(ours, theirs)
    return x, topk_idx, topk_weights, recv_x, recv_idx, recv_w, handle, ref


# ---------------------------------------------------------------------------------------------------------------
# Layout and ranks


def layout_matches_reference(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    num_nodes = ctx.world_size // per_node
    assert buffer.get_num_rdma_ranks() == num_nodes and buffer.get_rdma_rank() == ctx.rank // per_node
    assert buffer.get_root_rdma_rank(True) == ctx.rank // per_node * per_node and buffer.get_root_rdma_rank(False) == 0
    for seed, (tokens, experts, topk) in enumerate([(256, 16, 4), (1000, 64, 8), (1, 8, 8), (333, 8, 1), (0, 8, 2)]):
        _, topk_idx, _ = make_inputs(ctx, tokens, 8, experts, topk, seed, masked=0.2)
        per_rank, per_node_count, per_expert, in_rank, event = buffer.get_dispatch_layout(topk_idx, experts)
        ref_rank, ref_expert, ref_in_rank = refs.ref_dispatch_layout(topk_idx, experts, ctx.world_size)
        assert event.query()
        assert per_rank.dtype == per_expert.dtype == per_node_count.dtype == torch.int32 and in_rank.dtype == torch.bool
        assert torch.equal(per_rank, ref_rank) and torch.equal(per_expert, ref_expert)
        assert torch.equal(in_rank, ref_in_rank)
        # A token counts once per node that owns one of its experts, however many.
        experts_per_node = experts // num_nodes
        expected = [
            int(((topk_idx // experts_per_node == n) & (topk_idx >= 0)).any(dim=1).sum()) for n in range(num_nodes)
        ]
        assert per_node_count.tolist() == expected, (per_node_count, expected)


def node_layout_is_validated(ctx, per_node):
    """Bad node sizes fail on every rank before any communication; LOCAL_WORLD_SIZE is the default."""
    for bad in (3, 0, -2, 2.0):
        try:
            deep_ep.Buffer(ctx.group, 1 << 20, num_ranks_per_node=bad)
        except ValueError as error:
            assert "num_ranks_per_node" in str(error), error
        else:
            raise AssertionError(f"num_ranks_per_node={bad}: no ValueError")
    previous = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    try:
        buffer = deep_ep.Buffer(ctx.group, 1 << 20, explicitly_destroy=True)
        assert buffer.get_num_rdma_ranks() == ctx.world_size // per_node
        check_dispatch(ctx, buffer, per_node, 40, 32, 8, 2, seed=5)
        buffer.destroy()
    finally:
        if previous is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = previous
    # Ranks of one node must share a host (checked on the gathered host names).
    check_nodes_share_hosts(["a", "a", "b", "b"], 2)
    try:
        check_nodes_share_hosts(["a", "b", "a", "b"], 2)
    except ValueError as error:
        assert "node 0" in str(error) and "num_ranks_per_node" in str(error), error
    else:
        raise AssertionError("a node spanning two hosts was accepted")


# ---------------------------------------------------------------------------------------------------------------
# Dispatch


def dispatch_matches_reference(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    for seed, (tokens, hidden, experts, topk) in enumerate([(128, 256, 16, 4), (300, 96, 32, 8), (64, 7168, 8, 2),
                                                            (200, 130, 24, 3)]):  # fmt: skip
        experts = experts if experts % ctx.world_size == 0 else experts * ctx.world_size
        check_dispatch(ctx, buffer, per_node, tokens, hidden, experts, topk, seed)
    check_dispatch(ctx, buffer, per_node, 100, 64, 8, 2, 7, dtype=torch.float32)
    check_dispatch(ctx, buffer, per_node, 100, 64, 8, 2, 8, dtype=torch.float16)


def dispatch_without_topk(ctx, per_node):
    """Layout only (upstream's `with_topk=False`): rows and per-expert counts still arrive, top-k outputs are None."""
    buffer = buffer_for(ctx, per_node)
    x, topk_idx, topk_weights = make_inputs(ctx, 150, 64, 16, 4, seed=9)
    recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(buffer, x, topk_idx, None, 16, with_topk=False)
    single = layout_and_dispatch(intranode_buffer(ctx), x, topk_idx, None, 16, with_topk=False)
    assert recv_idx is None and recv_w is None
    assert torch.equal(recv_x, single[0]) and counts == single[3]
    global_counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=16).int()
    dist.all_reduce(global_counts, group=ctx.group)
    assert counts == global_counts.view(ctx.world_size, -1)[ctx.rank].tolist()
    combined, weights, _ = buffer.combine(recv_x, handle)
    assert weights is None
    assert_two_roundings(combined, x.double().unsqueeze(0) * handle[0].view(150, -1, per_node).sum(2).T.unsqueeze(2),
                         torch.bfloat16)  # fmt: skip


def dispatch_segments_constant_per_source(ctx, per_node):
    """Upstream's check: rows filled with the source rank id; each `handle[-4]` segment of recv_x is that id."""
    buffer = buffer_for(ctx, per_node)
    _, topk_idx, topk_weights = make_inputs(ctx, 512, 128, 32, 8, seed=11)
    x = torch.full((512, 128), float(ctx.rank), dtype=torch.bfloat16)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 32)
    prefix = handle[-4].tolist()
    for source in range(ctx.world_size):
        segment = recv_x[prefix[source - 1] if source else 0 : prefix[source]]
        assert segment.numel() and bool((segment == source).all()), f"segment of source {source}"


def expert_alignment_rounds_counts(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    for alignment in (4, 128):
        check_dispatch(ctx, buffer, per_node, 150, 32, 16, 4, seed=20 + alignment, expert_alignment=alignment)


def fp8_dispatch_passes_through(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    x, topk_idx, topk_weights = make_inputs(ctx, 200, 256, 16, 4, seed=30)
    e4m3, scales = refs.per_token_cast_to_fp8(x.float())
    everyone = gather(ctx, (e4m3.view(torch.uint8), scales, topk_idx))
    ref_data = refs.ref_dispatch([e[0] for e in everyone], [e[2] for e in everyone], None, 16, ctx.rank).recv_x
    ref_scales = refs.ref_dispatch([e[1] for e in everyone], [e[2] for e in everyone], None, 16, ctx.rank).recv_x
    for layout in ("row", "column"):
        s = scales if layout == "row" else scales.T.contiguous().T  # upstream passes column-major scales
        (recv_data, recv_scales), *_, handle, _ = layout_and_dispatch(buffer, (e4m3, s), topk_idx, topk_weights, 16)
        assert recv_data.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
        assert recv_scales.is_contiguous()
        assert torch.equal(recv_data.view(torch.uint8), ref_data), f"fp8 data ({layout}-major scales)"
        assert torch.equal(recv_scales, ref_scales), f"scales ({layout}-major)"
        (cached_data, cached_scales), *_ = buffer.dispatch((e4m3, s), handle=handle)
        assert torch.equal(cached_data.view(torch.uint8), ref_data) and torch.equal(cached_scales, ref_scales)


def cached_dispatch_matches(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    x, topk_idx, _, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, per_node, 256, 64, 16, 4, seed=40)
    again, recv_idx, recv_w, counts, same_handle, event = buffer.dispatch(x, handle=handle)
    assert torch.equal(again, recv_x) and event.query()
    assert recv_idx is None and recv_w is None and counts is None and same_handle is handle
    y = torch.randn(256, 48)  # another payload with the same routing (e.g. a gradient)
    recv_y, *_ = buffer.dispatch(y, handle=handle)
    everyone = gather(ctx, (y, topk_idx))
    assert torch.equal(recv_y, refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], None, 16,
                                                 ctx.rank).recv_x)  # fmt: skip


def num_worst_tokens_pads_outputs(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    x, topk_idx, topk_weights = make_inputs(ctx, 100, 64, 16, 4, seed=50)
    worst = 100 * ctx.world_size
    recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(
        buffer, x, topk_idx, topk_weights, 16, num_worst_tokens=worst
    )
    everyone = gather(ctx, (x, topk_idx, topk_weights))
    ref = refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], 16, ctx.rank)
    n = ref.recv_x.size(0)
    assert recv_x.size(0) == recv_idx.size(0) == recv_w.size(0) == worst and counts == []
    assert torch.equal(recv_x[:n], ref.recv_x) and torch.equal(recv_idx[:n], ref.recv_topk_idx)
    assert bool((recv_idx[n:] == -1).all()) and bool((recv_w[n:] == 0).all())
    out, _, _ = buffer.combine(recv_x, handle)  # only the valid rows count
    expected = x.double().unsqueeze(0) * handle[0].view(100, -1, per_node).sum(2).T.unsqueeze(2)
    assert_two_roundings(out, expected, torch.bfloat16)
    # Too small a bound for some ranks only: every rank raises, naming them, and the buffer stays usable (also for
    # a cached dispatch of that handle).
    x, topk_idx, topk_weights = make_inputs(ctx, 100, 16, 8, 2, seed=51, masked=0.0)
    num_recv = buffer.get_dispatch_layout(topk_idx, 8)[0]
    dist.all_reduce(num_recv, group=ctx.group)
    worst = int(num_recv.median())
    over = [r for r in range(ctx.world_size) if num_recv[r] > worst]
    assert over and len(over) < ctx.world_size, num_recv
    for cached in (None, handle):
        try:
            if cached is None:
                layout_and_dispatch(buffer, x, topk_idx, topk_weights, 8, num_worst_tokens=worst)
            else:  # the first dispatch's handle: every rank receives far more than 10 rows
                buffer.dispatch(x[:, :64].repeat(1, 4), handle=cached, num_worst_tokens=10)
        except deep_ep.GroupMismatchError as error:
            if cached is None:
                assert f"num_worst_tokens={worst}" in str(error), error
                assert all(f"rank {r}: {num_recv[r].item()}" in str(error) for r in over), error
        else:
            raise AssertionError("expected GroupMismatchError")
    check_dispatch(ctx, buffer, per_node, 64, 16, 8, 2, seed=52)


# ---------------------------------------------------------------------------------------------------------------
# Combine


def combine_matches_reference(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    for seed, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32)):
        x, topk_idx, topk_weights, recv_x, recv_idx, recv_w, handle, ref = check_dispatch(
            ctx, buffer, per_node, 300, 160, 16, 4, seed=60 + seed, dtype=dtype
        )
        expert_out = (recv_x.float() * (1.5 + ctx.rank) + 0.25).to(dtype)  # a different "expert" per rank
        combined, combined_w, event = buffer.combine(expert_out, handle, topk_weights=recv_w)
        assert combined.dtype == dtype and combined_w.dtype == torch.float32 and event.query()
        partials = node_partials_f64(ctx, per_node, expert_out, ref.recv_src_rank, ref.recv_src_idx, 300)
        assert_two_roundings(combined, partials, dtype)
        # Slot-wise weight sums rebuild the original weights (non-local slots are 0 everywhere).
        assert torch.allclose(combined_w, topk_weights.masked_fill(topk_idx < 0, 0.0), rtol=1e-6, atol=0)
        # Results own their memory: the next call (reusing the buffer's scratch) leaves them unchanged.
        kept = (combined.clone(), recv_x.clone())
        buffer.combine(torch.zeros_like(expert_out), handle)
        buffer.dispatch(torch.zeros_like(x), handle=handle)
        assert torch.equal(combined, kept[0]) and torch.equal(recv_x, kept[1])


def combine_accumulates_in_fp32(ctx, per_node):
    """Every token reaches every rank; rank 0 returns 1, the others 2^-8. Summed row by row in bf16 that stays 1;
    summed in FP32 per node, rounded, then summed in FP32 across nodes, it does not."""
    buffer = buffer_for(ctx, per_node)
    num_experts = ctx.world_size * 2
    topk_idx = torch.arange(0, num_experts, 2).repeat(8, 1)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, torch.ones(8, 16, dtype=torch.bfloat16), topk_idx,
                                                     None, num_experts)  # fmt: skip
    value = 1.0 if ctx.rank == 0 else 2.0**-8
    combined, _, _ = buffer.combine(torch.full_like(recv_x, value), handle)
    node_sums = [
        torch.tensor([1.0 if r == 0 else 2.0**-8 for r in range(n * per_node, (n + 1) * per_node)]).sum().bfloat16()
        for n in range(ctx.world_size // per_node)
    ]
    expected = torch.stack(node_sums).float().sum().bfloat16()
    assert bool((combined == expected).all()), (combined[0, 0].item(), expected.item())
    assert expected.item() > 1.0


def combine_adds_bias(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    x, _, _, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, per_node, 128, 64, 8, 2, seed=70)
    generator = torch.Generator().manual_seed(ctx.rank + 71)
    b0 = torch.randn(128, 64, generator=generator).bfloat16()
    b1 = torch.randn(128, 64, generator=generator).bfloat16()
    partials = x.double().unsqueeze(0) * handle[0].view(128, -1, per_node).sum(2).T.unsqueeze(2)
    for bias, extra in [(b0, b0.double()), ((b0, b1), b0.double() + b1.double()), ((None, b1), b1.double())]:
        combined, _, _ = buffer.combine(recv_x, handle, bias=bias)
        assert_two_roundings(combined, partials, torch.bfloat16, extra)


def async_and_previous_event(ctx, per_node):
    """async_finish returns events that complete; previous_event orders the calls; results as without them."""
    buffer = buffer_for(ctx, per_node)
    x, topk_idx, topk_weights = make_inputs(ctx, 256, 128, 16, 4, seed=80)
    previous = deep_ep.Buffer.capture()
    per_rank, per_node_count, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(
        topk_idx, 16, previous_event=previous, async_finish=True, allocate_on_comm_stream=True
    )
    recv_x, recv_idx, _, _, handle, dispatch_event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node_count, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, previous_event=layout_event,
        async_finish=True,
    )  # fmt: skip
    combined, _, combine_event = buffer.combine(
        recv_x, handle, previous_event=dispatch_event, async_finish=True, allocate_on_comm_stream=True
    )
    with combine_event:
        pass
    assert layout_event.query() and dispatch_event.query() and combine_event.query()
    single = layout_and_dispatch(intranode_buffer(ctx), x, topk_idx, topk_weights, 16)
    assert torch.equal(recv_x, single[0]) and torch.equal(recv_idx, single[1])
    assert_two_roundings(combined, x.double().unsqueeze(0) * in_rank.view(256, -1, per_node).sum(2).T.unsqueeze(2),
                         torch.bfloat16)  # fmt: skip
    try:
        buffer.get_dispatch_layout(topk_idx, 16, allocate_on_comm_stream=True)
    except ValueError:
        pass
    else:
        raise AssertionError("allocate_on_comm_stream without previous_event and async_finish was accepted")


def async_finish_overlaps_the_transfer(ctx, per_node):
    """Work between an `async_finish=True` dispatch/combine and its wait overlaps the two stages (the caller waits
    only for the count and metadata exchanges)."""
    buffer = buffer_for(ctx, per_node, num_nvl_bytes=256 << 20)
    x, topk_idx, _ = make_inputs(ctx, 2048, 2048, 32, 4, seed=175)
    per_rank, per_node_count, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 32)
    return assert_async_overlaps(ctx, buffer, x, dict(
        num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node_count, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    ))  # fmt: skip


def edge_cases(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    E = 4 * ctx.world_size
    # a rank with zero tokens
    tokens = 0 if ctx.rank == ctx.world_size - 1 else 50
    _, _, _, recv_x, _, _, handle, _ = check_dispatch(ctx, buffer, per_node, tokens, 64, E, 2, seed=100)
    combined, _, _ = buffer.combine(recv_x, handle)
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
    # odd hidden sizes and float64 payloads move as bytes
    check_dispatch(ctx, buffer, per_node, 24, 7, E, 3, seed=7)
    check_dispatch(ctx, buffer, per_node, 24, 5, E, 3, seed=8, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# Autograd


def gradients_match_reference(ctx, per_node):
    """deep_ep.dispatch / deep_ep.combine through the internode buffer, against a plain float64 computation."""
    buffer = buffer_for(ctx, per_node)
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

    # out_t = sum over the ranks r reached by t of (x_t * scale_r + t's weights of r's experts)
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


def combine_bias_gradients(ctx, per_node):
    buffer = buffer_for(ctx, per_node)
    E = 2 * ctx.world_size
    x, topk_idx, topk_weights = make_inputs(ctx, 40, 16, E, 2, seed=120, dtype=torch.float32)
    recv_x, _, _, _, handle = deep_ep.dispatch(buffer, x, topk_idx, topk_weights, E)
    bias = torch.randn(40, 16, requires_grad=True)
    expert_out = recv_x.detach().requires_grad_(True)
    combined, _ = deep_ep.combine(buffer, expert_out, handle, bias=bias)
    grad = torch.randn(40, 16)
    (combined * grad).sum().backward()
    assert torch.equal(bias.grad, grad)
    everyone = gather(ctx, (grad, topk_idx))
    ref = refs.ref_dispatch([e[0] for e in everyone], [e[1] for e in everyone], None, E, ctx.rank)
    assert torch.equal(expert_out.grad, ref.recv_x)


# ---------------------------------------------------------------------------------------------------------------
# Errors and timeouts


def bad_inputs_raise_value_error_before_communicating(ctx, per_node):
    """Each rank hits every error locally; nothing is sent, so the buffer stays in step with its peers."""
    buffer = buffer_for(ctx, per_node)
    E = 4 * ctx.world_size
    x, topk_idx, topk_weights = make_inputs(ctx, 32, 128, E, 2, seed=130)
    per_rank, per_node_count, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    *_, single_handle, _ = layout_and_dispatch(intranode_buffer(ctx), x, topk_idx, topk_weights, E)
    *_, real_handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, E)
    copied_handle = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in real_handle)
    bad_fp8 = (torch.zeros(32, 96, dtype=torch.float8_e4m3fn), torch.ones(32, 1))
    cases = {
        "expert id >= num_experts": lambda: buffer.get_dispatch_layout(topk_idx.clamp(min=0) + E, E),
        "expert id < -1": lambda: buffer.get_dispatch_layout(topk_idx - 5, E),
        "experts not divisible by ranks": lambda: buffer.get_dispatch_layout(topk_idx, E + 1),
        "topk_idx dtype": lambda: buffer.get_dispatch_layout(topk_idx.int(), E),
        "x dtype": lambda: buffer.dispatch(x.long(), topk_idx=topk_idx, **layout),
        "x shape": lambda: buffer.dispatch(x[0], topk_idx=topk_idx, **layout),
        "x device": lambda: buffer.dispatch(x.to("meta"), topk_idx=topk_idx, **layout),
        "topk_weights shape": lambda: buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights[:, :1], **layout
        ),  # fmt: skip
        "topk_weights without topk_idx": lambda: buffer.dispatch(x, topk_weights=topk_weights, **layout),
        "topk_idx rows": lambda: buffer.dispatch(x[:16], topk_idx=topk_idx, **layout),
        "fp8 hidden not a multiple of 128": lambda: buffer.dispatch(bad_fp8, topk_idx=topk_idx, **layout),
        "counts inconsistent": lambda: buffer.dispatch(
            x, num_tokens_per_rank=per_rank + 1, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert
        ),  # fmt: skip
        "rdma counts inconsistent": lambda: buffer.dispatch(x, num_tokens_per_rdma_rank=per_node_count + 1, **layout),
        "rdma counts shape": lambda: buffer.dispatch(
            x, num_tokens_per_rdma_rank=torch.zeros(ctx.world_size // per_node + 1, dtype=torch.int32), **layout
        ),  # fmt: skip
        "missing layout": lambda: buffer.dispatch(x, topk_idx=topk_idx),
        "cached with top-k": lambda: buffer.dispatch(x, handle=real_handle, topk_idx=topk_idx),
        "hand-made handle (dispatch)": lambda: buffer.dispatch(x, handle=copied_handle),
        "hand-made handle (combine)": lambda: buffer.combine(x, copied_handle),
        "intranode handle": lambda: buffer.combine(x, single_handle),
        "not a handle": lambda: buffer.combine(x, (1, 2, 3)),
        "expert_alignment": lambda: buffer.dispatch(x, topk_idx=topk_idx, expert_alignment=0, **layout),
        "num_worst_tokens": lambda: buffer.dispatch(x, topk_idx=topk_idx, num_worst_tokens=-1, **layout),
        "previous_event type": lambda: buffer.dispatch(x, topk_idx=topk_idx, previous_event=object(), **layout),
    }
    recv_x, _, recv_w, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, E)
    cases.update({
        "combine x rows": lambda: buffer.combine(recv_x[1:], handle),
        "combine x dtype": lambda: buffer.combine(recv_x.long(), handle),
        "combine weights rows": lambda: buffer.combine(recv_x, handle, topk_weights=recv_w[1:]),
        "bias shape": lambda: buffer.combine(recv_x, handle, bias=torch.zeros(31, 128, dtype=torch.bfloat16)),
        "bias dtype": lambda: buffer.combine(recv_x, handle, bias=torch.zeros(32, 128)),
        "cached x rows": lambda: buffer.dispatch(x[1:], handle=handle),
    })  # fmt: skip
    for name, call in cases.items():
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"{name}: no ValueError")
    check_dispatch(ctx, buffer, per_node, 32, 128, E, 2, seed=131)  # still in step with the peers


def _timeout_buffer(ctx, per_node, timeout_s) -> deep_ep.Buffer:
    return deep_ep.Buffer(ctx.group, 1 << 20, explicitly_destroy=True, timeout_s=timeout_s,
                          num_ranks_per_node=per_node)  # fmt: skip


def _destroy_at(buffer: deep_ep.Buffer, release: float) -> None:
    """Destroy only once every rank is done waiting: a destroyed peer would end their waits early (a CommError
    saying so) instead of letting them time out."""
    time.sleep(max(0.0, release - time.perf_counter()))
    buffer.destroy()


def bad_input_on_one_rank_times_out_the_others(ctx, per_node, timeout_s):
    """Rank 1 refuses its input before sending anything; the others time out after about `timeout_s`, naming the
    stage they were waiting in."""
    buffer = _timeout_buffer(ctx, per_node, timeout_s)
    release = time.perf_counter() + 2 * timeout_s + 0.5
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
            return "value-error"
        except deep_ep.CommTimeoutError as error:
            elapsed = time.perf_counter() - start
            assert ctx.rank != 1 and "internode dispatch" in str(error), error
            assert timeout_s <= elapsed < 2 * timeout_s, elapsed
            if "network stage" in str(error):
                assert "count exchange" in str(error) and "rank(s) 1 (at operation" in str(error), error
                return "network"
            assert "node-local stage" in str(error) and "did not arrive" in str(error), error
            return "node-local"
        raise AssertionError("the dispatch succeeded without rank 1")
    finally:
        _destroy_at(buffer, release)


def missing_rank_in_combine_times_out(ctx, per_node, timeout_s, async_finish=False):
    """Rank 0 never joins the combine; the others time out naming the stage they were waiting in. With
    `async_finish` the call returns at once and the event's wait raises the timeout."""
    buffer = _timeout_buffer(ctx, per_node, timeout_s)
    release = time.perf_counter() + 2 * timeout_s + 1.0  # the dispatch before the combine takes a few ms
    try:
        x, topk_idx, topk_weights = make_inputs(ctx, 32, 64, 8, 2, seed=150)
        recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x, topk_idx, topk_weights, 8)
        if ctx.rank == 0:
            return "skipped"
        try:
            start = time.perf_counter()
            _, _, event = buffer.combine(recv_x, handle, async_finish=async_finish)
            assert async_finish and time.perf_counter() - start < timeout_s / 2, "combine returned without rank 0"
            event.current_stream_wait()
        except deep_ep.CommTimeoutError as error:
            message = str(error)
            assert "internode combine" in message, message
            if "node-local stage" in message:
                assert "rank(s) [0] did not arrive" in message and "node 0" in message, message
                return "node-local"
            # The combine starts with the handle identity check over the whole group: it names the missing rank.
            assert "network stage" in message and "rank(s) 0 (at operation" in message, message
            return "network"
        raise AssertionError("combine succeeded without rank 0")
    finally:
        _destroy_at(buffer, release)
