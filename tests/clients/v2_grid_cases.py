"""Upstream's V2 test semantics (`tests/elastic/test_ep.py`) on `mtdeepep.ElasticBuffer`, with a reference of our own.

The mode grid of upstream's `enumerate_ep_modes()` (handle copy, expert alignment 128 / 1, FP8 dispatch, 0 / 1 / 2
biases, previous event, `async_with_compute_stream`, `allocate_on_comm_stream`), on unbalanced routing with masked
(-1) slots; per mode: dispatch, expanded dispatch (column-major FP8 scales), cached dispatch, cached expanded
dispatch with zero padding, combine and reduced (expanded) combine, cumulative statistics, and a second dispatch that
must be identical (`--deterministic`); optionally without CPU sync. Every output is compared bitwise, as upstream
compares it, against the reference below, which follows upstream's documented layout:

- dispatch: rows sorted by source global token index `src_rank * C + token` (`mtdeepep.utils.refs.ref_dispatch`);
- combine inputs: a received row carries, per top-k slot, a bf16 function of (global token index, slot, channel);
  a rank sums the slots of its experts in FP32 in slot order and rounds to bf16 (upstream's `ordered_accumulate`);
- combined result: per token, those per-rank partials (on several nodes, first summed per node and rounded to bf16:
  upstream's hybrid recipe), each placed at the last slot of its group, accumulated in FP32 in slot order on top of
  the biases' FP32 sum, rounded once to bf16 (upstream's `refs.combine`).

Every rank derives every rank's inputs from the seed, so the reference needs no communication.
"""

from __future__ import annotations

import itertools

import torch

import mtdeepep as deep_ep
from mtdeepep.elastic import ElasticBuffer
from mtdeepep.utils import fp8 as fp8_utils
from mtdeepep.utils import refs

HIDDEN = 256  # two FP8 scale blocks
NUM_TOPK = 4


def enumerate_ep_modes():
    """Upstream's grid: (do_handle_copy, expert_alignment, use_fp8_dispatch, num_bias, with_previous_event,
    async_with_compute_stream, allocate_on_comm_stream); 144 modes."""
    for copy, alignment, fp8, num_bias, previous in itertools.product((1, 0), (128, 1), (1, 0), (0, 1, 2), (0, 1)):
        for async_mode in (0, 1):
            for on_comm_stream in (1,) if previous else (0, 1):
                yield copy, alignment, fp8, num_bias, previous, async_mode, on_comm_stream


def _inputs(rank: int, num_ranks: int, capacity: int, num_experts: int, mode_idx: int, num_bias: int):
    """Rank `rank`'s tokens for one mode: bf16 `x`, unbalanced routing (the first rank's experts hot) with ~10%
    masked slots (weights 0 there, as upstream), biases."""
    generator = torch.Generator().manual_seed(mode_idx * 1000 + rank)
    num_tokens = max(1, capacity - rank)
    x = torch.randn(num_tokens, HIDDEN, generator=generator, dtype=torch.float32).bfloat16()
    skew = torch.logspace(1.5, -1.5, num_experts, base=2.0, dtype=torch.float32)
    scores = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float32) * skew
    topk_weights, topk_idx = torch.topk(scores, NUM_TOPK, dim=-1, sorted=False)
    masked = torch.rand(num_tokens, NUM_TOPK, generator=generator, dtype=torch.float32) < 0.1
    topk_idx = topk_idx.masked_fill(masked, -1)
    topk_weights = topk_weights.masked_fill(masked, 0.0)
    biases = tuple(
        torch.randn(num_tokens, HIDDEN, generator=generator, dtype=torch.float32).bfloat16() for _ in range(num_bias)
    )
    bias = None if num_bias == 0 else biases[0] if num_bias == 1 else biases
    return x, topk_idx, topk_weights, bias


def pre_combine_rows(global_idx: torch.Tensor, num_topk: int) -> torch.Tensor:
    """`[n, K, H]` bf16: the value an expert returns for (global token, slot, channel); a fixed function of them."""
    seeds = (global_idx.long().unsqueeze(1) * num_topk + torch.arange(num_topk, dtype=torch.int64)).double()
    channels = torch.arange(1, HIDDEN + 1, dtype=torch.float64)
    return torch.sin(seeds.unsqueeze(-1) * 0.618 + channels * 0.037).float().bfloat16()


def _slot_sum(values: torch.Tensor) -> torch.Tensor:
    """FP32 sum over dim 1 in slot order, rounded to bf16 (upstream's `ordered_accumulate`)."""
    acc = torch.zeros(values.size(0), values.size(2), dtype=torch.float32)
    for j in range(values.size(1)):
        acc += values[:, j].float()
    return acc.bfloat16()


def _grouped(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each group's FP32 slot-order sum, rounded to bf16, placed at the group's last slot (0 elsewhere)."""
    out = torch.zeros_like(values)
    num_topk = values.size(1)
    for j in range(num_topk):
        same = groups == groups[:, j : j + 1]  # [T, K]
        last = ~same[:, j + 1 :].any(dim=1)
        total = _slot_sum(values * same.unsqueeze(-1))
        out[:, j] = torch.where(last.unsqueeze(-1), total, torch.zeros_like(total))
    return out


def reference_combine(global_idx, topk_idx, num_local_experts, ranks_per_node, num_nodes, bias) -> torch.Tensor:
    y = pre_combine_rows(global_idx, topk_idx.size(1)).masked_fill((topk_idx < 0).unsqueeze(-1), 0.0)
    dest_rank = torch.div(topk_idx, num_local_experts, rounding_mode="floor")
    y = _grouped(y, dest_rank)
    if num_nodes > 1:
        y = _grouped(y, torch.div(dest_rank, ranks_per_node, rounding_mode="floor"))
    acc = torch.zeros(y.size(0), y.size(2), dtype=torch.float32)
    for b in () if bias is None else bias if isinstance(bias, tuple) else (bias,):
        acc += b.float()
    for j in range(y.size(1)):
        acc += y[:, j].float()
    return acc.bfloat16()


def _bf16(recv_x):
    return fp8_utils.per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x


def _launch(buffer: ElasticBuffer, name: str, previous: int, async_mode: int, **params):
    if previous:
        params["previous_event"] = buffer.capture()
    values = getattr(buffer, name)(**params)
    if async_mode:
        values[-1].current_stream_wait()
    return values


def v2_mode_grid_matches_reference(ctx, num_ranks_per_node=None, mode_stride: int = 1, do_cpu_sync: bool = True,
                                   fp8_values: tuple[int, ...] = (0, 1)):  # fmt: skip
    """Every `mode_stride`-th mode of the grid (see the module docstring) whose FP8 flag is in `fp8_values`, each
    output bitwise against the reference."""
    capacity, num_ranks = 48, ctx.world_size
    num_experts = 4 * num_ranks
    num_local = num_experts // num_ranks
    key = f"v2-grid-{num_ranks_per_node}"
    if key not in ctx.cache:
        ctx.cache[key] = ElasticBuffer(ctx.group, num_max_tokens_per_rank=capacity, hidden=HIDDEN, num_topk=NUM_TOPK,
                                       use_fp8_dispatch=True, num_ranks_per_node=num_ranks_per_node)  # fmt: skip
    buffer = ctx.cache[key]
    num_nodes, per_node = buffer.get_logical_domain_size()
    checked = []
    for mode_idx, mode in enumerate(enumerate_ep_modes()):
        if mode_idx % mode_stride:
            continue
        copy, alignment, use_fp8, num_bias, previous, async_mode, on_comm = mode
        if use_fp8 not in fp8_values:
            continue
        everyone = [_inputs(r, num_ranks, capacity, num_experts, mode_idx, num_bias) for r in range(num_ranks)]
        x, topk_idx, topk_weights, bias = everyone[ctx.rank]
        num_tokens = x.size(0)
        x_in = fp8_utils.per_token_cast_to_fp8(x) if use_fp8 else x
        xs = [fp8_utils.per_token_cast_back(*fp8_utils.per_token_cast_to_fp8(e[0])) if use_fp8 else e[0]
              for e in everyone]  # fmt: skip
        ref = refs.ref_dispatch(xs, [e[1] for e in everyone], [e[2] for e in everyone], num_experts, ctx.rank)
        ref_per_source = torch.bincount(ref.recv_src_rank, minlength=num_ranks)
        common = dict(
            num_max_tokens_per_rank=capacity, num_experts=num_experts, expert_alignment=alignment,
            allocate_on_comm_stream=bool(on_comm), do_handle_copy=bool(copy), do_cpu_sync=do_cpu_sync,
        )  # fmt: skip
        recv_x, recv_idx, recv_w, handle, _ = _launch(
            buffer, "dispatch", previous, async_mode, x=x_in, topk_idx=topk_idx, topk_weights=topk_weights,
            async_with_compute_stream=bool(async_mode), **common,
        )  # fmt: skip
        exp_x, exp_idx, exp_w, exp_handle, _ = _launch(
            buffer, "dispatch", previous, async_mode, x=x_in, topk_idx=topk_idx, topk_weights=topk_weights,
            async_with_compute_stream=bool(async_mode), do_expand=True, use_tma_aligned_col_major_sf=True, **common,
        )  # fmt: skip
        cached_x, cached_idx, _, cached_handle, _ = _launch(
            buffer, "dispatch", previous, async_mode, x=x_in, handle=handle,
            async_with_compute_stream=bool(async_mode), allocate_on_comm_stream=bool(on_comm),
        )  # fmt: skip
        cexp_x, _, cexp_w, _, _ = _launch(
            buffer, "dispatch", previous, async_mode, x=x_in, handle=exp_handle, topk_weights=topk_weights,
            do_expand=True, use_tma_aligned_col_major_sf=True, do_zero_padding=True,
            async_with_compute_stream=bool(async_mode), allocate_on_comm_stream=bool(on_comm),
        )  # fmt: skip
        num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        assert num_recv == int(exp_handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == ref.recv_x.size(0)
        where = f"rank {ctx.rank}, mode {mode_idx} {mode}"

        # Handle copy, cached outputs, counts.
        assert (topk_idx.data_ptr() != handle.topk_idx.data_ptr()) == bool(copy), where
        assert handle.topk_idx.data_ptr() == cached_handle.topk_idx.data_ptr()
        assert exp_idx is None and exp_handle.recv_src_metadata.size(0) == handle.recv_src_metadata.size(0)
        for got, cached in ((recv_x, cached_x), (recv_idx, cached_idx)):
            pairs = zip(got, cached) if isinstance(got, tuple) else ((got, cached),)
            assert all(torch.equal(a[:num_recv], b[:num_recv]) for a, b in pairs), where
        counts = [int((ref.recv_topk_idx == e).sum()) for e in range(num_local)]
        if do_cpu_sync:
            assert handle.num_recv_tokens_per_expert_list == [refs.align_up(c, alignment) for c in counts], where
        psum = [0] + handle.psum_num_recv_tokens_per_expert.tolist()
        exp_psum = [0] + exp_handle.psum_num_recv_tokens_per_expert.tolist()
        for e, count in enumerate(counts):
            assert psum[e + 1] - psum[e] == refs.align_up(count, alignment), where
            assert exp_psum[e + 1] - refs.align_up(exp_psum[e], alignment) == count, where
        scaleup = [0] + handle.psum_num_recv_tokens_per_scaleup_rank.tolist()
        for peer in range(per_node):
            assert scaleup[peer + 1] - scaleup[peer] == int(ref_per_source[peer::per_node].sum()), where

        # Dispatch rows, bitwise, in the order of the source global token index (upstream sorts by it).
        global_idx = ref.recv_src_rank * capacity + ref.recv_src_idx
        order = torch.sort(handle.recv_src_metadata[:num_recv, 0].long()).indices
        assert torch.equal(handle.recv_src_metadata[:num_recv, 0].long()[order], global_idx), where
        assert torch.equal(_bf16(recv_x)[:num_recv][order], ref.recv_x), where
        assert torch.equal(recv_idx[:num_recv][order], ref.recv_topk_idx), where
        assert torch.equal(recv_w[:num_recv][order].masked_fill(ref.recv_topk_idx < 0, 0), ref.recv_topk_weights)
        # Expanded rows: each (row, local slot) at its slot of the expanded layout; cached-expanded the same rows
        # and zeros in the alignment gaps.
        slots = exp_handle.recv_src_metadata[:num_recv, 2:].long()
        valid = slots >= 0
        rows, topk_slots = valid.nonzero(as_tuple=True)
        exp_rows = _bf16(exp_x)[slots[valid]]
        assert torch.equal(exp_rows, ref.recv_x[rows]), where
        assert torch.equal(exp_w[slots[valid]], ref.recv_topk_weights[rows, topk_slots]), where
        assert torch.equal(_bf16(cexp_x)[slots[valid]], exp_rows) and torch.equal(
            cexp_w[slots[valid]], exp_w[slots[valid]]
        )
        for e in range(num_local):
            start, end = exp_psum[e + 1], refs.align_up(exp_psum[e + 1], alignment)
            assert bool((_bf16(cexp_x)[start:end] == 0).all()) and bool((cexp_w[start:end] == 0).all()), where

        # Combine and reduced combine, bitwise.
        local_y = pre_combine_rows(handle.recv_src_metadata[:num_recv, 0], NUM_TOPK)
        local_y = local_y.masked_fill((recv_idx[:num_recv] < 0).unsqueeze(-1), 0.0)
        combine_in = torch.zeros(handle.num_recv_tokens, HIDDEN, dtype=torch.bfloat16)
        combine_in[:num_recv] = _slot_sum(local_y)
        exp_y = pre_combine_rows(exp_handle.recv_src_metadata[:num_recv, 0], NUM_TOPK)
        reduced_in = torch.zeros(exp_handle.num_expanded_tokens + 1, HIDDEN, dtype=torch.bfloat16)
        reduced_in[exp_handle.recv_src_metadata[:num_recv, 2:].flatten().long()] = exp_y.view(-1, HIDDEN)
        reduced_in = reduced_in[:-1]
        combined, combined_w, _ = _launch(
            buffer, "combine", previous, async_mode, x=combine_in, handle=handle, topk_weights=recv_w, bias=bias,
            async_with_compute_stream=bool(async_mode), allocate_on_comm_stream=bool(on_comm),
        )  # fmt: skip
        reduced, reduced_w, _ = _launch(
            buffer, "combine", previous, async_mode, x=reduced_in, handle=exp_handle, topk_weights=exp_w, bias=bias,
            async_with_compute_stream=bool(async_mode), allocate_on_comm_stream=bool(on_comm),
        )  # fmt: skip
        my_global = ctx.rank * capacity + torch.arange(num_tokens, dtype=torch.int64)
        expected = reference_combine(my_global, topk_idx, num_local, per_node, num_nodes, bias)
        assert torch.equal(combined, expected), (
            f"{where}: combine, max diff {(combined.float() - expected.float()).abs().max()}"
        )
        assert torch.equal(reduced, expected), f"{where}: reduced combine"
        assert torch.equal(combined_w, topk_weights) and torch.equal(reduced_w, topk_weights), where

        # Cumulative statistics and a second, identical dispatch (deterministic).
        stats = torch.zeros(num_local, dtype=torch.int32)
        again_x, again_idx, again_w, again_handle, _ = buffer.dispatch(
            x_in, topk_idx=topk_idx, topk_weights=topk_weights, cumulative_local_expert_recv_stats=stats, **common
        )
        stats_before = stats.clone()
        buffer.dispatch(x_in, topk_idx=topk_idx, topk_weights=topk_weights, cumulative_local_expert_recv_stats=stats,
                        **common)  # fmt: skip
        assert stats_before.tolist() == counts and (stats - stats_before).tolist() == counts, where
        assert torch.equal(_bf16(again_x)[:num_recv], _bf16(recv_x)[:num_recv]), where
        assert torch.equal(again_idx[:num_recv], recv_idx[:num_recv]) and torch.equal(
            again_w[:num_recv], recv_w[:num_recv]
        )
        assert torch.equal(again_handle.recv_src_metadata[:num_recv, :1], handle.recv_src_metadata[:num_recv, :1])
        checked.append(mode_idx)
    return checked


def fp8_internode_dispatch_with_an_idle_rank(ctx):
    """2 nodes x 2 ranks, FP8 dispatch, routing that sends nothing to rank 3 (as the grid's unbalanced routing of
    mode 5 does), through V2's `ElasticBuffer` and V1's `Buffer`: the received E4M3 bytes and scales bitwise against
    the reference, rank 3 receiving none. (A rank whose outputs could not be placed in its region, as one with no
    rows, used to hand the node-local stage rows of another format than its peers: GroupMismatchError.) On a group
    of its own with a 2 s timeout, so that a failure stays cheap and isolated."""
    num_tokens, num_experts = 32, 16
    everyone = []
    for rank in range(ctx.world_size):
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(num_tokens, HIDDEN, generator=generator, dtype=torch.float32).bfloat16()
        topk_idx = torch.stack([torch.randperm(12, generator=generator)[:NUM_TOPK] for _ in range(num_tokens)])
        everyone.append((fp8_utils.per_token_cast_to_fp8(x), topk_idx))  # experts 0-11: ranks 0-2 only
    (x_e4m3, x_scales), topk_idx = everyone[ctx.rank]
    topks = [e[1] for e in everyone]
    ref_bytes = refs.ref_dispatch([e[0][0].view(torch.uint8) for e in everyone], topks, None, num_experts, ctx.rank)
    ref_scales = refs.ref_dispatch([e[0][1] for e in everyone], topks, None, num_experts, ctx.rank).recv_x
    assert (ref_bytes.recv_x.size(0) == 0) == (ctx.rank == 3)

    group = torch.distributed.new_group(list(range(ctx.world_size)))
    elastic = ElasticBuffer(group, num_max_tokens_per_rank=num_tokens, hidden=HIDDEN, num_topk=NUM_TOPK,
                            use_fp8_dispatch=True, num_ranks_per_node=2, num_cpu_timeout_secs=2,
                            explicitly_destroy=True)  # fmt: skip
    try:
        (recv_x, recv_scales), recv_idx, _, handle, _ = elastic.dispatch(
            (x_e4m3, x_scales), topk_idx=topk_idx, num_experts=num_experts
        )
        num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        order = torch.sort(handle.recv_src_metadata[:num_recv, 0].long()).indices
        assert torch.equal(recv_x[:num_recv][order].view(torch.uint8), ref_bytes.recv_x), f"rank {ctx.rank}: V2"
        assert torch.equal(recv_scales[:num_recv][order], ref_scales), f"rank {ctx.rank}: V2 scales"
        assert torch.equal(recv_idx[:num_recv][order], ref_bytes.recv_topk_idx), f"rank {ctx.rank}: V2 top-k"
    finally:
        elastic.destroy()

    buffer = deep_ep.Buffer(group, 1 << 22, num_ranks_per_node=2, timeout_s=2, explicitly_destroy=True)
    try:
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        (recv_x, recv_scales), recv_idx, _, counts, _, _ = buffer.dispatch(
            (x_e4m3, x_scales), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
        )  # fmt: skip
        assert torch.equal(recv_x.view(torch.uint8), ref_bytes.recv_x), f"rank {ctx.rank}: V1"
        assert torch.equal(recv_scales, ref_scales), f"rank {ctx.rank}: V1 scales"
        assert torch.equal(recv_idx, ref_bytes.recv_topk_idx) and counts == ref_bytes.num_recv_tokens_per_expert
    finally:
        buffer.destroy()
