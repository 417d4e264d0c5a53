"""Cases of the Triton low-latency kernels (`mtdeepep.kernels.low_latency`), run as `case(ctx, ...)` in the rank
processes of `tests/ranks.py`'s pool under `TRITON_INTERPRET=1` (see test_low_latency.py).

Each rank sets up two runtimes over the same ranks: one driven by the Triton kernels (`LowLatencyKernels` on the
runtime's mapped low-latency areas, addressed through `region_addresses`), one by the CPU executor's protocol
(`_C.LowLatencyProtocol`), the reference. Dispatch must give bitwise the CPU executor's outputs: the counts, and per
(local expert, source rank) segment the rows, scales and token indices (where a segment starts depends on which
source reserved first, on both executors: the segments are compared, not the offsets). Combine: bitwise the CPU
executor's too (the interpreter computes `acc + w * y` with two roundings, as the CPU kernel; a GPU may fuse them,
so the GPU bound is the conformance cases' FP32 bound), and within that bound of a float64 reference.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mtdeepep import _C
from mtdeepep.kernels.low_latency import LowLatencyKernels

from ..conformance.low_latency_cases import make_routing as routing  # one routing generator for both suites
from ..conformance.low_latency_cases import segments

COUNT_MASK = (1 << 32) - 1
TIMEOUT_S = 20.0


def _exchange(ctx, runtime: _C.Runtime) -> None:
    entries = [None] * ctx.world_size
    dist.all_gather_object(entries, (runtime.segment_name(), runtime.pid()), group=ctx.group)
    runtime.connect([n for n, _ in entries], [p for _, p in entries], 1234)


def setup(ctx, num_max_tokens: int, hidden: int, num_experts: int, timeout_s: float = TIMEOUT_S):
    """`(triton LowLatencyKernels, CPU LowLatencyProtocol)` for this shape, cached in the pool."""
    key = ("triton-ll", num_max_tokens, hidden, num_experts, timeout_s)
    if key not in ctx.cache:
        ll_bytes = _C.LowLatencyProtocol.size_hint(num_max_tokens, hidden, ctx.world_size, num_experts)
        runtimes = [_C.Runtime(ctx.rank, ctx.world_size, 0, ll_bytes, TIMEOUT_S, 1) for _ in range(2)]
        for runtime in runtimes:
            _exchange(ctx, runtime)
        area = runtimes[0].get_local_buffer_tensor(torch.uint8, 0, True)
        table = torch.tensor(runtimes[0].region_addresses(low_latency_area=True), dtype=torch.int64)
        kernels = LowLatencyKernels(area=area, peer_table=table, rank=ctx.rank, num_ranks=ctx.world_size, uid=1234,
                                    timeout_s=timeout_s)  # fmt: skip
        cpu = _C.LowLatencyProtocol(runtimes[1], ctx.rank, ctx.world_size, True)
        ctx.cache[key] = (kernels, cpu, runtimes)
    kernels, cpu, _ = ctx.cache[key]
    return kernels, cpu


def make_x(ctx, num_tokens, hidden, seed, wide=False):
    generator = torch.Generator().manual_seed(seed * 1000 + ctx.rank + 7)
    x = torch.randn(num_tokens, hidden, generator=generator)
    if wide:  # a wide range per 128-block (E4M3 subnormals) and an all-zero block
        x = x * torch.exp2(torch.randint(-24, 4, (num_tokens, hidden), generator=generator).float())
        x[:, :128] = 0.0
    return x.bfloat16()


def dispatch_both(ctx, kernels, cpu, x, topk_idx, t_max, num_experts, mode, hook=False, stats=None):
    """The same dispatch on both executors; asserts bitwise equal results; returns the Triton results."""
    use_fp8, round_scale, use_ue8m0 = mode
    stats_cpu = None if stats is None else stats.clone()
    got = kernels.dispatch(x, topk_idx, t_max, num_experts, stats, None, use_fp8, round_scale, use_ue8m0, hook)
    ref = cpu.dispatch(x, topk_idx, stats_cpu, None, t_max, num_experts, use_fp8, round_scale, use_ue8m0, False,
                       False)  # fmt: skip
    if hook:
        assert got[-1] is not None
        got[-1]()
    recv_x, recv_scales, count, src_info, layout_range, _, _ = got
    assert torch.equal(count, ref[2]), (count, ref[2])
    if stats is not None:
        assert torch.equal(stats, stats_cpu)
    if recv_scales is not None:
        assert recv_scales.stride() == ref[1].stride() and recv_scales.dtype == ref[1].dtype
    mine = segments(recv_x, recv_scales, src_info, layout_range)
    theirs = segments(ref[0], ref[1], ref[3], ref[4])
    for key, (rows, scales, tokens) in theirs.items():
        rows_b, scales_b, tokens_b = mine[key]
        assert torch.equal(tokens, tokens_b), f"src_info of {key}"
        assert torch.equal(rows, rows_b), f"rows of {key} ({mode})"
        assert scales is None or torch.equal(scales, scales_b), f"scales of {key} ({mode})"
    return got, ref


def expert_outputs(ctx, recv_x, recv_scales, num_local):
    """A toy expert per local expert: y = x * (1 + g / 8) in bfloat16 over every row (dequantised FP8)."""
    if recv_scales is not None:
        if recv_scales.dtype == torch.int32:
            exps = torch.stack([(recv_scales.long() >> (8 * j)) & 0xFF for j in range(4)], dim=3)
            exps = exps.flatten(2)[:, :, : recv_x.size(2) // 128]
            scales = torch.ldexp(torch.ones(exps.shape), exps - 127)
        else:
            scales = recv_scales
        x = (recv_x.float().view(*recv_x.shape[:2], -1, 128) * scales.unsqueeze(3)).view(recv_x.shape)
    else:
        x = recv_x.float()
    factors = torch.tensor([1.0 + 0.125 * (ctx.rank * num_local + e) for e in range(num_local)]).view(-1, 1, 1)
    return (x * factors).bfloat16()


def combine_both(ctx, kernels, cpu, y, topk_idx, weights, got, ref, t_max, num_experts, hook=False, out=None,
                 zero_copy=False):  # fmt: skip
    """The same combine on both executors (each with its own dispatch's handle); asserts bitwise equal results.
    `zero_copy`: `y` was written into `next_combine_buffer`; the Triton side is passed zeros instead."""
    _, _, _, src_info, layout_range, seq, _ = got
    y_cpu = expert_outputs_like_cpu(y, src_info, layout_range, ref)
    x = torch.zeros_like(y) if zero_copy else y
    combined, receive = kernels.combine(x, topk_idx, weights, src_info, layout_range, t_max, num_experts, 1234, seq,
                                        zero_copy, hook, out, None)  # fmt: skip
    expected, _, _ = cpu.combine(y_cpu, topk_idx, weights, ref[3], ref[4], None, t_max, num_experts, 1234, ref[5],
                                 False, False, False, None)  # fmt: skip
    if hook:
        receive()
    assert torch.equal(combined.view(torch.int16), expected.view(torch.int16)), "combine differs from the CPU's"
    return combined


def expert_outputs_like_cpu(y, src_info, layout_range, ref):
    """`y` (rows in the Triton dispatch's layout) moved to the CPU dispatch's layout, segment by segment."""
    y_cpu = torch.zeros_like(y)
    for e in range(layout_range.size(0)):
        for mine, theirs in zip(layout_range[e].tolist(), ref[4][e].tolist()):
            count = mine & COUNT_MASK
            y_cpu[e, (theirs >> 32) : (theirs >> 32) + count] = y[e, (mine >> 32) : (mine >> 32) + count]
    return y_cpu


def reference_combine(x_bf16_rows, topk_idx, weights):
    """float64 sum over the non-masked slots, and sum |w y| (the FP32 accumulation bound)."""
    out = torch.zeros(topk_idx.size(0), x_bf16_rows.size(-1), dtype=torch.float64)
    mag = torch.zeros_like(out)
    for t, k in (topk_idx >= 0).nonzero().tolist():
        y = x_bf16_rows[int(topk_idx[t, k]), t].double()
        out[t] += float(weights[t, k]) * y
        mag[t] += abs(float(weights[t, k])) * y.abs()
    return out, mag


MODES = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8-pow2": (True, True, False),
         "fp8-ue8m0": (True, True, True)}  # fmt: skip


def dispatch_and_combine_match_cpu(ctx, t_max=32, hidden=512, experts_per_rank=4, num_topk=4):
    """Every mode: dispatch bitwise the CPU executor's (wide-range rows for FP8: subnormals, zero blocks), with
    masked slots and cumulative stats; the combine of toy expert outputs bitwise the CPU's and within the FP32
    bound of a float64 reference; the last rank sends fewer tokens."""
    num_experts = experts_per_rank * ctx.world_size
    kernels, cpu = setup(ctx, t_max, hidden, num_experts)
    num_tokens = t_max - 5 * ctx.rank
    topk_idx, weights = routing(ctx, num_tokens, num_experts, num_topk, seed=1, num_masked=8)
    for i, (name, mode) in enumerate(MODES.items()):
        x = make_x(ctx, num_tokens, hidden, seed=2 + i, wide=mode[0])
        stats = torch.zeros(experts_per_rank, dtype=torch.int32)
        got, ref = dispatch_both(ctx, kernels, cpu, x, topk_idx, t_max, num_experts, mode, hook=i % 2 == 1,
                                 stats=stats)  # fmt: skip
        y = expert_outputs(ctx, got[0], got[1], experts_per_rank)
        combined = combine_both(ctx, kernels, cpu, y, topk_idx, weights, got, ref, t_max, num_experts,
                                hook=i % 2 == 0)  # fmt: skip
        # float64 reference from the combine inputs each expert saw for this rank's tokens: gathered rows
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, (y, got[3], got[4]), group=ctx.group)
        rows = torch.zeros(num_experts, t_max, hidden, dtype=torch.bfloat16)
        for owner, (y_o, src_o, range_o) in enumerate(everyone):
            for e in range(experts_per_rank):
                packed = int(range_o[e, ctx.rank])
                begin, count = packed >> 32, packed & COUNT_MASK
                tokens = src_o[e, begin : begin + count].long()
                rows[owner * experts_per_rank + e, tokens] = y_o[e, begin : begin + count]
        ref64, mag = reference_combine(rows, topk_idx, weights)
        bound = 2.0**-8 * ref64.abs() + 2 * (num_topk + 1) * 2.0**-24 * mag
        assert bool(((combined.double() - ref64).abs() <= bound).all()), f"{name}: combine out of bound"
    return "ok"


def zero_copy_and_out(ctx, t_max=32, hidden=256, experts_per_rank=4):
    """zero_copy (the outputs written into `next_combine_buffer`, a different x passed) and `out=` give bitwise the
    plain combine."""
    num_experts = experts_per_rank * ctx.world_size
    kernels, cpu = setup(ctx, t_max, hidden, num_experts)
    topk_idx, weights = routing(ctx, 20, num_experts, 3, seed=5, num_masked=4)
    x = make_x(ctx, 20, hidden, seed=5)
    got, ref = dispatch_both(ctx, kernels, cpu, x, topk_idx, t_max, num_experts, MODES["bf16"])
    y = expert_outputs(ctx, got[0], None, experts_per_rank)
    plain = combine_both(ctx, kernels, cpu, y, topk_idx, weights, got, ref, t_max, num_experts)
    area = kernels.next_combine_buffer(t_max, hidden, num_experts)
    area.copy_(y)
    out = torch.full((20, hidden), 7.0, dtype=torch.bfloat16)
    placed = combine_both(ctx, kernels, cpu, y, topk_idx, weights, got, ref, t_max, num_experts,
                          out=out, zero_copy=True)  # fmt: skip
    assert placed.data_ptr() == out.data_ptr() and torch.equal(out, plain)
    assert kernels.next_combine_buffer(t_max, hidden, num_experts).data_ptr() != area.data_ptr(), "two areas"
    return "ok"


def peer_runs_ahead(ctx, rounds=24, t_max=16, hidden=128, experts_per_rank=2):
    """Rounds of dispatch + combine with the double buffer: rank 0 runs ahead (the others sleep a little before
    each call, and rank 0 issues its dispatches in hook mode, so that two of its results are alive while the peers
    still use the older half); every round's results are bitwise the CPU executor's."""
    num_experts = experts_per_rank * ctx.world_size
    kernels, cpu = setup(ctx, t_max, hidden, num_experts)
    for r in range(rounds):
        num_tokens = 1 + (r * 7 + ctx.rank * 3) % t_max
        topk_idx, weights = routing(ctx, num_tokens, num_experts, 2, seed=100 + r, num_masked=2)
        x = make_x(ctx, num_tokens, hidden, seed=100 + r)
        if ctx.rank != 0:
            time.sleep(0.002 * (r % 3))
        mode = MODES["fp8" if r % 2 else "bf16"]
        got, ref = dispatch_both(ctx, kernels, cpu, x, topk_idx, t_max, num_experts, mode, hook=ctx.rank == 0)
        y = expert_outputs(ctx, got[0], got[1], experts_per_rank)
        combine_both(ctx, kernels, cpu, y, topk_idx, weights, got, ref, t_max, num_experts, hook=ctx.rank == 0)
    return kernels.seq


def two_results_alive(ctx, t_max=16, hidden=256, experts_per_rank=2):
    """Two dispatches in hook mode: both results alive and intact, in different halves; a third call while the
    first hook is pending is refused before communicating; after the hooks the calls go on."""
    num_experts = experts_per_rank * ctx.world_size
    kernels, cpu = setup(ctx, t_max, hidden, num_experts)
    topk_idx, _ = routing(ctx, 10, num_experts, 2, seed=7, num_masked=2)
    xs = [make_x(ctx, 10, hidden, seed=8), make_x(ctx, 10, hidden, seed=9)]
    first = kernels.dispatch(xs[0], topk_idx, t_max, num_experts, None, None, False, False, False, True)
    second = kernels.dispatch(xs[1], topk_idx, t_max, num_experts, None, None, False, False, False, True)
    assert first[0].data_ptr() != second[0].data_ptr()
    try:
        kernels.dispatch(xs[0], topk_idx, t_max, num_experts, None, None, False, False, False, False)
    except ValueError as error:
        assert "hook" in str(error)
    else:
        raise AssertionError("a third call with a pending hook must be refused")
    second[-1]()
    first[-1]()
    first[-1]()  # a second call is a no-op
    for got, x in zip((first, second), xs):
        ref = cpu.dispatch(x, topk_idx, None, None, t_max, num_experts, False, False, False, False, False)
        mine, theirs = segments(got[0], None, got[3], got[4]), segments(ref[0], None, ref[3], ref[4])
        assert all(torch.equal(mine[k][0], v[0]) and torch.equal(mine[k][2], v[2]) for k, v in theirs.items())
    return "ok"


def missing_rank_times_out_then_clean_recovers(ctx, timeout_s=1.5):
    """Rank 1 skips a dispatch: rank 0 times out naming it and the phase; a call of another kind on one rank is a
    GroupMismatchError; after clean on every rank the kernels work again."""
    t_max, hidden, experts_per_rank = 16, 128, 2
    num_experts = experts_per_rank * ctx.world_size
    kernels, cpu = setup(ctx, t_max, hidden, num_experts, timeout_s=timeout_s)
    topk_idx, weights = routing(ctx, 8, num_experts, 2, seed=11, num_masked=0)
    x = make_x(ctx, 8, hidden, seed=11)
    outcome = []
    if ctx.rank == 1:
        time.sleep(timeout_s + 1.0)
    else:
        start = time.perf_counter()
        try:
            kernels.dispatch(x, topk_idx, t_max, num_experts, None, None, False, False, False, False)
        except _C.CommTimeoutError as error:
            assert "rank(s) [1] did not arrive" in str(error) and "dispatch" in str(error), error
            # Wall-clock time in the interpreter too: the host sleeps on the flags until the timeout, then the
            # kernel's bounded wait reports whom it waited for.
            elapsed = time.perf_counter() - start
            assert timeout_s <= elapsed < timeout_s + 5, elapsed
            outcome.append("timeout")
    dist.barrier(group=ctx.group)
    kernels.set_timeout(TIMEOUT_S)  # the recovery: the usual timeout (a loaded machine is slow)
    kernels.clean(t_max, hidden, num_experts)
    try:
        kernels.dispatch(x, topk_idx, t_max, num_experts, None, None, ctx.rank == 0, False, False, False)
    except _C.GroupMismatchError as error:
        assert "disagree" in str(error), error
        outcome.append("mismatch")
    got, ref = dispatch_both(ctx, kernels, cpu, x, topk_idx, t_max, num_experts, MODES["fp8"])
    y = expert_outputs(ctx, got[0], got[1], experts_per_rank)
    combine_both(ctx, kernels, cpu, y, topk_idx, weights, got, ref, t_max, num_experts)
    # Rank 1's buffer goes away: rank 0's next wait for it ends at once, naming it.
    dist.barrier(group=ctx.group)
    if ctx.rank == 1:
        kernels.destroy()
        outcome.append("destroyed")
    dist.barrier(group=ctx.group)
    if ctx.rank == 0:
        start = time.perf_counter()
        try:
            kernels.dispatch(x, topk_idx, t_max, num_experts, None, None, False, False, False, False)
        except _C.CommError as error:
            assert "rank 1 failed" in str(error) and "destroyed" in str(error), error
            assert time.perf_counter() - start < TIMEOUT_S
            outcome.append("peer-destroyed")
    return outcome
