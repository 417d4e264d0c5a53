"""Smoke test of mtdeepep's CUDA executor: every kernel once, with R ranks as threads of this process on one GPU
(`mtdeepep.utils.local_ranks`: truly concurrent, no IPC), each step checked against the plain-PyTorch references of
`mtdeepep.utils.refs`; one line per step with PASS/FAIL and its time. The first GPU step of scripts/gpu_check.sh,
and, at `--small` sizes, the program compute-sanitizer runs (memcheck, racecheck, synccheck).

    python scripts/gpu_smoke.py                 # R = 1, then R = 2
    python scripts/gpu_smoke.py --ranks 2,4 --small

Exit status: 0 when every step passed, 1 when one failed, 2 without a GPU or without the CUDA executor.

Steps (kernels): layout (dispatch_layout); dispatch (send_positions, notify, dispatch_send, wait, dispatch_receive);
combine with weights and bias (barrier, combine_send, wait, combine_reduce); cached dispatch (barrier, send,
receive); FP8 dispatch with scales; dispatch with num_worst_tokens (no host synchronisation); low-latency dispatch
BF16 and FP8 (enter, wait_entered, count, send, receive) through a receive hook, and combine (send, wait_signals,
receive); the standalone FP8 cast (cast_to_fp8).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

# Ranks of one process wait for each other's kernels: eager module loading, set before CUDA starts
# (mtdeepep.utils.local_ranks says why).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402


def inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int):
    """Host tensors, different per rank: x [T, H] bf16, topk_idx [T, K] (distinct experts, some -1), weights."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(num_tokens, hidden, generator=generator).bfloat16()
    topk_idx = torch.rand(num_tokens, num_experts, generator=generator).topk(num_topk, dim=1).indices
    topk_idx[torch.rand(num_tokens, num_topk, generator=generator) < 0.1] = -1
    weights = torch.rand(num_tokens, num_topk, generator=generator) + 0.1
    return x, topk_idx, weights


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def normal_steps(ctx, sizes) -> dict[str, float]:
    """Every normal-mode kernel once; seconds per step (this rank)."""
    import mtdeepep as deep_ep
    from mtdeepep.utils import refs
    from mtdeepep.utils.fp8 import per_token_cast_to_fp8

    num_tokens, hidden, num_experts, num_topk = sizes
    dev = torch.device("cuda", torch.cuda.current_device())
    buffer = ctx.new_buffer(64 << 20)
    x, topk_idx, weights = inputs(ctx.rank, num_tokens + ctx.rank, hidden, num_experts, num_topk, seed=1)
    everyone = ctx.all_gather_object((x, topk_idx, weights))
    ref = refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], num_experts, ctx.rank)
    x_d, idx_d, w_d = x.to(dev), topk_idx.to(dev), weights.to(dev)
    times, state = {}, {}

    def timed(name, fn):
        ctx.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.current_stream().synchronize()
        times[name] = time.perf_counter() - start
        buffer._engine.check()  # a device-side error (a timeout) is reported as such, not as wrong data

    def layout():
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx_d, num_experts)
        expected = refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)
        for got, want, name in zip((per_rank, per_expert, in_rank), expected, ("per_rank", "per_expert", "in_rank")):
            expect(torch.equal(got.cpu(), want), f"layout: {name}")
        state["layout"] = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    def dispatch():
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            x_d, topk_idx=idx_d, topk_weights=w_d, **state["layout"]
        )
        expect(torch.equal(recv_x.cpu(), ref.recv_x), "dispatch: recv_x")
        expect(torch.equal(recv_idx.cpu(), ref.recv_topk_idx), "dispatch: recv_topk_idx")
        expect(torch.equal(recv_w.cpu(), ref.recv_topk_weights), "dispatch: recv_topk_weights")
        expect(counts == ref.num_recv_tokens_per_expert, "dispatch: counts")
        state["dispatch"] = (recv_x, recv_w, handle)

    def combine():
        recv_x, recv_w, handle = state["dispatch"]
        bias = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + ctx.rank)).bfloat16()
        out, out_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=bias.to(dev))
        rows = ctx.all_gather_object((recv_x.cpu(), ref.recv_src_rank, ref.recv_src_idx))
        want, _ = refs.ref_combine([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], ctx.rank,
                                   x.size(0), bias=bias)  # fmt: skip
        error = (out.cpu().double() - want.double()).abs().max().item()
        expect(error <= 2.0**-7 * (want.double().abs().max().item() + 1), f"combine: error {error:.3e}")
        expect(torch.allclose(out_w.cpu(), weights.masked_fill(topk_idx < 0, 0.0), rtol=1e-6), "combine: weights")

    def cached():
        _, _, handle = state["dispatch"]
        again, *_ = buffer.dispatch(x_d, handle=handle)
        expect(torch.equal(again.cpu(), ref.recv_x), "cached dispatch: recv_x")

    def fp8():
        e4m3, scales = per_token_cast_to_fp8(x.float())
        mine = ctx.all_gather_object((e4m3.view(torch.uint8), scales, topk_idx))
        want = refs.ref_dispatch([m[0] for m in mine], [m[2] for m in mine], None, num_experts, ctx.rank)
        (data, recv_scales), *_ = buffer.dispatch((e4m3.to(dev), scales.to(dev)), topk_idx=idx_d, **state["layout"])
        expect(torch.equal(data.cpu().view(torch.uint8), want.recv_x), "fp8 dispatch: bytes")
        expect(recv_scales.shape == (want.recv_x.size(0), hidden // 128), "fp8 dispatch: scales shape")

    def worst():
        worst_rows = (num_tokens + ctx.world_size) * ctx.world_size
        with deep_ep.skip_value_checks():
            recv_x, *_ = buffer.dispatch(x_d, topk_idx=idx_d, topk_weights=w_d, num_worst_tokens=worst_rows,
                                         **state["layout"])  # fmt: skip
        n = ref.recv_x.size(0)
        expect(recv_x.size(0) == worst_rows and torch.equal(recv_x[:n].cpu(), ref.recv_x), "num_worst_tokens")

    steps = [("layout", layout), ("dispatch bf16", dispatch), ("combine", combine), ("cached dispatch", cached)]
    if hidden % 128 == 0:
        steps.append(("dispatch fp8", fp8))
    steps.append(("dispatch num_worst_tokens", worst))
    for name, fn in steps:
        timed(name, fn)
    return times


def low_latency_steps(ctx, sizes) -> dict[str, float]:
    """Every low-latency kernel once (BF16 and FP8 dispatch through a receive hook, combine)."""
    from mtdeepep.buffer import Buffer
    from mtdeepep.utils.fp8 import per_token_cast_back

    num_tokens, hidden, num_experts, num_topk = sizes
    dev = torch.device("cuda", torch.cuda.current_device())
    hint = Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, ctx.world_size, num_experts)
    buffer = ctx.new_buffer(0, hint, low_latency_mode=True)
    x, topk_idx, weights = inputs(ctx.rank, num_tokens - ctx.rank, hidden, num_experts, num_topk, seed=2)
    everyone = ctx.all_gather_object(topk_idx)
    num_local = num_experts // ctx.world_size
    want_counts = [sum(int((t == ctx.rank * num_local + e).sum()) for t in everyone) for e in range(num_local)]
    x_d, idx_d, w_d = x.to(dev), topk_idx.to(dev), weights.to(dev)
    times = {}
    for use_fp8 in (False, True):
        ctx.barrier()
        start = time.perf_counter()
        recv, count, handle, _, hook = buffer.low_latency_dispatch(
            x_d, idx_d, num_tokens, num_experts, use_fp8=use_fp8, return_recv_hook=True
        )
        hook()
        torch.cuda.current_stream().synchronize()
        times[f"ll dispatch {'fp8' if use_fp8 else 'bf16'}"] = time.perf_counter() - start
        buffer._engine.check()
        expect(count.cpu().tolist() == want_counts, f"ll dispatch: counts {count.cpu().tolist()} != {want_counts}")
        if use_fp8:
            data, scales = recv
            y = per_token_cast_back(data.reshape(-1, hidden), scales.reshape(-1, hidden // 128).contiguous())
            y = y.view(data.shape).bfloat16()
        else:
            y = recv.clone()
        ctx.barrier()
        start = time.perf_counter()
        out, _, _ = buffer.low_latency_combine(y, idx_d, w_d, handle)
        torch.cuda.current_stream().synchronize()
        times[f"ll combine ({'fp8' if use_fp8 else 'bf16'} rows)"] = time.perf_counter() - start
        buffer._engine.check()
        # Identity experts: the combine returns sum_k w_k x (BF16 rows exact; FP8 within E4M3's relative error).
        masked = weights.masked_fill(topk_idx < 0, 0.0).sum(1, keepdim=True)
        want = x.double() * masked.double()
        error = (out.cpu().double() - want).abs().max().item()
        bound = (2.0**-3 if use_fp8 else 2.0**-7) * (want.abs().max().item() + 1)
        expect(error <= bound, f"ll combine: error {error:.3e} > {bound:.3e}")
    return times


def cast_step(ctx, sizes) -> dict[str, float]:
    """The standalone FP8 cast kernel against `per_token_cast_to_fp8` (bitwise)."""
    from mtdeepep import _C_cuda
    from mtdeepep.utils.fp8 import per_token_cast_to_fp8

    num_tokens, hidden, _, _ = sizes
    if hidden % 128:
        return {}
    x = inputs(ctx.rank, num_tokens, hidden, 8, 1, seed=3)[0]
    x_d = x.cuda()
    e4m3 = torch.empty(x.shape, dtype=torch.uint8, device=x_d.device)
    scales = torch.empty((num_tokens, hidden // 128), dtype=torch.float32, device=x_d.device)
    start = time.perf_counter()
    stream = torch.cuda.current_stream()
    _C_cuda.cast_to_fp8(x_d.data_ptr(), x_d.stride(0), num_tokens, hidden, False, e4m3.data_ptr(), scales.data_ptr(),
                        16, stream.cuda_stream)  # fmt: skip
    stream.synchronize()
    seconds = time.perf_counter() - start
    want_e4m3, want_scales = per_token_cast_to_fp8(x.float())
    expect(torch.equal(e4m3.cpu(), want_e4m3.view(torch.uint8)), "fp8 cast: bytes")
    expect(torch.equal(scales.cpu(), want_scales), "fp8 cast: scales")
    return {"fp8 cast (standalone kernel)": seconds}


def run(num_ranks: int, small: bool, repeat: int, timeout_s: float) -> bool:
    from mtdeepep.utils.local_ranks import LocalRanks

    normal = (64, 256, 16, 4) if small else (512, 7168, 64, 8)
    low_latency = (16, 256, 4 * num_ranks, 4) if small else (128, 7168, 8 * num_ranks, 8)
    ok = True
    groups = [("normal", normal_steps, normal), ("low-latency", low_latency_steps, low_latency)] * repeat
    with LocalRanks(num_ranks, timeout_s=timeout_s, join_timeout_s=8 * timeout_s + 60) as ranks:
        for group, fn, sizes in [*groups, ("cast", cast_step, normal)]:
            start = time.perf_counter()
            try:
                per_rank = ranks.run(fn, sizes)
            except Exception as error:  # noqa: BLE001 - reported as a FAIL line, the other groups still run
                ok = False
                print(f"FAIL  R={num_ranks} {group}: {type(error).__name__}: {error}", flush=True)
                traceback.print_exc()
                continue
            for name in per_rank[0]:
                slowest = max(times[name] for times in per_rank)
                print(f"PASS  R={num_ranks} {name:32s} {slowest * 1e3:9.2f} ms", flush=True)
            print(f"      R={num_ranks} {group} steps: {time.perf_counter() - start:.1f} s", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts, run in turn (default 1,2)")
    parser.add_argument("--small", action="store_true", help="small sizes (for compute-sanitizer)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the normal and low-latency steps (default 1)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=20.0,
        help="the buffers' timeout, seconds (long under compute-sanitizer, which slows kernels)",
    )
    args = parser.parse_args()
    from mtdeepep.utils.testing import cuda_executor_import_error

    if not torch.cuda.is_available() or cuda_executor_import_error() is not None:
        print(f"gpu_smoke: needs a GPU and mtdeepep._C_cuda: {cuda_executor_import_error() or 'no CUDA device'}")
        sys.exit(2)
    print(f"gpu_smoke: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ok = all([run(int(n), args.small, args.repeat, args.timeout) for n in args.ranks.split(",")])
    print("gpu_smoke:", "every step passed" if ok else "FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
