"""Normal-mode cases only a GPU has, run as `case(ctx, ...)` in the ranks that share GPU 0 (see test_normal.py):
SM counts, host tensors refused by a CUDA buffer, a receive region too small for one round, CUDA-graph capture,
many rounds with a peer held back by a sleeping stream. The cases both executors share (layout, dispatch, combine,
FP8, num_worst_tokens, events, timeouts) are the conformance cases of tests/conformance/normal_cases.py, which the
GPU tests run with the GPU placement (`topology`).

Every case builds host inputs (`make_inputs` of the conformance helpers), runs the CUDA buffer on copies of them,
copies the results back and compares them with the references the CPU executor is held to (`mtdeepep.utils.refs`
on every rank's gathered inputs, the bounds of tests/conformance/common.py).

Legend: T tokens on a rank, H hidden, E experts, K top-k, R ranks.
"""

from __future__ import annotations

import torch

import mtdeepep as deep_ep

from ..conformance.common import (
    assert_combine_close,
    barrier,
    check_dispatch,
    identity_partials,
    layout_and_dispatch,
    layout_kwargs,
    make_inputs,
    reference_dispatch,
    tokens_in_rank,
)
from ..conformance.placement import CUDA
from ..conformance.topology import Topology
from . import gpu


def topology(world_size: int) -> Topology:
    """One node of `world_size` ranks on GPU 0: the conformance cases' view of the GPU ranks."""
    return Topology(world_size, placement=CUDA)


def sm_counts_agree(ctx):
    """The kernels take the configured number of SMs (`Config.num_sms`, channels = SMs / 2): the same results at
    2, 8, 24 and the GPU's share of every rank (its SMs / R, rounded down to even). The ranks share one GPU and their
    kernels wait for each other, so together they must fit on it: R x num_sms <= the GPU's SMs."""
    topo = topology(ctx.world_size)
    buffer = topo.buffer(ctx)
    share = torch.cuda.get_device_properties(gpu.DEVICE_INDEX).multi_processor_count // ctx.world_size // 2 * 2
    for num_sms in sorted({2, 8, min(24, share), share}):
        config = deep_ep.Config(num_sms, 6, 256, 6, 128)
        d = check_dispatch(ctx, topo, buffer, 2048, 2048, 64, 8, seed=80, routing="skewed", config=config)
        combined, _, _ = buffer.combine(d.recv_x, d.handle, config=config)
        assert_combine_close(gpu.host(combined), identity_partials(topo, d.x, d.in_rank), torch.bfloat16)


def device_mismatch_raises_value_error(ctx):
    """Host tensors given to a CUDA buffer are refused with a ValueError before any communication."""
    buffer = topology(ctx.world_size).buffer(ctx)
    x, topk_idx, topk_weights = make_inputs(ctx, 16, 128, 8, 2, seed=90)
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
    barrier(ctx)


def small_region_raises_on_every_rank(ctx):
    """A receive region too small for one operation's rows (the CUDA executor moves an operation in one round):
    every rank raises CommError saying how many rows and what the region holds, before any row moves; the buffer
    stays usable for operations that fit. GPU only (the CPU executor moves such payloads in several rounds)."""
    topo = topology(ctx.world_size)
    buffer = topo.buffer(ctx, 1 << 20)
    x, topk_idx, topk_weights = make_inputs(ctx, 512, 2048, 8, 4, seed=52, masked=0.0)  # ~4 KiB rows
    x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
    try:
        layout_and_dispatch(buffer, x_d, idx_d, w_d, 8)
    except deep_ep.CommError as error:
        assert not isinstance(error, deep_ep.CommTimeoutError), str(error)
        assert "raise num_nvl_bytes" in str(error), str(error)
    else:
        raise AssertionError("a dispatch larger than the region did not raise")
    barrier(ctx)
    check_dispatch(ctx, topo, buffer, 16, 2048, 8, 2, seed=53)


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs


def cuda_graph_dispatch_combine(ctx, layout_in_graph: bool):
    """Normal-mode dispatch + a toy expert (x 2, exact in bf16) + combine captured in one CUDA graph with
    `num_worst_tokens` fixed (no host synchronisation on that path), then replayed on three different inputs copied
    into the captured tensors; each replay against the reference. With `layout_in_graph` the layout is captured too
    (routing changes between replays); else it is computed eagerly into the captured layout tensors."""
    topo = topology(ctx.world_size)
    buffer = topo.buffer(ctx)
    num_tokens, hidden, num_experts, num_topk = 256, 1024, 32, 4
    worst = num_tokens * ctx.world_size
    x, topk_idx, topk_weights = make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed=100)
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
    barrier(ctx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_idx, combined = step()
    barrier(ctx)
    for replay in range(3):
        x, topk_idx, topk_weights = make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed=101 + replay)
        x_d.copy_(gpu.cuda(x))
        idx_d.copy_(gpu.cuda(topk_idx))
        w_d.copy_(gpu.cuda(topk_weights))
        if not layout_in_graph:
            for captured, fresh in zip(layout, buffer.get_dispatch_layout(idx_d, num_experts)[:4]):
                if captured is not None:
                    captured.copy_(fresh)
        gpu.synchronize()
        barrier(ctx)  # every rank replays the same step
        graph.replay()
        gpu.synchronize()
        ref = reference_dispatch(ctx, x, topk_idx, topk_weights, num_experts)
        n = ref.recv_x.size(0)
        got_x, got_idx, got_combined = gpu.host((recv_x, recv_idx, combined))
        assert torch.equal(got_x[:n], ref.recv_x), f"replay {replay}: recv_x"
        assert torch.equal(got_idx[:n], ref.recv_topk_idx) and bool((got_idx[n:] == -1).all()), f"replay {replay}"
        in_rank = tokens_in_rank(ctx, topk_idx, num_experts)
        assert_combine_close(got_combined, 2 * identity_partials(topo, x, in_rank), torch.bfloat16)
        barrier(ctx)  # nobody overwrites inputs a peer's replay still reads
    del graph


# ---------------------------------------------------------------------------------------------------------------
# Races: many rounds back to back, a peer held back


def rounds_with_a_peer_ahead(ctx, rounds: int):
    """`rounds` dispatch + combine rounds back to back with no host synchronisation (`num_worst_tokens`, value
    checks skipped), new inputs every round, while one rank (another every 16 rounds) is held back before its round
    by a sleep kernel on its stream, so that its peers run ahead into the next operations. Every round's outputs are
    kept and checked afterwards against the references: a flag read too early, a region rewritten before its reader
    finished, or rows of another round show as wrong rows."""
    topo = topology(ctx.world_size)
    buffer = topo.buffer(ctx, 32 << 20)
    hidden, num_experts, num_topk = 256, 16, 4
    kept = []
    with deep_ep.skip_value_checks():
        for i in range(rounds):
            num_tokens = 64 + (7 * i + 3 * ctx.rank) % 29
            x, topk_idx, topk_weights = make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed=2000 + i)
            x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
            if ctx.rank == (i // 16) % ctx.world_size:
                gpu.sleep_on_stream(400_000)  # ~0.2 ms: the peers enter the round (and the next ones) first
            recv_x, recv_idx, _, _, handle, _ = layout_and_dispatch(
                buffer, x_d, idx_d, w_d, num_experts, num_worst_tokens=93 * ctx.world_size
            )
            combined, _, _ = buffer.combine(recv_x, handle)
            kept.append((x, topk_idx, topk_weights, recv_x, recv_idx, combined))
    gpu.synchronize()
    barrier(ctx)
    for i, (x, topk_idx, topk_weights, recv_x, recv_idx, combined) in enumerate(kept):
        ref = reference_dispatch(ctx, x, topk_idx, topk_weights, num_experts)
        n = ref.recv_x.size(0)
        got_x, got_idx, got_combined = gpu.host((recv_x, recv_idx, combined))
        assert torch.equal(got_x[:n], ref.recv_x), f"round {i}: recv_x"
        assert torch.equal(got_idx[:n], ref.recv_topk_idx), f"round {i}: recv_topk_idx"
        in_rank = tokens_in_rank(ctx, topk_idx, num_experts)
        assert_combine_close(got_combined, identity_partials(topo, x, in_rank), torch.bfloat16)
    return len(kept)
