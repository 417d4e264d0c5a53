"""Low-latency cases, run as `case(ctx, topo)` in the rank processes of a `RankPool` (see test_low_latency.py).

One node (intranode topologies): the shared-memory transport; several nodes: the collective transport
(torch.distributed all-to-all).

Each case builds inputs on every rank, gathers them, and checks what this rank received against a plain-PyTorch
computation from the global view. Tolerances:

- dispatch moves bytes: BF16 rows must be exact; FP8 rows must be bitwise the reference cast
  (`fp8.per_token_cast_to_fp8`; for power-of-two scales the exact "smallest power of two >= amax / 448"), and
  dequantise to within E4M3's half-ulp: 2^-4 relative, plus half the subnormal spacing 2^-10 times the block scale.
- combine sums at most K weighted bfloat16 rows in FP32 and rounds once to bfloat16: |out - ref| <=
  2^-8 |ref| (one bf16 rounding, with margin) + 2 (K + 1) 2^-24 sum_k |w_k y_k| (FP32 products and sums), against
  a float64 reference computed from bitwise the same expert outputs.

Legend: T tokens, K top-k, H hidden, R ranks, E experts, E_local = E / R, RT = R * T_max.
"""

from __future__ import annotations

import time

import torch

import mtdeepep as deep_ep
from mtdeepep.utils import fp8

from .common import assert_overlaps, assert_value_errors, barrier, gather
from .common import make_inputs as make_normal_inputs

COUNT_MASK = (1 << 32) - 1
FP8_MODES = {  # name: (use_fp8, round_scale, use_ue8m0)
    "bf16": (False, False, False),
    "fp8": (True, False, False),
    "fp8-pow2": (True, True, False),
    "fp8-ue8m0": (True, True, True),
}
# The sizes of the cases that a GPU runs too, (max tokens a rank, hidden, experts a rank, top-k): 'small' for the CPU
# topologies, 'upstream' as upstream's low-latency test (128 tokens a rank, hidden 7168, top-8 of 8 experts a rank).
SIZES = {"small": (64, 1024, 8, 8), "upstream": (128, 7168, 8, 8)}
RANK_OFFSET = 128  # upstream's row value: source rank - 128 (exact in bfloat16 and in E4M3 with its own scale)


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def ll_buffer(ctx, topo, name: str = "main", num_max_tokens: int = 64, hidden: int = 1024, experts_per_rank: int = 8,
              **kwargs) -> deep_ep.Buffer:  # fmt: skip
    """One low-latency buffer per name, sized by the size hint, on the topology's placement, reused across the cases
    of a pool."""
    key = f"ll-{topo}-{name}-{sorted(kwargs.items())}"
    if key not in ctx.cache:
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(
            num_max_tokens, hidden, ctx.world_size, experts_per_rank * ctx.world_size
        )
        ctx.cache[key] = topo.placement.new_buffer(
            ctx, 0, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=experts_per_rank,
            **{**topo.buffer_kwargs(), **kwargs},
        )  # fmt: skip
    return ctx.cache[key]


def sized_buffer(ctx, topo, size: str) -> deep_ep.Buffer:
    """The low-latency buffer of a size of `SIZES` ('small' is the cases' usual buffer)."""
    num_max_tokens, hidden, experts_per_rank, _ = SIZES[size]
    return ll_buffer(ctx, topo, "main" if size == "small" else size, num_max_tokens, hidden, experts_per_rank)


def transport_of(buffer: deep_ep.Buffer) -> str:
    """'shared-memory' (one node) or 'collective' (several nodes), from the public node count."""
    return "shared-memory" if buffer.get_num_rdma_ranks() == 1 else "collective"


def make_routing(ctx, num_tokens, num_experts, num_topk, seed, num_masked=6):
    """Top-k of random scores (distinct experts per token), a few slots masked with -1, positive weights."""
    generator = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    topk_idx = (
        torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float32).topk(num_topk, dim=1).indices
    )
    if num_tokens:
        rows = torch.randint(num_tokens, (num_masked,), generator=generator)
        cols = torch.randint(num_topk, (num_masked,), generator=generator)
        topk_idx[rows, cols] = -1
    topk_weights = torch.rand(num_tokens, num_topk, generator=generator, dtype=torch.float32) + 0.1
    return topk_idx, topk_weights


def routing_for(ctx, num_tokens, num_experts, num_topk, seed, routing="uniform", num_masked=6):
    """`(topk_idx [T, K], topk_weights [T, K])` on the host: `make_routing`, or (routing 'skewed') the normal cases'
    skewed routing, where the first rank's experts take most of the traffic."""
    if routing == "uniform":
        return make_routing(ctx, num_tokens, num_experts, num_topk, seed, num_masked)
    _, topk_idx, topk_weights = make_normal_inputs(ctx, num_tokens, 8, num_experts, num_topk, seed, routing=routing)
    return topk_idx, topk_weights


def make_x(ctx, num_tokens, hidden, seed, kind="random"):
    """`random`: normal rows; `ranked`: upstream's rows (value rank - 128, last 128 columns the token index);
    `wide`: a wide dynamic range per block (exercises E4M3 subnormals) and some all-zero blocks."""
    generator = torch.Generator().manual_seed(seed * 1000 + ctx.rank + 7)
    if kind == "ranked":
        x = torch.full((num_tokens, hidden), float(ctx.rank - RANK_OFFSET), dtype=torch.float32)
        x[:, -128:] = torch.arange(num_tokens, dtype=torch.float32).view(-1, 1)
        return x.bfloat16()
    x = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float32)
    if kind == "wide":
        x = x * torch.exp2(torch.randint(-24, 4, (num_tokens, hidden), generator=generator).float())
        x[:, :128] = 0.0
    return x.bfloat16()


def exact_fp8_cast(x_TH: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast the sender must do: `fp8.per_token_cast_to_fp8`, with power-of-two scales computed exactly
    (the smallest power of two >= amax / 448, via frexp) when `round_scale`."""
    if not round_scale:
        return fp8.per_token_cast_to_fp8(x_TH.float())
    num_tokens, hidden = x_TH.shape
    blocks = x_TH.float().view(num_tokens, hidden // 128, 128)
    ratio = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    mantissa, exponent = torch.frexp(ratio)
    scale = torch.where(mantissa == 0.5, ratio, torch.ldexp(torch.ones_like(ratio), exponent))
    e4m3 = (blocks / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(num_tokens, hidden)
    return e4m3, scale


def unpack_ue8m0(packed_NP: torch.Tensor, num_scales: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 `[N, ceil(S / 4)]` -> (float32 scales `[N, S]`, the unused exponent bytes)."""
    num_rows, num_packed = packed_NP.shape
    bytes_NP4 = torch.stack([(packed_NP.long() >> (8 * j)) & 0xFF for j in range(4)], dim=2)  # little endian
    exponents = bytes_NP4.reshape(num_rows, 4 * num_packed)
    return torch.ldexp(torch.ones(exponents.shape), exponents - 127)[:, :num_scales], exponents[:, num_scales:]


def sources_of(everyone_topk, global_expert):
    """Per source rank: its token indices that chose `global_expert`, ascending."""
    return [(topk == global_expert).any(dim=1).nonzero().flatten() for topk in everyone_topk]


def segments(recv_x, recv_scales, src_info, layout_range, recv_count=None):
    """{(local expert, source rank): (rows as bytes, scales or None, src_info)} of a low-latency dispatch's
    `recv_x [L, R*T_max, H]`, `recv_scales` (or None) and its handle's `src_info` and `layout_range`. Checks upstream's
    contract: the sources' segments tile each expert's rows from 0 without gap or overlap, up to `recv_count[e]`."""
    out = {}
    for e in range(layout_range.size(0)):
        spans = []
        for s, packed in enumerate(layout_range[e].tolist()):
            begin, count = packed >> 32, packed & COUNT_MASK
            rows = slice(begin, begin + count)
            scales = None if recv_scales is None else recv_scales[e, rows].clone()
            out[(e, s)] = (recv_x[e, rows].view(torch.uint8).clone(), scales, src_info[e, rows].clone())
            if count:
                spans.append((begin, count))
        position = 0
        for begin, count in sorted(spans):
            assert begin == position, f"expert {e}: segments {sorted(spans)} leave a gap or overlap"
            position += count
        if recv_count is not None:
            assert position == int(recv_count[e]), f"expert {e}: segments cover {position}, recv_count {recv_count[e]}"
    return out


def check_dispatch(ctx, x, topk_idx, num_experts, recv, recv_count, handle, use_fp8=False, round_scale=False,
                   use_ue8m0=False, num_max_tokens=None):  # fmt: skip
    """Every (expert, source) segment holds exactly that source's tokens for the expert, in token order."""
    everyone = gather(ctx, (x, topk_idx))
    num_local = num_experts // ctx.world_size
    src_info, layout_range, t_max, hidden, experts = handle
    assert (hidden, experts) == (x.size(1), num_experts) and (num_max_tokens is None or t_max == num_max_tokens)
    assert recv_count.dtype == torch.int32 and recv_count.shape == (num_local,)
    assert src_info.dtype == torch.int32 and src_info.shape == (num_local, ctx.world_size * t_max)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (num_local, ctx.world_size)
    data = recv[0] if use_fp8 else recv
    assert data.shape == (num_local, ctx.world_size * t_max, hidden)
    assert data.dtype == (torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    if use_fp8:
        _check_scale_layout(recv[1], num_local, ctx.world_size * t_max, hidden, use_ue8m0)
    # Upstream's check: each local expert's count equals the global count of its id in everyone's topk_idx.
    for e in range(num_local):
        expected_count = sum(int((topk == ctx.rank * num_local + e).sum()) for _, topk in everyone)
        assert int(recv_count[e]) == expected_count, (e, int(recv_count[e]), expected_count)
    parts = segments(data, recv[1] if use_fp8 else None, src_info, layout_range, recv_count)
    for e in range(num_local):
        tokens_per_source = sources_of([t for _, t in everyone], ctx.rank * num_local + e)
        for s, tokens in enumerate(tokens_per_source):
            rows, scales, sources = parts[(e, s)]
            assert torch.equal(sources.long(), tokens), f"src_info of expert {e} from rank {s}"
            expected_rows = everyone[s][0][tokens]
            if not use_fp8:
                assert torch.equal(rows, expected_rows.view(torch.uint8)), f"bf16 rows of expert {e} from rank {s}"
                continue
            _check_fp8_rows(rows, scales, expected_rows, round_scale, use_ue8m0)
    return parts


def _check_scale_layout(scales, num_local, num_rows, hidden, use_ue8m0):
    columns = (hidden // 128 + 3) // 4 if use_ue8m0 else hidden // 128
    assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
    assert scales.shape == (num_local, num_rows, columns)
    assert scales.stride() == (columns * num_rows, 1, num_rows), "scales must be column-major as upstream"


def _check_fp8_rows(rows_u8, scales, expected_bf16, round_scale, use_ue8m0):
    ref_e4m3, ref_scales = exact_fp8_cast(expected_bf16, round_scale)
    assert torch.equal(rows_u8, ref_e4m3.view(torch.uint8)), "E4M3 bytes differ from the reference cast"
    if use_ue8m0:
        scales, padding = unpack_ue8m0(scales, ref_scales.size(1))
        assert bool((padding == 0).all()), "unused UE8M0 bytes must be 0"
    assert torch.equal(scales, ref_scales), "scales differ from the reference cast"
    if round_scale:
        mantissa, _ = torch.frexp(scales)
        assert bool((mantissa == 0.5).all()), "round_scale scales must be powers of two"
    if rows_u8.numel():
        # E4M3: 3 mantissa bits (half-ulp 2^-4 relative); below 2^-6 subnormal with spacing 2^-9 (in scale units).
        deq = fp8.per_token_cast_back(rows_u8.view(torch.float8_e4m3fn), scales)
        x = expected_bf16.float()
        bound = 2.0**-4 * x.abs() + 2.0**-10 * scales.repeat_interleave(128, dim=1)
        assert bool(((deq - x).abs() <= bound * 1.001).all()), "FP8 dequantisation error out of bounds"


def dequantised(recv, use_fp8):
    """What an expert GEMM would read: bfloat16 `[E_local, RT, H]` (FP8 cast back per 128-channel block)."""
    if not use_fp8:
        return recv.clone()
    data, scales = recv
    if scales.dtype == torch.int32:
        scales = torch.stack([unpack_ue8m0(s, data.size(2) // 128)[0] for s in scales])
    back = fp8.per_token_cast_back(data.reshape(-1, data.size(2)), scales.reshape(-1, scales.size(2)))
    return back.view(data.shape).bfloat16()


def expert_factor(global_expert: int) -> float:
    return 1.0 + 0.125 * global_expert


def expert_outputs(ctx, deq_x, num_experts):
    """A toy expert per global expert g: y = x * (1 + g / 8), in bfloat16 (on all rows; unused rows are ignored)."""
    num_local = num_experts // ctx.world_size
    factors = torch.tensor([expert_factor(ctx.rank * num_local + e) for e in range(num_local)]).view(-1, 1, 1)
    return (deq_x.float() * factors).bfloat16()


def reference_combine(x, topk_idx, topk_weights, use_fp8=False, round_scale=False):
    """float64 sum over non-masked slots of w * y, y the expert output each expert computed for this token,
    reproduced bitwise here; also returns sum |w y| for the FP32 accumulation bound."""
    x_eff = x
    if use_fp8 and x.size(0):
        e4m3, scales = exact_fp8_cast(x, round_scale)
        x_eff = fp8.per_token_cast_back(e4m3, scales).bfloat16()
    out = torch.zeros(x.shape, dtype=torch.float64)
    magnitude = torch.zeros(x.shape, dtype=torch.float64)
    for t, k in (topk_idx >= 0).nonzero().tolist():
        g = int(topk_idx[t, k])
        y = (x_eff[t].float() * expert_factor(g)).bfloat16().double()
        out[t] += float(topk_weights[t, k]) * y
        magnitude[t] += abs(float(topk_weights[t, k])) * y.abs()
    return out, magnitude


def assert_weighted_combine_close(combined, ref, magnitude, num_topk):
    assert combined.dtype == torch.bfloat16
    bound = 2.0**-8 * ref.abs() + 2 * (num_topk + 1) * 2.0**-24 * magnitude
    diff = (combined.double() - ref).abs()
    assert bool((diff <= bound).all()), f"combine error exceeds bound by {(diff - bound).max().item():.3e}"


def run_hook(hook):
    if hook is not None:
        hook()


def dispatch_checked(ctx, topo, buffer, x, topk_idx, num_experts, mode: str, t_max: int, **kwargs):
    """`low_latency_dispatch` of host inputs on the topology's placement in one of `FP8_MODES`, checked on the host
    (`check_dispatch`) after running the hook and waiting on the event; returns `(recv, count, handle, event, hook)`
    (on the device)."""
    placement = topo.placement
    use_fp8, round_scale, use_ue8m0 = FP8_MODES[mode]
    out = buffer.low_latency_dispatch(
        *placement.to(x, topk_idx), t_max, num_experts, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=use_ue8m0, **kwargs,
    )  # fmt: skip
    recv, count, handle, event, hook = out
    run_hook(hook)
    event.current_stream_wait()
    placement.assert_on_device(*(recv if use_fp8 else (recv,)), count)
    check_dispatch(ctx, x, topk_idx, num_experts, *placement.host((recv, count, handle)), use_fp8, round_scale,
                   use_ue8m0, num_max_tokens=t_max)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------------
# Dispatch


def dispatch_matches_upstream_checks(ctx, topo):
    """Upstream's test: rows = source rank - 128, last 128 columns = token index; every dispatch variant in sync,
    async and hook mode; per-expert counts equal the global counts; segments constant per source."""
    buffer = ll_buffer(ctx, topo)
    num_experts, t_max, hidden = 8 * ctx.world_size, 64, 1024
    num_tokens = 48 + 5 * ctx.rank
    x = make_x(ctx, num_tokens, hidden, seed=1, kind="ranked")
    topk_idx, _ = make_routing(ctx, num_tokens, num_experts, 6, seed=1)
    variants = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    for mode in ("sync", "async", "hook"):
        for use_fp8, round_scale, use_ue8m0 in variants:
            stats = torch.zeros(num_experts // ctx.world_size, dtype=torch.int32)
            wait_ns = torch.zeros(ctx.world_size, dtype=torch.int64)
            recv, count, handle, event, hook = buffer.low_latency_dispatch(
                x, topk_idx, t_max, num_experts, cumulative_local_expert_recv_stats=stats,
                dispatch_wait_recv_cost_stats=wait_ns, use_fp8=use_fp8, round_scale=round_scale,
                use_ue8m0=use_ue8m0, async_finish=mode == "async", return_recv_hook=mode == "hook",
            )  # fmt: skip
            assert (hook is not None) == (mode == "hook")
            run_hook(hook)
            event.current_stream_wait()
            check_dispatch(ctx, x, topk_idx, num_experts, recv, count, handle, use_fp8, round_scale, use_ue8m0, t_max)
            assert torch.equal(stats, count), "cumulative_local_expert_recv_stats must get the counts"
            assert int((handle[1] & COUNT_MASK).sum()) == int(count.sum())
            assert bool((wait_ns >= 0).all())
            # Upstream's own reading: each source segment is constant (rank - 128) outside the last 128 columns,
            # which carry the token index (exact unless round_scale, then within E4M3's half-ulp).
            deq = dequantised(recv, use_fp8).float()
            for e in range(count.numel()):
                for s, packed in enumerate(handle[1][e].tolist()):
                    rows = deq[e, packed >> 32 : (packed >> 32) + (packed & COUNT_MASK)]
                    tokens = handle[0][e, packed >> 32 : (packed >> 32) + (packed & COUNT_MASK)].float()
                    assert torch.equal(rows[:, :-128].amin(dim=1), rows[:, :-128].amax(dim=1))
                    body_error = (rows[:, :-128] - (s - RANK_OFFSET)).abs()
                    tail_error = (rows[:, -128:] - tokens.view(-1, 1)).abs()
                    if round_scale:
                        assert bool((body_error <= 2.0**-4 * RANK_OFFSET).all())
                        assert bool((tail_error <= 2.0**-4 * tokens.view(-1, 1) + 1e-6).all())
                    else:
                        assert bool((body_error == 0).all()) and bool((tail_error == 0).all())


def fp8_cast_matches_reference(ctx, topo):
    """Wide-range rows (E4M3 subnormals, zero blocks): bitwise the reference cast, for float32 scales, power-of-two
    scales and UE8M0; hidden 896 = 7 x 128 (UE8M0 packs 7 exponents into 2 int32, the 8th byte 0)."""
    buffer = ll_buffer(ctx, topo)
    num_experts = 8 * ctx.world_size
    for seed, hidden in ((2, 896), (3, 512)):
        x = make_x(ctx, 40, hidden, seed=seed, kind="wide")
        topk_idx, _ = make_routing(ctx, 40, num_experts, 4, seed=seed)
        results = {}
        for round_scale, use_ue8m0 in ((False, False), (True, False), (True, True)):
            recv, count, handle, _, _ = buffer.low_latency_dispatch(
                x, topk_idx, 64, num_experts, use_fp8=True, round_scale=round_scale, use_ue8m0=use_ue8m0
            )
            results[(round_scale, use_ue8m0)] = check_dispatch(
                ctx, x, topk_idx, num_experts, recv, count, handle, True, round_scale, use_ue8m0
            )
        # UE8M0 carries exactly the power-of-two scales of round_scale, and the same E4M3 bytes.
        for key, (rows, packed, _) in results[(True, True)].items():
            rows_ref, scales_ref, _ = results[(True, False)][key]
            assert torch.equal(rows, rows_ref)
            assert torch.equal(unpack_ue8m0(packed, hidden // 128)[0], scales_ref)


def dispatch_matches_reference(ctx, topo, mode: str, routing: str = "uniform", size: str = "small"):
    """One mode of `FP8_MODES`, twice: every (expert, source) segment holds exactly that source's tokens in order;
    FP8 rows bitwise the reference cast (wide-range rows: subnormals and all-zero blocks); per-expert counts added to
    the cumulative stats."""
    placement = topo.placement
    t_max, hidden, experts_per_rank, num_topk = SIZES[size]
    buffer = sized_buffer(ctx, topo, size)
    num_experts = experts_per_rank * ctx.world_size
    num_tokens = t_max - 7 * ctx.rank
    x = make_x(ctx, num_tokens, hidden, seed=1, kind="wide" if FP8_MODES[mode][0] else "random")
    topk_idx, _ = routing_for(ctx, num_tokens, num_experts, num_topk, 1, routing, num_masked=10)
    stats = placement.to(torch.zeros(experts_per_rank, dtype=torch.int32))
    for _ in range(2):
        _, count, *_ = dispatch_checked(ctx, topo, buffer, x, topk_idx, num_experts, mode, t_max,
                                        cumulative_local_expert_recv_stats=stats)  # fmt: skip
    assert torch.equal(placement.host(stats), 2 * placement.host(count)), "cumulative_local_expert_recv_stats"


# ---------------------------------------------------------------------------------------------------------------
# Combine


def dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, num_experts, t_max, use_fp8=False,
                             round_scale=False, **combine_kwargs):  # fmt: skip
    """Dispatch of host inputs on the topology's placement (checked), the toy experts, then the weighted combine
    against the float64 reference. Returns `(combined, expert outputs, handle)` (on the device)."""
    placement = topo.placement
    mode = "fp8-pow2" if round_scale else "fp8" if use_fp8 else "bf16"
    recv, _, handle, _, _ = dispatch_checked(ctx, topo, buffer, x, topk_idx, num_experts, mode, t_max)
    y = placement.to(expert_outputs(ctx, dequantised(placement.host(recv), use_fp8), num_experts))
    combined, event, hook = buffer.low_latency_combine(y, *placement.to(topk_idx, topk_weights), handle,
                                                       **combine_kwargs)  # fmt: skip
    run_hook(hook)
    event.current_stream_wait()
    placement.assert_on_device(combined)
    ref, magnitude = reference_combine(x, topk_idx, topk_weights, use_fp8, round_scale)
    assert_weighted_combine_close(placement.host(combined), ref, magnitude, topk_idx.size(1))
    return combined, y, handle


def combine_matches_reference(ctx, topo, modes=("bf16", "fp8", "fp8-pow2"), routing: str = "uniform",
                              size: str = "small"):  # fmt: skip
    """Toy experts (y = x (1 + g / 8) per global expert g) on the rows dispatched in each mode, then the weighted
    FP32 combine, against a float64 reference; zero-copy (outputs written into the next combine buffer) and `out=`
    give the same bits."""
    placement = topo.placement
    t_max, hidden, experts_per_rank, num_topk = SIZES[size]
    buffer = sized_buffer(ctx, topo, size)
    num_experts = experts_per_rank * ctx.world_size
    # small: a full rank of tokens, many masked slots; upstream: fewer tokens on the higher ranks
    num_tokens, seed, num_masked = (t_max, 4, 20) if size == "small" else (t_max - 5 * ctx.rank, 2, 10)
    x = make_x(ctx, num_tokens, hidden, seed=seed)
    topk_idx, topk_weights = routing_for(ctx, num_tokens, num_experts, num_topk, seed, routing, num_masked)
    idx_d, w_d = placement.to(topk_idx, topk_weights)
    for mode in modes:
        use_fp8, round_scale, _ = FP8_MODES[mode]
        combined, y, handle = dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, num_experts,
                                                       t_max, use_fp8, round_scale)  # fmt: skip
        got = placement.host(combined)
        # Zero-copy: the expert outputs written into the area the next combine reads.
        area = buffer.get_next_low_latency_combine_buffer(handle)
        area.copy_(y)
        zero_copy, _, _ = buffer.low_latency_combine(area, idx_d, w_d, handle, zero_copy=True)
        assert torch.equal(placement.host(zero_copy), got), f"{mode}: zero-copy combine differs"
        out = placement.to(torch.full((num_tokens, hidden), 7.0, dtype=torch.bfloat16))
        placed, _, _ = buffer.low_latency_combine(y, idx_d, w_d, handle, out=out)
        assert placed.data_ptr() == out.data_ptr(), "out= was not written in place"
        assert torch.equal(placement.host(out), got), f"{mode}: combine into out= differs"


def combine_modes_agree(ctx, topo):
    """Hook, async, zero_copy and out= give bitwise the synchronous combine; hooks run once; async + hook and
    use_logfmt are refused."""
    buffer = ll_buffer(ctx, topo)
    num_experts = 8 * ctx.world_size
    x = make_x(ctx, 50, 1024, seed=5)
    topk_idx, topk_weights = make_routing(ctx, 50, num_experts, 5, seed=5)
    combined, y, handle = dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, num_experts, 64)
    for mode in ("hook", "async"):
        again, event, hook = buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, async_finish=mode == "async", return_recv_hook=mode == "hook"
        )
        run_hook(hook)
        run_hook(hook)  # a second call is a no-op
        event.current_stream_wait()
        assert torch.equal(again, combined), mode
    buffer.get_next_low_latency_combine_buffer(handle).copy_(y)
    out = torch.empty(50, 1024, dtype=torch.bfloat16)
    zero_copied, _, _ = buffer.low_latency_combine(torch.zeros_like(y), topk_idx, topk_weights, handle,
                                                   zero_copy=True, out=out)  # fmt: skip
    assert zero_copied.data_ptr() == out.data_ptr() and torch.equal(out, combined), "zero_copy / out="
    area = buffer.get_next_low_latency_combine_buffer(handle)
    assert area.shape == y.shape and area.dtype == torch.bfloat16
    for kwargs in (dict(async_finish=True, return_recv_hook=True), dict(use_logfmt=True)):
        try:
            buffer.low_latency_combine(y, topk_idx, topk_weights, handle, **kwargs)
        except ValueError:
            continue
        raise AssertionError(f"{kwargs}: no ValueError")


def async_and_hooks(ctx, topo, size: str = "small"):
    """async_finish: the event completes the receive; return_recv_hook: calling the hook completes it (work can run
    between send and hook: on a GPU a sleeping stream), for an FP8 dispatch and the combine; results as the
    synchronous calls'."""
    placement = topo.placement
    t_max, hidden, experts_per_rank, num_topk = SIZES[size]
    buffer = sized_buffer(ctx, topo, size)
    num_experts = experts_per_rank * ctx.world_size
    x = make_x(ctx, t_max, hidden, seed=3)
    topk_idx, topk_weights = routing_for(ctx, t_max, num_experts, num_topk, 3, num_masked=10)
    idx_d, w_d = placement.to(topk_idx, topk_weights)
    ref, magnitude = reference_combine(x, topk_idx, topk_weights, True, False)
    for kwargs in ({"async_finish": True}, {"return_recv_hook": True}):
        recv, _, handle, event, hook = dispatch_checked(ctx, topo, buffer, x, topk_idx, num_experts, "fp8", t_max,
                                                        **kwargs)  # fmt: skip
        assert (hook is not None) == bool(kwargs.get("return_recv_hook")), kwargs
        y = placement.to(expert_outputs(ctx, dequantised(placement.host(recv), True), num_experts))
        combined, event, hook = buffer.low_latency_combine(y, idx_d, w_d, handle, **kwargs)
        if hook is not None:
            placement.busy_stream(1_000_000)  # work between the send and the receive
            hook()
        event.current_stream_wait()
        assert_weighted_combine_close(placement.host(combined), ref, magnitude, num_topk)


def masked_slots_and_empty_rank(ctx, topo):
    """The last rank has no tokens; tokens whose slots are all -1 go nowhere and combine to 0."""
    buffer = ll_buffer(ctx, topo)
    num_experts = 8 * ctx.world_size
    num_tokens = 0 if ctx.rank == ctx.world_size - 1 else 30
    x = make_x(ctx, num_tokens, 1024, seed=6)
    topk_idx, topk_weights = make_routing(ctx, num_tokens, num_experts, 4, seed=6)
    topk_idx[::3] = -1
    combined, _, _ = dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, num_experts, 64)
    assert combined.shape == (num_tokens, 1024) and bool((combined[::3] == 0).all())
    # every token of every rank to one expert, owned by the last rank
    topk_idx = torch.full((num_tokens, 1), num_experts - 1)
    dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, torch.ones(num_tokens, 1), num_experts, 64, use_fp8=True)


def hidden_and_topk_beyond_upstream_limits(ctx, topo):
    """BF16 hidden 100, top-16 (> upstream's 11), and FP8 hidden 896 = 7 x 128."""
    buffer = ll_buffer(ctx, topo)
    num_experts = 8 * ctx.world_size
    x = make_x(ctx, 33, 100, seed=7)
    topk_idx, topk_weights = make_routing(ctx, 33, num_experts, 16, seed=7)
    dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, num_experts, 64)
    x = make_x(ctx, 33, 896, seed=8)
    topk_idx, topk_weights = make_routing(ctx, 33, num_experts, 11, seed=8)
    dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, num_experts, 64, use_fp8=True)


def double_buffering(ctx, topo):
    """Two dispatch results alive at once are both intact; their combines are both right."""
    buffer = ll_buffer(ctx, topo)
    num_experts = 8 * ctx.world_size
    xs = [make_x(ctx, 40, 1024, seed=9), make_x(ctx, 20, 1024, seed=10)]
    routings = [make_routing(ctx, 40, num_experts, 6, seed=9), make_routing(ctx, 20, num_experts, 3, seed=10)]
    results = [
        buffer.low_latency_dispatch(x, topk_idx, 64, num_experts, use_fp8=i == 1)
        for i, (x, (topk_idx, _)) in enumerate(zip(xs, routings))
    ]
    views = []
    for i, ((recv, count, handle, _, _), x, (topk_idx, _)) in enumerate(zip(results, xs, routings)):
        check_dispatch(ctx, x, topk_idx, num_experts, recv, count, handle, use_fp8=i == 1)
        views.append(expert_outputs(ctx, dequantised(recv, i == 1), num_experts))
    data0 = results[0][0].data_ptr()
    assert results[1][0][0].data_ptr() != data0, "consecutive calls must use different halves"
    for (_, _, handle, _, _), y, x, (topk_idx, topk_weights), use_fp8 in zip(results, views, xs, routings, (0, 1)):
        combined, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        ref, magnitude = reference_combine(x, topk_idx, topk_weights, bool(use_fp8))
        assert_weighted_combine_close(combined, ref, magnitude, topk_idx.size(1))


def hook_pending_two_calls_ago_is_refused(ctx, topo):
    """A third call while the first one's hook was never called would overwrite its half: ValueError, no
    communication; after the hook the calls go on."""
    buffer = ll_buffer(ctx, topo)
    num_experts = 8 * ctx.world_size
    x = make_x(ctx, 16, 1024, seed=11)
    topk_idx, topk_weights = make_routing(ctx, 16, num_experts, 2, seed=11)
    first = buffer.low_latency_dispatch(x, topk_idx, 64, num_experts, use_fp8=False, return_recv_hook=True)
    second = buffer.low_latency_dispatch(x, topk_idx, 64, num_experts, use_fp8=False, return_recv_hook=True)
    try:
        buffer.low_latency_dispatch(x, topk_idx, 64, num_experts, use_fp8=False)
    except ValueError as error:
        assert "hook" in str(error), error
    else:
        raise AssertionError("a third call with a pending hook must be refused")
    for recv, count, handle, _, hook in (first, second):
        hook()
        check_dispatch(ctx, x, topk_idx, num_experts, recv, count, handle)
    dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, num_experts, 64)


def wait_stats_name_the_late_rank(ctx, topo):
    """The last rank joins 0.2 s late: every other rank's dispatch / combine wait statistics put ~0.2 s on it and
    little on the others (nanoseconds, added to the given tensors). The collective transport fills none."""
    buffer = ll_buffer(ctx, topo)
    E = 8 * ctx.world_size
    x = make_x(ctx, 16, 1024, seed=17)
    topk_idx, topk_weights = make_routing(ctx, 16, E, 4, seed=17)
    late = ctx.world_size - 1
    dispatch_ns = torch.zeros(ctx.world_size, dtype=torch.int64)
    combine_ns = torch.zeros(ctx.world_size, dtype=torch.int64)
    barrier(ctx)
    if ctx.rank == late:
        time.sleep(0.2)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 64, E, None, dispatch_ns, use_fp8=False)
    barrier(ctx)
    if ctx.rank == late:
        time.sleep(0.2)
    buffer.low_latency_combine(expert_outputs(ctx, recv, E), topk_idx, topk_weights, handle,
                               combine_wait_recv_cost_stats=combine_ns)  # fmt: skip
    if topo.internode:  # the collective transport leaves the statistics untouched (documented)
        assert not dispatch_ns.any() and not combine_ns.any(), (dispatch_ns, combine_ns)
    elif ctx.rank != late:
        for stats in (dispatch_ns, combine_ns):
            assert stats[late] >= 0.1e9, stats
            assert int(stats[:late].max()) < 0.1e9, stats


# ---------------------------------------------------------------------------------------------------------------
# Transports


def collective_transport_equals_shared_memory(ctx, topo):
    """Ranks split into one node each (num_ranks_per_node=1) use torch.distributed all-to-all; every segment,
    count, scale and the combine are bitwise those of the shared-memory transport, in every mode."""
    assert not topo.internode, "compares the two transports on one node"
    shm = ll_buffer(ctx, topo)
    collective = ll_buffer(ctx, topo, "collective", num_ranks_per_node=1)
    assert transport_of(shm) == "shared-memory" and transport_of(collective) == "collective"
    num_experts = 8 * ctx.world_size
    x = make_x(ctx, 45, 1024, seed=12)
    topk_idx, topk_weights = make_routing(ctx, 45, num_experts, 7, seed=12)
    for use_fp8, round_scale, use_ue8m0, mode in (
        (False, False, False, "sync"), (True, False, False, "hook"), (True, True, True, "async"),
    ):  # fmt: skip
        outputs = []
        handles = []
        for buffer in (shm, collective):
            stats = torch.zeros(num_experts // ctx.world_size, dtype=torch.int32)
            recv, count, handle, event, hook = buffer.low_latency_dispatch(
                x, topk_idx, 64, num_experts, stats, None, use_fp8, round_scale, use_ue8m0,
                async_finish=mode == "async", return_recv_hook=mode == "hook",
            )  # fmt: skip
            run_hook(hook)
            event.current_stream_wait()
            handles.append(handle)
            assert torch.equal(stats, count)
            parts = check_dispatch(ctx, x, topk_idx, num_experts, recv, count, handle, use_fp8, round_scale, use_ue8m0)
            y = expert_outputs(ctx, dequantised(recv, use_fp8), num_experts)
            combined, event, hook = buffer.low_latency_combine(
                y, topk_idx, topk_weights, handle, async_finish=mode == "async", return_recv_hook=mode == "hook"
            )
            run_hook(hook)
            event.current_stream_wait()
            outputs.append((count, parts, combined))
        (count_a, parts_a, combined_a), (count_b, parts_b, combined_b) = outputs
        assert torch.equal(count_a, count_b) and torch.equal(combined_a, combined_b)
        for key, (rows, scales, sources) in parts_a.items():
            rows_b, scales_b, sources_b = parts_b[key]
            assert torch.equal(rows, rows_b) and torch.equal(sources, sources_b)
            assert scales is None or torch.equal(scales, scales_b)
        # the collective transport orders each expert's segments by source rank
        begins = [[packed >> 32 for packed in row] for row in handles[1][1].tolist()]
        assert all(b == sorted(b) for b in begins), begins


# ---------------------------------------------------------------------------------------------------------------
# Overlap


def overlap_is_real(ctx, topo, num_tokens: int = 128, hidden: int = 7168):
    """Computation between the dispatch call and hook() overlaps the transfer.

    The transfer (by default 128 tokens x top-8, hidden 7168, BF16: 14.7 MB written per rank; an executor whose
    cost does not grow with the bytes, as Triton's interpreter's, may run it smaller) runs on the buffer's comm
    thread after `low_latency_dispatch(..., return_recv_hook=True)` returns. The computation in between is a
    stand-in for accelerator work: `time.sleep` frees the core. (A CPU-bound computation cannot overlap a CPU
    copy on this 2-core machine: both need the same cores.) With compute time S ~ t = t(dispatch + hook), serial
    execution takes t + S; overlapped it must save at least half of the ideal min(t, S) (it takes max(t, S) at
    best). Medians of interleaved repetitions, all ranks starting together, make it robust to a noisy machine.
    """
    num_experts = 4 * ctx.world_size
    buffer = ll_buffer(ctx, topo, "overlap", num_max_tokens=num_tokens, hidden=hidden, experts_per_rank=4)
    x = make_x(ctx, num_tokens, hidden, seed=13)
    topk_idx, _ = make_routing(ctx, num_tokens, num_experts, 8, seed=13, num_masked=0)

    def run(compute_s: float, check: bool = False) -> float:
        barrier(ctx)
        start = time.perf_counter()
        recv, count, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, num_tokens, num_experts, use_fp8=False, return_recv_hook=True
        )
        if compute_s:
            time.sleep(compute_s)
        hook()
        elapsed = time.perf_counter() - start
        if check:
            check_dispatch(ctx, x, topk_idx, num_experts, recv, count, handle)
        return elapsed

    run(0.1, check=True)  # the overlapped path moves the right rows
    return assert_overlaps(ctx, run, calibrate=5, repeats=9, what="dispatch+hook")


# ---------------------------------------------------------------------------------------------------------------
# Errors, timeouts, recovery


def bad_inputs_raise_value_error_before_communicating(ctx, topo):
    """Each rank hits every error locally; nothing is sent, so the ranks stay in step."""
    buffer = ll_buffer(ctx, topo)
    E = 8 * ctx.world_size
    x = make_x(ctx, 16, 1024, seed=14)
    topk_idx, topk_weights = make_routing(ctx, 16, E, 4, seed=14)
    recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 64, E, use_fp8=False)
    y = expert_outputs(ctx, recv, E)
    duplicate = topk_idx.clone()
    duplicate[0, 1] = duplicate[0, 0] = 3
    normal = topo.buffer(ctx, 1 << 20)
    dispatch = buffer.low_latency_dispatch
    combine = buffer.low_latency_combine
    cases = {
        "more tokens than num_max_dispatch_tokens_per_rank": lambda: dispatch(x, topk_idx, 8, E),
        "expert id >= num_experts": lambda: dispatch(x, topk_idx.clamp(min=0) + E, 64, E),
        "expert id < -1": lambda: dispatch(x, topk_idx - 5, 64, E),
        "duplicate expert in a row": lambda: dispatch(x, duplicate, 64, E),
        "experts not divisible by ranks": lambda: dispatch(x, topk_idx, 64, E + 1),
        "x float32": lambda: dispatch(x.float(), topk_idx, 64, E),
        "x 1-D": lambda: dispatch(x[0], topk_idx, 64, E),
        "x on another device": lambda: dispatch(x.to("meta"), topk_idx, 64, E),
        "topk_idx int32": lambda: dispatch(x, topk_idx.int(), 64, E),
        "topk_idx rows": lambda: dispatch(x[:8], topk_idx, 64, E),
        "FP8 hidden not a multiple of 128": lambda: dispatch(x[:, :100], topk_idx, 64, E, use_fp8=True),
        "ue8m0 without round_scale": lambda: dispatch(x, topk_idx, 64, E, use_fp8=True, use_ue8m0=True),
        "async and hook": lambda: dispatch(x, topk_idx, 64, E, async_finish=True, return_recv_hook=True),
        "stats shape": lambda: dispatch(x, topk_idx, 64, E, torch.zeros(3, dtype=torch.int32)),
        "wait stats dtype": lambda: dispatch(x, topk_idx, 64, E, None, torch.zeros(ctx.world_size)),
        "region too small": lambda: dispatch(x, topk_idx, 4096, E),
        "combine x shape": lambda: combine(y[:, :8], topk_idx, topk_weights, handle),
        "combine weights dtype": lambda: combine(y, topk_idx, topk_weights.double(), handle),
        "combine expert id": lambda: combine(y, topk_idx.clamp(min=0) + E, topk_weights, handle),
        "combine out dtype": lambda: combine(y, topk_idx, topk_weights, handle, out=torch.empty(16, 1024)),
        "not a handle": lambda: combine(y, topk_idx, topk_weights, handle[:3]),
        "corrupt handle": lambda: combine(y, topk_idx, topk_weights, (handle[0] + 1000, *handle[1:])),
        "not low-latency mode": lambda: normal.low_latency_dispatch(x, topk_idx, 64, E),
    }
    errors = assert_value_errors(cases)
    assert "get_low_latency_rdma_size_hint" in str(errors["region too small"]), errors["region too small"]
    dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, E, 64)  # still in step with the peers


def mismatched_calls_raise_on_every_rank(ctx, topo):
    """Rank 0 dispatches FP8 while the others dispatch BF16: every rank gets GroupMismatchError, and the buffer
    stays usable for the next call."""
    buffer = ll_buffer(ctx, topo)
    E = 8 * ctx.world_size
    x = make_x(ctx, 16, 1024, seed=15)
    topk_idx, topk_weights = make_routing(ctx, 16, E, 4, seed=15)
    try:
        buffer.low_latency_dispatch(x, topk_idx, 64, E, use_fp8=ctx.rank == 0)
    except deep_ep.GroupMismatchError as error:
        assert "disagree" in str(error), error
    else:
        raise AssertionError("expected GroupMismatchError")
    dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, E, 64)


def missing_rank_times_out_then_clean_recovers(ctx, topo, timeout_s):
    """Rank 1 skips a dispatch (staying alive): the others time out naming it; after clean_low_latency_buffer on
    every rank the buffer works again. Then rank 1 destroys its buffer: a peer waiting for it fails at once."""
    E = 4 * ctx.world_size
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(32, 256, ctx.world_size, E)
    buffer = topo.new_buffer(
        ctx, 0, num_rdma_bytes=hint, low_latency_mode=True, explicitly_destroy=True, timeout_s=timeout_s
    )
    x = make_x(ctx, 32, 256, seed=16)
    topk_idx, topk_weights = make_routing(ctx, 32, E, 3, seed=16)
    outcome = []
    try:
        if ctx.rank == 1:
            time.sleep(timeout_s + 1.0)
        else:
            start = time.perf_counter()
            try:
                buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
            except deep_ep.CommTimeoutError as error:
                assert "rank(s) [1] did not arrive" in str(error) and "dispatch" in str(error), error
                assert timeout_s <= time.perf_counter() - start < timeout_s + 5
                outcome.append("timeout")
        buffer.clean_low_latency_buffer(32, 256, E)
        dispatch_compute_combine(ctx, topo, buffer, x, topk_idx, topk_weights, E, 32)
        barrier(ctx)
        if ctx.rank == 1:
            buffer.destroy()
            outcome.append("destroyed")
        elif ctx.rank == 0:
            start = time.perf_counter()
            try:
                buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
            except deep_ep.CommError as error:
                assert "rank 1 failed" in str(error) and "destroyed" in str(error), error
                assert time.perf_counter() - start < timeout_s
                outcome.append("peer-destroyed")
        barrier(ctx)
    finally:
        buffer.destroy()
    return outcome
