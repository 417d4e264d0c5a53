"""Low-latency dispatch/combine latency of mtdeepep's CPU executor, against an all-to-all baseline.

Setting (upstream DeepEP's low-latency benchmark): 128 tokens per rank, hidden 7168, top-8 of random scores, at 2
and 4 ranks of this host. Experts: 36 per rank (upstream's 288 experts at EP8), i.e. 72 at 2 ranks and 144 at 4.

- dispatch fp8:  `low_latency_dispatch(x, topk_idx, 128, E, use_fp8=True)`, x bfloat16 `[128, 7168]`; the sender
  casts to E4M3 with per-128-channel float32 scales.
- dispatch bf16: the same with `use_fp8=False`.
- combine bf16:  `low_latency_combine(y, topk_idx, topk_weights, handle)`, y the bfloat16 expert outputs
  `[E_local, R * 128, 7168]`; weighted FP32 reduction per token.

Bytes, as upstream's test: per (token, expert) selection with a valid expert id, dispatch fp8 moves
`H + H / 128 * 4 + 16` bytes (E4M3 row, scales, a 16-byte header), dispatch bf16 `2 H + 16`, combine `2 H`;
GB/s = this rank's selections x bytes / its median time. The table shows the slowest rank (largest median).
Timing: a gloo barrier before every call so all ranks start together, `perf_counter` around the synchronous call,
median over `--iters` iterations, mtdeepep and the baseline interleaved iteration by iteration. Each rank runs
`max(1, cores // ranks)` intra-op threads (plus the buffer's comm thread).

Baseline ("all-to-all"), in the same processes: what a user writes with `torch.distributed.all_to_all_single`
over gloo. Dispatch: cast with `per_token_cast_to_fp8` (fp8), pack one message per selection (16-byte header
with token and local expert, the row, the scales) grouped by destination rank, exchange the counts, then the
messages. Combine: the expert rows go back the same way (reverse all-to-all), then the weighted FP32 sum per token
(`index_add_`). Both are checked once against mtdeepep before timing: every (expert, source) segment holds the same
bytes; combined outputs agree within one bfloat16 rounding (the summation order differs).

Run (about a minute on a 2-core machine):

    .venv/bin/python bench/low_latency.py                    # 2 and 4 ranks, table + bench/results/low_latency.json
    .venv/bin/python bench/low_latency.py --num-ranks 2 --iters 50

Legend: T tokens per rank, H hidden, K top-k, E experts, R ranks, E_local = E / R.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import _common as common
import torch
import torch.distributed as dist
from _common import (
    OpCase,
    add_json_option,
    combine_parity,
    config_from_args,
    config_parser,
    environment,
    exchange_rows,
    print_table,
    random_routing,
    run_ranks,
    save_results,
    slowest_rank_timing,
    threads_per_rank,
    time_cases,
)

import mtdeepep as deep_ep
from mtdeepep.utils.fp8 import per_token_cast_to_fp8

OPS = ("dispatch fp8", "dispatch bf16", "combine bf16")
IMPLS = ("mtdeepep", "all-to-all")
HEADER_BYTES = 16  # upstream's per-message header (source token index + reserved), counted in its formula


@dataclass(frozen=True)
class BenchConfig(common.BenchConfig):
    tokens: int = 128
    iters: int = 30
    warmup: int = 3
    experts_per_rank: int = 36
    seed: int = 0


# ---------------------------------------------------------------------------------------------------------------
# Inputs and byte counts


@dataclass
class RankInputs:
    x_TH: torch.Tensor  # bfloat16
    topk_idx_TK: torch.Tensor  # int64
    topk_weights_TK: torch.Tensor  # float32


def make_inputs(cfg: BenchConfig, rank: int, num_experts: int) -> RankInputs:
    return RankInputs(*random_routing(cfg.tokens, cfg.hidden, num_experts, cfg.topk, cfg.seed * 1000 + rank))


def upstream_bytes(op: str, num_selections: int, hidden: int) -> int:
    per_selection = {
        "dispatch fp8": hidden + hidden // 128 * 4 + HEADER_BYTES,
        "dispatch bf16": 2 * hidden + HEADER_BYTES,
        "combine bf16": 2 * hidden,
    }[op]
    return num_selections * per_selection


# ---------------------------------------------------------------------------------------------------------------
# Baseline: torch.distributed.all_to_all_single over gloo


@dataclass
class A2ARoute:
    """This rank's selections as messages, grouped by destination rank (by global expert, then token)."""

    token_S: torch.Tensor  # source token of each message
    expert_S: torch.Tensor  # global expert of each message
    weight_S: torch.Tensor  # its top-k weight (for the combine)
    send_splits: list[int]  # messages to each rank
    recv_splits: list[int]  # messages from each rank


def a2a_route(inputs: RankInputs, num_experts: int, group: dist.ProcessGroup) -> A2ARoute:
    topk_idx_TK = inputs.topk_idx_TK
    valid_TK = topk_idx_TK >= 0
    token_S = torch.arange(topk_idx_TK.size(0)).view(-1, 1).expand_as(topk_idx_TK)[valid_TK]
    expert_S = topk_idx_TK[valid_TK]
    order = torch.argsort(expert_S * topk_idx_TK.size(0) + token_S)
    send_R = torch.bincount(expert_S[order] // (num_experts // group.size()), minlength=group.size())
    recv_R = torch.empty_like(send_R)
    dist.all_to_all_single(recv_R, send_R, group=group)
    return A2ARoute(
        token_S[order], expert_S[order], inputs.topk_weights_TK[valid_TK][order], send_R.tolist(), recv_R.tolist()
    )


def a2a_dispatch(inputs: RankInputs, num_experts: int, use_fp8: bool, group) -> tuple[torch.Tensor, A2ARoute]:
    """Returns the received messages `[N, 16 + row bytes]` uint8 (header: int32 token, int32 local expert, 8 zero
    bytes; then the E4M3 row and its float32 scales, or the bf16 row) and the route for the combine."""
    route = a2a_route(inputs, num_experts, group)
    if use_fp8:
        e4m3_TH, scales_TS = per_token_cast_to_fp8(inputs.x_TH)
        rows_TB = torch.cat([e4m3_TH.view(torch.uint8), scales_TS.view(torch.uint8)], dim=1)
    else:
        rows_TB = inputs.x_TH.view(torch.uint8)
    header_S4 = torch.zeros(route.token_S.numel(), 4, dtype=torch.int32)
    header_S4[:, 0] = route.token_S
    header_S4[:, 1] = route.expert_S % (num_experts // group.size())
    messages_SB = torch.cat([header_S4.view(torch.uint8), rows_TB.index_select(0, route.token_S)], dim=1)
    return exchange_rows(messages_SB, route.send_splits, route.recv_splits, group), route


def a2a_combine(y_NH: torch.Tensor, route: A2ARoute, num_tokens: int, group, magnitude: bool = False):
    """The expert rows go back (reverse all-to-all); the weighted sum per token in FP32, rounded once. With
    `magnitude`, also returns sum |w y| per element (for the parity check's bound)."""
    back_SH = exchange_rows(y_NH, route.recv_splits, route.send_splits, group)
    weighted_SH = back_SH.float() * route.weight_S.view(-1, 1)
    acc_TH = torch.zeros(num_tokens, y_NH.size(1), dtype=torch.float32)
    acc_TH.index_add_(0, route.token_S, weighted_SH)
    if not magnitude:
        return acc_TH.to(torch.bfloat16)
    return acc_TH.to(torch.bfloat16), torch.zeros_like(acc_TH).index_add_(0, route.token_S, weighted_SH.abs())


# ---------------------------------------------------------------------------------------------------------------
# Expert outputs, identical for both implementations, and the parity checks


def expert_factor_E(experts: torch.Tensor) -> torch.Tensor:
    return 1.0 + experts.float() / 64.0


def message_rows(received_NB: torch.Tensor, hidden: int, use_fp8: bool) -> torch.Tensor:
    """The bf16 rows an expert GEMM reads from the baseline's messages (FP8 cast back per block)."""
    payload = received_NB[:, HEADER_BYTES:]
    if not use_fp8:
        return payload.contiguous().view(torch.bfloat16)
    e4m3 = payload[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scales = payload[:, hidden:].contiguous().view(torch.float32)
    blocks = e4m3.float().view(-1, hidden // 128, 128) * scales.unsqueeze(2)
    return blocks.view(-1, hidden).bfloat16()


def ours_expert_outputs(recv, recv_count: torch.Tensor, first_expert: int) -> torch.Tensor:
    """bf16 `[E_local, R * T, H]`: for the valid rows of each local expert, its FP8 rows cast back per block times
    the expert's factor (the other rows are never read by the combine and stay 0)."""
    data, scales = recv
    y = torch.zeros(data.shape, dtype=torch.bfloat16)
    for e, n in enumerate(recv_count.tolist()):
        blocks = data[e, :n].float().view(n, -1, 128) * scales[e, :n].unsqueeze(2)
        rows = blocks.view(n, -1).bfloat16()  # as `message_rows`: the GEMM reads bf16
        y[e, :n] = (rows.float() * expert_factor_E(torch.tensor(first_expert + e))).bfloat16()
    return y


def baseline_segments(received_NB: torch.Tensor, recv_splits: list[int], experts_per_rank: int):
    """{(local expert, source): message rows} of the baseline, in token order."""
    header = received_NB[:, :8].contiguous().view(torch.int32)
    out, start = {}, 0
    for source, count in enumerate(recv_splits):
        experts = header[start : start + count, 1]
        for e in range(experts_per_rank):
            out[(e, source)] = received_NB[start : start + count][experts == e]
        start += count
    return out


def check_dispatch_parity(op: str, recv, handle, received_NB, route: A2ARoute, hidden: int, use_fp8: bool):
    """Every (expert, source) segment of mtdeepep holds the baseline's messages for it, byte for byte."""
    src_info, layout_range = handle[0], handle[1]
    data, scales = recv if use_fp8 else (recv, None)
    for (e, source), messages in baseline_segments(received_NB, route.recv_splits, layout_range.size(0)).items():
        packed = int(layout_range[e, source])
        rows = slice(packed >> 32, (packed >> 32) + (packed & 0xFFFFFFFF))
        tokens = messages[:, :4].contiguous().view(torch.int32).flatten()
        same = torch.equal(src_info[e, rows], tokens)
        if use_fp8:
            same &= torch.equal(data[e, rows].view(torch.uint8), messages[:, HEADER_BYTES : HEADER_BYTES + hidden])
            same &= torch.equal(scales[e, rows].contiguous().view(torch.uint8), messages[:, HEADER_BYTES + hidden :])
        else:
            same &= torch.equal(data[e, rows].view(torch.uint8), messages[:, HEADER_BYTES:])
        if not same:
            raise AssertionError(
                f"{op}: expert {e}, source {source}: mtdeepep and the baseline received different rows"
            )


def check_combine_parity(ours: torch.Tensor, theirs: torch.Tensor, magnitude: torch.Tensor, num_topk: int):
    """Both sum K products in FP32 (each step within 2^-24 of sum |w y|) and round once to bf16, in different
    orders: allow one bf16 ulp of the larger result plus 2 K 2^-24 sum |w y|."""
    a, b = ours.float(), theirs.float()
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    bound = torch.ldexp(torch.ones_like(a), exponent - 8) + 2 * num_topk * 2.0**-24 * magnitude
    if not bool(((a - b).abs() <= bound).all()):
        raise AssertionError(
            f"combine: mtdeepep and the baseline differ beyond FP32 reordering ({(a - b).abs().max()})"
        )
    return {"bit_exact": bool(torch.equal(ours, theirs)), "max_abs_diff": float((a - b).abs().max())}


# ---------------------------------------------------------------------------------------------------------------
# One rank


def dispatch_case(op: str, buffer, inputs: RankInputs, cfg: BenchConfig, num_experts: int, group) -> OpCase:
    use_fp8 = op == "dispatch fp8"
    recv, _, handle, _, _ = buffer.low_latency_dispatch(inputs.x_TH, inputs.topk_idx_TK, cfg.tokens, num_experts,
                                                        use_fp8=use_fp8)  # fmt: skip
    received, route = a2a_dispatch(inputs, num_experts, use_fp8, group)
    check_dispatch_parity(op, recv, handle, received, route, cfg.hidden, use_fp8)
    fns = {
        "mtdeepep": lambda: buffer.low_latency_dispatch(
            inputs.x_TH, inputs.topk_idx_TK, cfg.tokens, num_experts, use_fp8=use_fp8
        ),
        "all-to-all": lambda: a2a_dispatch(inputs, num_experts, use_fp8, group),
    }
    num_bytes = upstream_bytes(op, int((inputs.topk_idx_TK >= 0).sum()), cfg.hidden)
    return OpCase(op, num_bytes, fns, {"identical": True})


def combine_case(buffer, inputs: RankInputs, cfg: BenchConfig, num_experts: int, group, rank: int) -> OpCase:
    """Both combine the same expert outputs: bf16(dequantised FP8 row x (1 + global expert / 64))."""
    experts_per_rank = num_experts // group.size()
    recv, recv_count, handle, _, _ = buffer.low_latency_dispatch(
        inputs.x_TH, inputs.topk_idx_TK, cfg.tokens, num_experts
    )
    y_ours = ours_expert_outputs(recv, recv_count, rank * experts_per_rank)
    received, route = a2a_dispatch(inputs, num_experts, True, group)
    experts_N = received[:, 4:8].contiguous().view(torch.int32).flatten() + rank * experts_per_rank
    y_base = (message_rows(received, cfg.hidden, True).float() * expert_factor_E(experts_N).view(-1, 1)).bfloat16()
    args = (inputs.topk_idx_TK, inputs.topk_weights_TK, handle)
    ours = buffer.low_latency_combine(y_ours, *args)[0]
    theirs, magnitude = a2a_combine(y_base, route, cfg.tokens, group, magnitude=True)
    parity = check_combine_parity(ours, theirs, magnitude, cfg.topk)
    fns = {
        "mtdeepep": lambda: buffer.low_latency_combine(y_ours, *args),
        "all-to-all": lambda: a2a_combine(y_base, route, cfg.tokens, group),
    }
    num_bytes = upstream_bytes("combine bf16", int((inputs.topk_idx_TK >= 0).sum()), cfg.hidden)
    return OpCase("combine bf16", num_bytes, fns, parity)


def bench_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    num_experts = cfg.experts_per_rank * num_ranks
    inputs = make_inputs(cfg, rank, num_experts)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(cfg.tokens, cfg.hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=cfg.experts_per_rank,
                            explicitly_destroy=True)  # fmt: skip
    try:
        cases = [dispatch_case(op, buffer, inputs, cfg, num_experts, group) for op in OPS[:2]]
        cases.append(combine_case(buffer, inputs, cfg, num_experts, group, rank))
        result = time_cases(cases, cfg.iters, cfg.warmup, group)
    finally:
        buffer.destroy()
    return {**result, "region_bytes": hint}


# ---------------------------------------------------------------------------------------------------------------
# Report


def summarize(num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op: the slowest rank's median time and its GB/s, plus per-rank numbers for the JSON."""
    rows = []
    for op in OPS:
        row: dict[str, Any] = {"num_ranks": num_ranks, "op": op}
        for impl in IMPLS:
            row[impl] = slowest_rank_timing(per_rank, op, impl, "us")
        row["speedup"] = row["all-to-all"]["time_us"] / row["mtdeepep"]["time_us"]
        row["bytes_per_rank"] = [r["bytes"][op] for r in per_rank]
        row["parity"] = [r["parity"][op] for r in per_rank]
        rows.append(row)
    return rows


TABLE_HEADERS = ("ranks", "op", "mtdeepep us", "GB/s", "all-to-all us", "GB/s ", "speedup")
TABLE_NOTE = (
    "Slowest rank's median time per call; GB/s = that rank's bytes by upstream's formula (per valid selection:\n"
    "fp8 H + H/128*4 + 16, bf16 dispatch 2H + 16, combine 2H) / time; speedup = all-to-all time / mtdeepep time."
)


def table_row(row: dict[str, Any]) -> list[str]:
    return [
        str(row["num_ranks"]),
        row["op"],
        f"{row['mtdeepep']['time_us']:.0f}",
        f"{row['mtdeepep']['gbps']:.2f}",
        f"{row['all-to-all']['time_us']:.0f}",
        f"{row['all-to-all']['gbps']:.2f}",
        f"{row['speedup']:.2f}x",
    ]


def parity_line(rows: list[dict[str, Any]]) -> str:
    combined = combine_parity(rows, "within FP32 reordering + one bf16 rounding")
    return (
        "parity with the all-to-all baseline (checked once on every rank): every (expert, source) segment holds the "
        f"same bytes; combined output {combined}"
    )


def main() -> None:
    parser = config_parser(__doc__, BenchConfig(), ("iters", "warmup", "experts_per_rank"), ranks="2,4")
    add_json_option(parser, "low_latency", "--output")
    args = parser.parse_args()
    cfg = config_from_args(BenchConfig, args)

    rows = []
    for num_ranks in args.num_ranks:
        per_rank = run_ranks(bench_rank, num_ranks, args=(cfg,))
        rows.extend(summarize(num_ranks, per_rank))
    print_table(TABLE_HEADERS, [table_row(row) for row in rows], TABLE_NOTE, parity_line(rows))
    threads = {n: threads_per_rank(n) for n in args.num_ranks}
    save_results(
        args.json, {"config": asdict(cfg), "threads_per_rank": threads, "environment": environment(), "results": rows}
    )


if __name__ == "__main__":
    main()
