"""Low-latency cases on the GPU, run as `case(ctx, ...)` in the rank processes of a pool that share GPU 0 (see
test_low_latency.py): dispatch with the sender's fused FP8 cast (float32 scales, power-of-two scales, UE8M0),
weighted combine in FP32 (zero-copy and `out=` too), async_finish and receive hooks, a missing rank.

Results are copied to the host and checked with the CPU conformance helpers (tests/conformance/low_latency_cases.py):
BF16 rows exact; FP8 rows bitwise the reference cast (`per_token_cast_to_fp8`, power-of-two scales exactly the
smallest power of two >= amax / 448) and within E4M3's half-ulp after dequantisation; combine within one bf16
rounding of the float64 weighted sum plus the FP32 accumulation term.

Setting: upstream's low-latency test, 128 tokens per rank, hidden 7168, top-8, 8 experts per rank (uniform routing
of the CPU tests, or skewed: the first rank's experts take most of the traffic).
"""

from __future__ import annotations

import time

import torch

from ..conformance import low_latency_cases as ll
from . import gpu
from .normal_cases import first_timeout

T_MAX, HIDDEN, EXPERTS_PER_RANK, TOPK = 128, 7168, 8, 8
FP8_MODES = {  # name: (use_fp8, round_scale, use_ue8m0)
    "bf16": (False, False, False),
    "fp8": (True, False, False),
    "fp8-pow2": (True, True, False),
    "fp8-ue8m0": (True, True, True),
}


def routing_for(ctx, num_tokens: int, num_experts: int, seed: int, routing: str):
    """`(topk_idx [T, K], topk_weights [T, K])` on the host: the CPU tests' routing, or skewed."""
    if routing == "uniform":
        return ll.make_routing(ctx, num_tokens, num_experts, TOPK, seed=seed, num_masked=10)
    _, topk_idx, topk_weights = gpu.make_inputs(ctx, num_tokens, 8, num_experts, TOPK, seed, routing="skewed")
    return topk_idx, topk_weights


def dispatch_checked(ctx, buffer, x, topk_idx, num_experts, mode: str, **kwargs):
    """`low_latency_dispatch` of host inputs on the GPU, checked on the host; returns `(recv, count, handle, event,
    hook)` (device tensors) after running the hook and waiting on the event."""
    use_fp8, round_scale, use_ue8m0 = FP8_MODES[mode]
    out = buffer.low_latency_dispatch(
        *gpu.cuda(x, topk_idx), T_MAX, num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        **kwargs,
    )  # fmt: skip
    recv, count, handle, event, hook = out
    ll.run_hook(hook)
    event.current_stream_wait()
    gpu.assert_on_gpu(*(recv if use_fp8 else (recv,)), count)
    ll.check_dispatch(ctx, x, topk_idx, num_experts, gpu.host(recv), gpu.host(count), gpu.host(handle), use_fp8,
                      round_scale, use_ue8m0, num_max_tokens=T_MAX)  # fmt: skip
    return out


def dispatch_matches_reference(ctx, mode: str, routing: str):
    """Every (expert, source) segment holds exactly that source's tokens in order; FP8 rows bitwise the reference
    cast (wide-range rows: subnormals and all-zero blocks); per-expert counts added to the cumulative stats."""
    buffer = gpu.ll_buffer(ctx)
    num_experts = EXPERTS_PER_RANK * ctx.world_size
    num_tokens = T_MAX - 7 * ctx.rank
    x = ll.make_x(ctx, num_tokens, HIDDEN, seed=1, kind="wide" if FP8_MODES[mode][0] else "random")
    topk_idx, _ = routing_for(ctx, num_tokens, num_experts, 1, routing)
    stats = gpu.cuda(torch.zeros(EXPERTS_PER_RANK, dtype=torch.int32))
    for _ in range(2):
        _, count, *_ = dispatch_checked(ctx, buffer, x, topk_idx, num_experts, mode,
                                        cumulative_local_expert_recv_stats=stats)  # fmt: skip
    assert torch.equal(gpu.host(stats), 2 * gpu.host(count)), "cumulative_local_expert_recv_stats"


def combine_matches_reference(ctx, mode: str, routing: str):
    """Toy experts (y = x (1 + g / 8) per global expert g) on the dispatched rows, then the weighted FP32 combine,
    against the float64 reference; zero-copy (outputs written into the next combine buffer) and `out=` give the
    same bits."""
    buffer = gpu.ll_buffer(ctx)
    use_fp8, round_scale, _ = FP8_MODES[mode]
    num_experts = EXPERTS_PER_RANK * ctx.world_size
    num_tokens = T_MAX - 5 * ctx.rank
    x = ll.make_x(ctx, num_tokens, HIDDEN, seed=2)
    topk_idx, topk_weights = routing_for(ctx, num_tokens, num_experts, 2, routing)
    recv, _, handle, _, _ = dispatch_checked(ctx, buffer, x, topk_idx, num_experts, mode)
    y = gpu.cuda(ll.expert_outputs(ctx, ll.dequantised(gpu.host(recv), use_fp8), num_experts))
    idx_d, w_d = gpu.cuda(topk_idx, topk_weights)
    combined, event, hook = buffer.low_latency_combine(y, idx_d, w_d, handle)
    ll.run_hook(hook)
    event.current_stream_wait()
    gpu.assert_on_gpu(combined)
    ref, magnitude = ll.reference_combine(x, topk_idx, topk_weights, use_fp8, round_scale)
    got = gpu.host(combined)
    ll.assert_weighted_combine_close(got, ref, magnitude, TOPK)
    # Zero-copy: the expert outputs written into the area the next combine reads.
    area = buffer.get_next_low_latency_combine_buffer(handle)
    area.copy_(y)
    zero_copy, _, _ = buffer.low_latency_combine(area, idx_d, w_d, handle, zero_copy=True)
    assert torch.equal(gpu.host(zero_copy), got), "zero-copy combine differs"
    out = gpu.cuda(torch.full((num_tokens, HIDDEN), 7.0, dtype=torch.bfloat16))
    placed, _, _ = buffer.low_latency_combine(y, idx_d, w_d, handle, out=out)
    assert placed.data_ptr() == out.data_ptr(), "out= was not written in place"
    assert torch.equal(gpu.host(out), got), "combine into out= differs"


def async_and_hooks(ctx):
    """async_finish: the event completes the receive; return_recv_hook: calling the hook completes it (computation
    can run between send and hook), for dispatch and combine; results as the synchronous calls'."""
    buffer = gpu.ll_buffer(ctx)
    num_experts = EXPERTS_PER_RANK * ctx.world_size
    x = ll.make_x(ctx, T_MAX, HIDDEN, seed=3)
    topk_idx, topk_weights = routing_for(ctx, T_MAX, num_experts, 3, "uniform")
    idx_d, w_d = gpu.cuda(topk_idx, topk_weights)
    ref, magnitude = ll.reference_combine(x, topk_idx, topk_weights, True, False)
    for kwargs in ({"async_finish": True}, {"return_recv_hook": True}):
        recv, _, handle, event, hook = dispatch_checked(ctx, buffer, x, topk_idx, num_experts, "fp8", **kwargs)
        assert (hook is not None) == bool(kwargs.get("return_recv_hook")), kwargs
        y = gpu.cuda(ll.expert_outputs(ctx, ll.dequantised(gpu.host(recv), True), num_experts))
        combined, event, hook = buffer.low_latency_combine(y, idx_d, w_d, handle, **kwargs)
        if hook is not None:
            gpu.sleep_on_stream(1_000_000)  # work between the send and the receive
            hook()
        event.current_stream_wait()
        ll.assert_weighted_combine_close(gpu.host(combined), ref, magnitude, TOPK)


def missing_rank_times_out(ctx, timeout_s: float):
    """Rank 1 never joins the low-latency dispatch; the others get CommTimeoutError naming rank 1, at the latest at
    the buffer's next call, never a hung GPU; then every rank uses the GPU again."""
    buffer = gpu.new_ll_buffer(ctx, 32, 1024, 4, explicitly_destroy=True, timeout_s=timeout_s)
    release = time.perf_counter() + 2 * timeout_s + 2.0
    outcome = "skipped"
    num_experts = 4 * ctx.world_size
    try:
        x = gpu.cuda(ll.make_x(ctx, 32, 1024, seed=4))
        topk_idx = gpu.cuda(ll.make_routing(ctx, 32, num_experts, 2, seed=4)[0])
        if ctx.rank != 1:
            state = {}

            def call():
                recv, count, handle, event, _ = buffer.low_latency_dispatch(x, topk_idx, 32, num_experts,
                                                                            use_fp8=False)  # fmt: skip
                state["event"], state["count"] = event, count

            error = first_timeout([
                call,
                lambda: state["event"].current_stream_wait(),
                lambda: state["count"].cpu(),
                lambda: buffer.low_latency_dispatch(x, topk_idx, 32, num_experts, use_fp8=False),
            ])  # fmt: skip
            assert error is not None, "the low-latency dispatch succeeded without rank 1"
            outcome = f"timeout {gpu.named_ranks(str(error)) or str(error)}"
    finally:
        time.sleep(max(0.0, release - time.perf_counter()))
        buffer.destroy()
    gpu.barrier(ctx)
    gpu.synchronize()
    dispatch_checked(ctx, gpu.ll_buffer(ctx), ll.make_x(ctx, 16, HIDDEN, seed=5),
                     ll.make_routing(ctx, 16, EXPERTS_PER_RANK * ctx.world_size, TOPK, seed=5)[0],
                     EXPERTS_PER_RANK * ctx.world_size, "fp8")  # fmt: skip
    return outcome
