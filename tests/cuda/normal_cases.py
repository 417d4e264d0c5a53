"""Normal-mode cases on the GPU, run as `case(ctx, ...)` in the rank processes of a pool that share GPU 0 (see
test_normal.py): layout, dispatch and combine (bf16, fp32, FP8 with scales; uniform and skewed routing; odd hidden
sizes), num_worst_tokens, combine in FP32 and with bias, async_finish and previous events on the comm stream, SM
counts, CUDA-graph capture, timeouts.

Every case builds host inputs (`gpu.make_inputs`), runs the CUDA buffer on copies of them, copies the results back
and compares them with the references the CPU executor is held to (`mtdeepep.utils.refs` on every rank's gathered
inputs, the bounds of tests/conformance/common.py): dispatch moves bytes, so it must be exact; combine sums in FP32
and rounds once to x's dtype (`assert_combine_close`).

Legend: T tokens on a rank, H hidden, E experts, K top-k, R ranks.
"""

from __future__ import annotations

import time

import torch

import mtdeepep as deep_ep
from mtdeepep.utils import fp8, refs

from ..conformance.common import (
    assert_combine_close,
    gather,
    identity_partials,
    layout_and_dispatch,
    layout_kwargs,
    node_partials_f64,
)
from ..conformance.topology import Topology
from . import gpu

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Hidden sizes per dtype: upstream's 7168 and a size whose rows are no multiple of 16 bytes (the copies' tail).
HIDDEN_SIZES = {torch.bfloat16: (7168, 777), torch.float32: (4096, 1001)}


def topology(ctx) -> Topology:
    """One node of every rank (the conformance helpers' view of an intranode group)."""
    return Topology(ctx.world_size)


def reference(ctx, x, topk_idx, topk_weights, num_experts, expert_alignment=1) -> refs.RefDispatchResult:
    everyone = gather(ctx, (x, topk_idx, topk_weights))
    return refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], num_experts, ctx.rank, expert_alignment)


def check_dispatch(ctx, buffer, x, topk_idx, topk_weights, num_experts, expert_alignment=1, **kwargs):
    """Layout + dispatch of host inputs on the GPU; every output equal to the reference, and the handle's public
    parts (rank prefix matrix, recv_src_idx, is_token_in_rank). Returns `(device outputs, reference)`."""
    x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
    outputs = layout_and_dispatch(buffer, x_d, idx_d, w_d, num_experts, expert_alignment=expert_alignment, **kwargs)
    recv_x, recv_idx, recv_w, counts, handle, _ = outputs
    gpu.assert_on_gpu(recv_x, recv_idx, recv_w)
    ref = reference(ctx, x, topk_idx, topk_weights, num_experts, expert_alignment)
    got_x, got_idx, got_w = gpu.host((recv_x, recv_idx, recv_w))
    assert torch.equal(got_x, ref.recv_x), "recv_x differs from the reference"
    assert torch.equal(got_idx, ref.recv_topk_idx), "recv_topk_idx differs"
    assert torch.equal(got_w, ref.recv_topk_weights), "recv_topk_weights differs"
    assert counts == ref.num_recv_tokens_per_expert, (counts, ref.num_recv_tokens_per_expert)
    rank_prefix_matrix, _, _, recv_src_idx, in_rank, _ = gpu.host(handle)
    assert torch.equal(rank_prefix_matrix, ref.rank_prefix_matrix), "handle: rank_prefix_matrix"
    assert torch.equal(recv_src_idx.long(), ref.recv_src_idx), "handle: recv_src_idx"
    assert torch.equal(in_rank, refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2])
    return outputs, ref


# ---------------------------------------------------------------------------------------------------------------
# Layout, dispatch, combine


def layout_matches_reference(ctx, routing: str):
    """`get_dispatch_layout` at upstream's setting (4096 tokens, top-8 of 256 experts) and a small odd one, sync and
    async, against `refs.ref_dispatch_layout`."""
    buffer = gpu.buffer(ctx)
    for seed, (num_tokens, num_experts, num_topk) in enumerate(((4096, 256, 8), (37 + ctx.rank, 16, 3))):
        _, topk_idx, _ = gpu.make_inputs(ctx, num_tokens, 8, num_experts, num_topk, seed=10 + seed, routing=routing)
        expected = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)
        for async_finish in (False, True):
            previous = deep_ep.Buffer.capture() if async_finish else None
            per_rank, per_node, per_expert, in_rank, event = buffer.get_dispatch_layout(
                gpu.cuda(topk_idx), num_experts, previous_event=previous, async_finish=async_finish,
                allocate_on_comm_stream=async_finish,
            )  # fmt: skip
            event.current_stream_wait()
            gpu.assert_on_gpu(per_rank, per_expert, in_rank)
            assert per_node is None, "one node: num_tokens_per_rdma_rank is None"
            assert per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
            got = gpu.host((per_rank, per_expert, in_rank))
            for name, actual, exp in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"),
                                         got, expected):  # fmt: skip
                assert torch.equal(actual, exp), f"{name} differs ({num_tokens} tokens, async={async_finish})"


def dispatch_combine_match_reference(ctx, dtype_name: str, routing: str):
    """Dispatch with top-k, then combine of per-rank "expert" outputs with the received weights, for each hidden
    size of the dtype; a cached dispatch reuses the layout. Combine's result within one rounding of the FP32 sum."""
    dtype = DTYPES[dtype_name]
    buffer = gpu.buffer(ctx)
    topo = topology(ctx)
    num_experts, num_topk = 64, 6
    num_tokens = 1024 + 37 * ctx.rank
    for seed, hidden in enumerate(HIDDEN_SIZES[dtype]):
        x, topk_idx, topk_weights = gpu.make_inputs(
            ctx, num_tokens, hidden, num_experts, num_topk, seed=20 + seed, dtype=dtype, routing=routing
        )
        (recv_x, _, recv_w, _, handle, _), ref = check_dispatch(ctx, buffer, x, topk_idx, topk_weights, num_experts)
        expert_out = (recv_x.float() * (1.5 + ctx.rank) + 0.25).to(dtype)  # a different "expert" per rank
        combined, combined_w, event = buffer.combine(expert_out, handle, topk_weights=recv_w)
        event.current_stream_wait()
        gpu.assert_on_gpu(combined, combined_w)
        assert combined.shape == (num_tokens, hidden) and combined_w.dtype == torch.float32
        partials = node_partials_f64(ctx, topo, gpu.host(expert_out), ref.recv_src_rank, ref.recv_src_idx, num_tokens)
        assert_combine_close(gpu.host(combined), partials, dtype)
        # The summed weights rebuild the original ones (masked slots are 0 everywhere).
        expected_w = topk_weights.masked_fill(topk_idx < 0, 0.0)
        assert torch.allclose(gpu.host(combined_w), expected_w, rtol=1e-6, atol=0), "combined weights"
        # Cached mode: the handle's layout again, same rows.
        cached, *_ = buffer.dispatch(gpu.cuda(x), handle=handle)
        assert torch.equal(gpu.host(cached), ref.recv_x), "cached dispatch differs"


def expert_alignment_rounds_counts(ctx):
    buffer = gpu.buffer(ctx)
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, 300, 256, 32, 4, seed=30)
    (_, _, _, counts, _, _), ref = check_dispatch(ctx, buffer, x, topk_idx, topk_weights, 32, expert_alignment=64)
    assert all(c % 64 == 0 for c in counts), counts


def fp8_dispatch_with_scales(ctx, routing: str):
    """FP8 rows `(float8_e4m3fn [T, H], float32 scales [T, H / 128])`, scales row- and column-major (upstream passes
    column-major): bytes and scales exactly the reference's, received scales row-major; a cached FP8 dispatch."""
    buffer = gpu.buffer(ctx)
    num_experts, hidden = 64, 7168
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, 512 + 11 * ctx.rank, hidden, num_experts, 8, seed=40,
                                                routing=routing)  # fmt: skip
    e4m3, scales = fp8.per_token_cast_to_fp8(x.float())
    everyone = gather(ctx, (e4m3.view(torch.uint8), scales, topk_idx))
    ref_bytes = refs.ref_dispatch([e[0] for e in everyone], [e[2] for e in everyone], None, num_experts, ctx.rank)
    ref_scales = refs.ref_dispatch([e[1] for e in everyone], [e[2] for e in everyone], None, num_experts, ctx.rank)
    for layout in ("row", "column"):
        s = scales if layout == "row" else scales.T.contiguous().T
        pair = (gpu.cuda(e4m3), gpu.cuda(s))
        (recv_data, recv_scales), recv_idx, recv_w, _, handle, _ = layout_and_dispatch(
            buffer, pair, gpu.cuda(topk_idx), gpu.cuda(topk_weights), num_experts
        )
        gpu.assert_on_gpu(recv_data, recv_scales, recv_idx, recv_w)
        assert recv_data.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
        assert recv_scales.is_contiguous(), "received scales are row-major"
        assert torch.equal(gpu.host(recv_data).view(torch.uint8), ref_bytes.recv_x), f"fp8 bytes ({layout}-major)"
        assert torch.equal(gpu.host(recv_scales), ref_scales.recv_x), f"scales ({layout}-major)"
        (cached_data, cached_scales), *_ = buffer.dispatch(pair, handle=handle)
        assert torch.equal(gpu.host(cached_data).view(torch.uint8), ref_bytes.recv_x), "cached fp8 bytes"
        assert torch.equal(gpu.host(cached_scales), ref_scales.recv_x), "cached scales"


def num_worst_tokens_pads_outputs(ctx):
    """`num_worst_tokens`: outputs sized for the worst case (no host sync for the count); the valid rows first,
    then ids -1 and weights 0; the count list empty; combine through that handle uses only the valid rows."""
    buffer = gpu.buffer(ctx)
    num_tokens, num_experts = 256, 32
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, num_tokens, 512, num_experts, 4, seed=50)
    worst = num_tokens * ctx.world_size
    recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(
        buffer, *gpu.cuda(x, topk_idx, topk_weights), num_experts, num_worst_tokens=worst
    )
    ref = reference(ctx, x, topk_idx, topk_weights, num_experts)
    n = ref.recv_x.size(0)
    got_x, got_idx, got_w = gpu.host((recv_x, recv_idx, recv_w))
    assert got_x.size(0) == got_idx.size(0) == got_w.size(0) == worst and counts == []
    assert torch.equal(got_x[:n], ref.recv_x) and torch.equal(got_idx[:n], ref.recv_topk_idx)
    assert torch.equal(got_w[:n], ref.recv_topk_weights)
    assert bool((got_idx[n:] == -1).all()) and bool((got_w[n:] == 0).all()), "padding rows"
    combined, _, _ = buffer.combine(recv_x, handle)
    in_rank = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2]
    assert_combine_close(gpu.host(combined), identity_partials(topology(ctx), x, in_rank), torch.bfloat16)


def combine_accumulates_in_fp32(ctx):
    """Every token reaches every rank; rank 0 returns 1, the others 2^-8. Summed row by row in bf16 that stays 1
    (1 + 2^-8 rounds to 1); summed in FP32 and rounded once, it is 1 + (R - 1) 2^-8 rounded to bf16."""
    buffer = gpu.buffer(ctx)
    num_experts = ctx.world_size * 2
    topk_idx = torch.arange(0, num_experts, 2).repeat(64, 1)  # every token goes to every rank
    x = torch.ones(64, 256, dtype=torch.bfloat16)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, *gpu.cuda(x, topk_idx), None, num_experts)
    value = 1.0 if ctx.rank == 0 else 2.0**-8
    combined, _, _ = buffer.combine(torch.full_like(recv_x, value), handle)
    expected = torch.tensor(1.0 + (ctx.world_size - 1) * 2.0**-8).bfloat16()
    got = gpu.host(combined)
    assert bool((got == expected).all()), (got[0, 0].item(), expected.item())


def combine_adds_bias(ctx):
    """`bias=(b0, b1)` (either may be None) is added to the FP32 sum before its one rounding."""
    buffer = gpu.buffer(ctx)
    num_tokens, hidden, num_experts = 200, 384, 16
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, num_tokens, hidden, num_experts, 3, seed=60)
    generator = torch.Generator().manual_seed(61 + ctx.rank)
    b0 = torch.randn(num_tokens, hidden, generator=generator).bfloat16()
    b1 = torch.randn(num_tokens, hidden, generator=generator).bfloat16()
    (recv_x, _, _, _, handle, _), _ = check_dispatch(ctx, buffer, x, topk_idx, topk_weights, num_experts)
    in_rank = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2]
    partials = identity_partials(topology(ctx), x, in_rank)
    for bias in ((b0, b1), (b0, None), (None, b1)):
        combined, _, _ = buffer.combine(recv_x, handle, bias=tuple(None if b is None else gpu.cuda(b) for b in bias))
        extra = sum(b.double() for b in bias if b is not None)
        assert_combine_close(gpu.host(combined), partials, torch.bfloat16, extra=extra)


def async_and_previous_event(ctx):
    """The comm stream waits for `previous_event`: x is written on the current stream behind a ~50 ms sleep kernel
    and the async dispatch must still read the new x (without the wait it reads the old random x). The returned
    events make the current stream wait; results as without them."""
    buffer = gpu.buffer(ctx)
    num_experts = 32
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, 512, 1024, num_experts, 4, seed=70)
    stale = torch.randn(x.shape, generator=torch.Generator().manual_seed(71 + ctx.rank)).bfloat16()
    ref = reference(ctx, x, topk_idx, topk_weights, num_experts)
    x_d, idx_d, w_d = gpu.cuda(stale, topk_idx, topk_weights)
    x_new = gpu.cuda(x)
    gpu.barrier(ctx)
    gpu.sleep_on_stream(100_000_000)  # ~50 ms of GPU clock cycles on the current stream
    x_d.copy_(x_new)
    previous = deep_ep.Buffer.capture()
    per_rank, per_node, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(
        idx_d, num_experts, previous_event=previous, async_finish=True, allocate_on_comm_stream=True
    )
    recv_x, recv_idx, _, _, handle, dispatch_event = buffer.dispatch(
        x_d, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx_d, topk_weights=w_d, previous_event=layout_event,
        async_finish=True, allocate_on_comm_stream=True,
    )  # fmt: skip
    combined, _, combine_event = buffer.combine(
        recv_x, handle, previous_event=dispatch_event, async_finish=True, allocate_on_comm_stream=True
    )
    combine_event.current_stream_wait()
    dispatch_event.current_stream_wait()
    got_x, got_idx, got_combined = gpu.host((recv_x, recv_idx, combined))  # ordered after the waits
    assert torch.equal(got_x, ref.recv_x), "the async dispatch did not wait for previous_event (stale rows)"
    assert torch.equal(got_idx, ref.recv_topk_idx)
    in_rank_ref = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2]
    assert_combine_close(got_combined, identity_partials(topology(ctx), x, in_rank_ref), torch.bfloat16)
    gpu.synchronize()
    assert layout_event.query() and dispatch_event.query() and combine_event.query()


def sm_counts_agree(ctx):
    """The kernels take the configured number of SMs (`Config.num_sms`, channels = SMs / 2): the same results at
    2, 8, 24 and the GPU's share of every rank (its SMs / R, rounded down to even). The ranks share one GPU and their
    kernels wait for each other, so together they must fit on it: R x num_sms <= the GPU's SMs."""
    buffer = gpu.buffer(ctx)
    num_experts, num_tokens = 64, 2048
    share = torch.cuda.get_device_properties(gpu.DEVICE_INDEX).multi_processor_count // ctx.world_size // 2 * 2
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, num_tokens, 2048, num_experts, 8, seed=80, routing="skewed")
    in_rank = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2]
    partials = identity_partials(topology(ctx), x, in_rank)
    for num_sms in sorted({2, 8, min(24, share), share}):
        config = deep_ep.Config(num_sms, 6, 256, 6, 128)
        (recv_x, _, _, _, handle, _), _ = check_dispatch(ctx, buffer, x, topk_idx, topk_weights, num_experts,
                                                         config=config)  # fmt: skip
        combined, _, _ = buffer.combine(recv_x, handle, config=config)
        assert_combine_close(gpu.host(combined), partials, torch.bfloat16)


def device_mismatch_raises_value_error(ctx):
    """Host tensors given to a CUDA buffer are refused with a ValueError before any communication."""
    buffer = gpu.buffer(ctx)
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, 16, 128, 8, 2, seed=90)
    calls = {
        "layout with host topk_idx": lambda: buffer.get_dispatch_layout(topk_idx, 8),
        "dispatch with host x": lambda: buffer.dispatch(x, **layout_kwargs(buffer, gpu.cuda(topk_idx), 8)),
    }
    for name, call in calls.items():
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"{name}: no ValueError")
    gpu.barrier(ctx)


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs


def cuda_graph_dispatch_combine(ctx, layout_in_graph: bool):
    """Normal-mode dispatch + a toy expert (x 2, exact in bf16) + combine captured in one CUDA graph with
    `num_worst_tokens` fixed (no host synchronisation on that path), then replayed on three different inputs copied
    into the captured tensors; each replay against the reference. With `layout_in_graph` the layout is captured too
    (routing changes between replays); else it is computed eagerly into the captured layout tensors."""
    buffer = gpu.buffer(ctx)
    num_tokens, hidden, num_experts, num_topk = 256, 1024, 32, 4
    worst = num_tokens * ctx.world_size
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed=100)
    x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
    layout = list(buffer.get_dispatch_layout(idx_d, num_experts)[:4])  # captured layout tensors (eager variant)

    def step():
        per_rank, per_node, per_expert, in_rank = (
            buffer.get_dispatch_layout(idx_d, num_experts)[:4] if layout_in_graph else layout
        )
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x_d, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx_d, topk_weights=w_d, num_worst_tokens=worst,
        )  # fmt: skip
        combined, _, _ = buffer.combine(recv_x * 2, handle)
        return recv_x, recv_idx, combined

    # Warm-up on a side stream (as torch.cuda.graphs requires), every rank together.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    gpu.synchronize()
    gpu.barrier(ctx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_idx, combined = step()
    gpu.barrier(ctx)
    for replay in range(3):
        x, topk_idx, topk_weights = gpu.make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed=101 + replay)
        x_d.copy_(gpu.cuda(x))
        idx_d.copy_(gpu.cuda(topk_idx))
        w_d.copy_(gpu.cuda(topk_weights))
        if not layout_in_graph:
            for captured, fresh in zip(layout, buffer.get_dispatch_layout(idx_d, num_experts)[:4]):
                if captured is not None:
                    captured.copy_(fresh)
        gpu.synchronize()
        gpu.barrier(ctx)  # every rank replays the same step
        graph.replay()
        gpu.synchronize()
        ref = reference(ctx, x, topk_idx, topk_weights, num_experts)
        n = ref.recv_x.size(0)
        got_x, got_idx, got_combined = gpu.host((recv_x, recv_idx, combined))
        assert torch.equal(got_x[:n], ref.recv_x), f"replay {replay}: recv_x"
        assert torch.equal(got_idx[:n], ref.recv_topk_idx) and bool((got_idx[n:] == -1).all()), f"replay {replay}"
        in_rank = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2]
        assert_combine_close(got_combined, 2 * identity_partials(topology(ctx), x, in_rank), torch.bfloat16)
        gpu.barrier(ctx)  # nobody overwrites inputs a peer's replay still reads
    del graph


# ---------------------------------------------------------------------------------------------------------------
# Timeouts: device-side waits are bounded and become host-side CommTimeoutErrors naming the rank


def _destroy_at(buffer: deep_ep.Buffer, release: float) -> None:
    """Destroy only once every rank is done waiting (a destroyed peer would end their waits early)."""
    time.sleep(max(0.0, release - time.perf_counter()))
    buffer.destroy()


def _gpu_still_works(ctx) -> None:
    """After a timeout the GPU is not hung: a synchronisation returns and a fresh dispatch on another buffer is
    right."""
    gpu.synchronize()
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, 64, 256, 16, 2, seed=119)
    check_dispatch(ctx, gpu.buffer(ctx, "after-timeout", 16 << 20), x, topk_idx, topk_weights, 16)


def missing_rank_in_dispatch_times_out(ctx, timeout_s: float):
    """Rank 1 never joins the dispatch; the others raise CommTimeoutError naming rank 1 after about `timeout_s`;
    then every rank uses the GPU again."""
    buffer = gpu.new_buffer(ctx, 16 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    release = time.perf_counter() + 2 * timeout_s + 2.0
    outcome = "skipped"
    try:
        x, topk_idx, topk_weights = gpu.make_inputs(ctx, 128, 512, 16, 2, seed=110)
        if ctx.rank != 1:
            start = time.perf_counter()
            try:
                layout_and_dispatch(buffer, *gpu.cuda(x, topk_idx, topk_weights), 16)
                gpu.synchronize()
            except deep_ep.CommTimeoutError as error:
                elapsed = time.perf_counter() - start
                assert 0.8 * timeout_s <= elapsed < 2 * timeout_s + 1.0, elapsed
                outcome = f"timeout {gpu.named_ranks(str(error)) or str(error)}"
            else:
                raise AssertionError("the dispatch succeeded without rank 1")
    finally:
        _destroy_at(buffer, release)
    gpu.barrier(ctx)
    _gpu_still_works(ctx)
    return outcome


def first_timeout(steps, kind: type[Exception] = deep_ep.CommTimeoutError) -> Exception | None:
    """Runs `steps` in order until one raises `kind` (CommTimeoutError by default); returns it (None if none did).

    Where the host learns of a device-side error depends on the call: a dispatch that returns counts syncs in the
    call; an async call raises at its event's wait; a synchronous GPU call that does not sync the host raises at the
    latest at the buffer's next call. The steps are those points in that order.
    """
    for step in steps:
        try:
            step()
        except kind as error:
            return error
    return None


# ---------------------------------------------------------------------------------------------------------------
# Errors every rank finds alike: raised everywhere, the buffer stays usable


def num_worst_tokens_too_small_raises_on_every_rank(ctx):
    """Receivers over `num_worst_tokens` (their outputs would drop rows): every rank raises GroupMismatchError naming
    the bound, in the call where it synchronises the host, else at the buffer's next call; nothing moves, and the
    buffer is usable afterwards (a correct dispatch on it, then a cached dispatch over a too-small bound too)."""
    buffer = gpu.buffer(ctx, "worst", 16 << 20)
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, 100, 128, 8, 4, seed=51, masked=0.0)
    x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
    for attempt in range(2):  # twice: the first error must not leave a trace
        error = first_timeout([
            lambda: layout_and_dispatch(buffer, x_d, idx_d, w_d, 8, num_worst_tokens=10),
            gpu.synchronize,
            lambda: buffer.get_dispatch_layout(idx_d, 8),
        ], deep_ep.GroupMismatchError)  # fmt: skip
        assert error is not None, f"attempt {attempt}: no GroupMismatchError for num_worst_tokens=10"
        assert "num_worst_tokens=10" in str(error), str(error)
        gpu.barrier(ctx)
    (_, _, _, _, handle, _), _ = check_dispatch(ctx, buffer, x, topk_idx, topk_weights, 8)
    error = first_timeout([
        lambda: buffer.dispatch(x_d, handle=handle, num_worst_tokens=10),
        gpu.synchronize,
        lambda: buffer.get_dispatch_layout(idx_d, 8),
    ], deep_ep.GroupMismatchError)  # fmt: skip
    assert error is not None, "cached dispatch: no GroupMismatchError for num_worst_tokens=10"
    gpu.barrier(ctx)
    check_dispatch(ctx, buffer, x, topk_idx, topk_weights, 8)


def small_region_raises_on_every_rank(ctx):
    """A receive region too small for one operation's rows (the CUDA executor moves an operation in one round):
    every rank raises CommError saying how many rows and what the region holds, before any row moves; the buffer
    stays usable for operations that fit. GPU only (the CPU executor moves such payloads in several rounds)."""
    buffer = gpu.buffer(ctx, "tiny", 1 << 20)
    x, topk_idx, topk_weights = gpu.make_inputs(ctx, 512, 2048, 8, 4, seed=52, masked=0.0)  # ~4 KiB rows
    x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
    try:
        layout_and_dispatch(buffer, x_d, idx_d, w_d, 8)
    except deep_ep.CommError as error:
        assert not isinstance(error, deep_ep.CommTimeoutError), str(error)
        assert "raise num_nvl_bytes" in str(error), str(error)
    else:
        raise AssertionError("a dispatch larger than the region did not raise")
    gpu.barrier(ctx)
    small = gpu.make_inputs(ctx, 16, 2048, 8, 2, seed=53)
    check_dispatch(ctx, buffer, *small, 8)


# ---------------------------------------------------------------------------------------------------------------
# Races: many rounds back to back, a peer held back


def rounds_with_a_peer_ahead(ctx, rounds: int):
    """`rounds` dispatch + combine rounds back to back with no host synchronisation (`num_worst_tokens`, value
    checks skipped), new inputs every round, while one rank (another every 16 rounds) is held back before its round
    by a sleep kernel on its stream, so that its peers run ahead into the next operations. Every round's outputs are
    kept and checked afterwards against the references: a flag read too early, a region rewritten before its reader
    finished, or rows of another round show as wrong rows."""
    buffer = gpu.buffer(ctx, "rounds", 32 << 20)
    hidden, num_experts, num_topk = 256, 16, 4
    kept = []
    with deep_ep.skip_value_checks():
        for i in range(rounds):
            num_tokens = 64 + (7 * i + 3 * ctx.rank) % 29
            x, topk_idx, topk_weights = gpu.make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed=2000 + i)
            x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
            if ctx.rank == (i // 16) % ctx.world_size:
                gpu.sleep_on_stream(400_000)  # ~0.2 ms: the peers enter the round (and the next ones) first
            recv_x, recv_idx, _, _, handle, _ = layout_and_dispatch(
                buffer, x_d, idx_d, w_d, num_experts, num_worst_tokens=93 * ctx.world_size
            )
            combined, _, _ = buffer.combine(recv_x, handle)
            kept.append((x, topk_idx, topk_weights, recv_x, recv_idx, combined))
    gpu.synchronize()
    gpu.barrier(ctx)
    for i, (x, topk_idx, topk_weights, recv_x, recv_idx, combined) in enumerate(kept):
        ref = reference(ctx, x, topk_idx, topk_weights, num_experts)
        n = ref.recv_x.size(0)
        got_x, got_idx, got_combined = gpu.host((recv_x, recv_idx, combined))
        assert torch.equal(got_x[:n], ref.recv_x), f"round {i}: recv_x"
        assert torch.equal(got_idx[:n], ref.recv_topk_idx), f"round {i}: recv_topk_idx"
        in_rank = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2]
        assert_combine_close(got_combined, identity_partials(topology(ctx), x, in_rank), torch.bfloat16)
    return len(kept)


def missing_rank_in_combine_times_out(ctx, timeout_s: float, async_finish: bool):
    """Rank 0 never joins the combine; the others get CommTimeoutError naming rank 0 (at the latest at the buffer's
    next call); then every rank uses the GPU again."""
    buffer = gpu.new_buffer(ctx, 16 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    release = time.perf_counter() + 2 * timeout_s + 2.0
    outcome = "skipped"
    try:
        x, topk_idx, topk_weights = gpu.make_inputs(ctx, 128, 512, 16, 2, seed=120)
        x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
        recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x_d, idx_d, w_d, 16)
        if ctx.rank != 0:
            state = {}

            def call():
                start = time.perf_counter()
                state["event"] = buffer.combine(recv_x, handle, async_finish=async_finish)[2]
                assert time.perf_counter() - start < timeout_s / 2 or not async_finish, "async combine blocked"

            error = first_timeout([
                call,
                lambda: state["event"].current_stream_wait(),
                gpu.synchronize,
                lambda: buffer.get_dispatch_layout(idx_d, 16),
            ])  # fmt: skip
            assert error is not None, "combine succeeded without rank 0"
            outcome = f"timeout {gpu.named_ranks(str(error)) or str(error)}"
    finally:
        _destroy_at(buffer, release)
    gpu.barrier(ctx)
    _gpu_still_works(ctx)
    return outcome
