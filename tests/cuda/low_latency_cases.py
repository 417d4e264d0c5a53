"""The low-latency case only a GPU has, run as `case(ctx, ...)` in the ranks that share GPU 0 (see
test_low_latency.py): a missing rank's timeout, raised by the device-side wait, after which the CUDA buffer is
unusable (the CPU executor's buffer recovers with `clean_low_latency_buffer`: tests/conformance). The cases both
executors share (dispatch in every FP8 mode, combine, async and hooks) are the conformance cases of
tests/conformance/low_latency_cases.py, which the GPU tests run with the GPU placement at upstream's size.
"""

from __future__ import annotations

import time

import mtdeepep as deep_ep

from ..conformance import low_latency_cases as ll
from ..conformance.common import barrier, first_error
from . import gpu
from .normal_cases import topology


def missing_rank_times_out(ctx, timeout_s: float):
    """Rank 1 never joins the low-latency dispatch; the others get CommTimeoutError naming rank 1, at the latest at
    the buffer's next call, never a hung GPU; then every rank uses the GPU again."""
    topo = topology(ctx.world_size)
    num_experts = 4 * ctx.world_size
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(32, 1024, ctx.world_size, num_experts)
    buffer = topo.placement.new_buffer(ctx, 0, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=4,
                                       explicitly_destroy=True, timeout_s=timeout_s)  # fmt: skip
    release = time.perf_counter() + 2 * timeout_s + 2.0
    outcome = "skipped"
    try:
        x = gpu.cuda(ll.make_x(ctx, 32, 1024, seed=4))
        topk_idx = gpu.cuda(ll.make_routing(ctx, 32, num_experts, 2, seed=4)[0])
        if ctx.rank != 1:
            state = {}

            def call():
                recv, count, handle, event, _ = buffer.low_latency_dispatch(x, topk_idx, 32, num_experts,
                                                                            use_fp8=False)  # fmt: skip
                state["event"], state["count"] = event, count

            error = first_error(topo, deep_ep.CommTimeoutError, call,
                lambda: state["event"].current_stream_wait(),
                lambda: state["count"].cpu(),
                lambda: buffer.low_latency_dispatch(x, topk_idx, 32, num_experts, use_fp8=False),
            )  # fmt: skip
            assert error is not None, "the low-latency dispatch succeeded without rank 1"
            outcome = f"timeout {gpu.named_ranks(str(error)) or str(error)}"
    finally:
        time.sleep(max(0.0, release - time.perf_counter()))
        buffer.destroy()
    barrier(ctx)
    gpu.synchronize()
    t_max, hidden, experts_per_rank, num_topk = ll.SIZES["upstream"]
    ll.dispatch_checked(ctx, topo, ll.sized_buffer(ctx, topo, "upstream"), ll.make_x(ctx, 16, hidden, seed=5),
                        ll.make_routing(ctx, 16, experts_per_rank * ctx.world_size, num_topk, seed=5)[0],
                        experts_per_rank * ctx.world_size, "fp8", t_max)  # fmt: skip
    return outcome
