"""Cases run in the rank processes of tests/triton: the triton executor against the CPU executor, call by call, on
the same inputs. Dispatch moves bytes: its outputs and handle must be bit-identical. Combine sums in FP32 in the same
order (rank order, then the biases): equal within FP32 summation order (asserted exactly where it is, bf16 rounding
included, and within one unit in the last place otherwise)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

import mtdeepep as deep_ep
from mtdeepep.utils.fp8 import per_token_cast_to_fp8

from ..conformance.common import make_inputs


@contextmanager
def engine(name: str):
    previous = os.environ.get("MTDEEPEP_ENGINE")
    os.environ["MTDEEPEP_ENGINE"] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MTDEEPEP_ENGINE")
        else:
            os.environ["MTDEEPEP_ENGINE"] = previous


def buffers(ctx, num_nvl_bytes: int = 16 << 20) -> tuple[deep_ep.Buffer, deep_ep.Buffer]:
    """`(cpu, triton)` buffers of the rank's group (cached across cases)."""
    if "parity" not in ctx.cache:
        with engine("cpu"):
            cpu = deep_ep.Buffer(ctx.group, num_nvl_bytes)
        with engine("triton"):
            tri = deep_ep.Buffer(ctx.group, num_nvl_bytes)
        ctx.cache["parity"] = (cpu, tri)
    return ctx.cache["parity"]


def _equal(a, b, what: str) -> None:
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{what}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, what
        return
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1 else a,
            b.view(torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b,
        ), what
        return
    assert a == b, (what, a, b)


def _dispatch_both(cpu, tri, x, topk_idx, topk_weights, num_experts, **kwargs):
    results = []
    for buffer in (cpu, tri):
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        results.append(
            (
                (per_rank, per_expert, in_rank),
                buffer.dispatch(
                    x,
                    num_tokens_per_rank=per_rank,
                    is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert,
                    topk_idx=topk_idx,
                    topk_weights=topk_weights,
                    **kwargs,
                ),
            )
        )
    return results


def dispatch_and_combine_match_cpu(ctx, dtype_name: str = "bfloat16", num_worst_tokens: int = 0,
                                   expert_alignment: int = 1, with_bias: bool = False):  # fmt: skip
    cpu, tri = buffers(ctx)
    dtype = getattr(torch, dtype_name)
    num_experts, hidden = 8 * ctx.world_size, 96
    x, topk_idx, topk_weights = make_inputs(ctx, 40, hidden, num_experts, 4, seed=7, dtype=dtype)
    (layout_c, out_c), (layout_t, out_t) = _dispatch_both(
        cpu, tri, x, topk_idx, topk_weights, num_experts, num_worst_tokens=num_worst_tokens,
        expert_alignment=expert_alignment,
    )  # fmt: skip
    _equal(layout_c, layout_t, "layout")
    # Rows past the received ones (num_worst_tokens padding) are unspecified in x; top-k, weights and the source
    # index mark them (-1, 0, -1) and are compared whole.
    valid = int((out_t[4][3] >= 0).sum())
    _equal(out_c[0][:valid], out_t[0][:valid], "recv_x")
    _equal(out_c[1:4], out_t[1:4], "dispatch outputs")
    _equal(tuple(out_c[4]), tuple(out_t[4]), "handle")
    recv_x, recv_idx, recv_w, _, handle, _ = out_t
    bias = None
    if with_bias:
        generator = torch.Generator().manual_seed(ctx.rank)
        bias = (
            torch.randn(x.shape, generator=generator).to(dtype),
            torch.randn(x.shape, generator=generator).to(dtype),
        )
    combined = []
    for buffer, out in ((cpu, out_c), (tri, out_t)):
        y = (out[0].float() * 1.5).to(dtype)
        combined.append(buffer.combine(y, out[4], topk_weights=out[2], bias=bias)[:2])
    _equal(combined[0], combined[1], "combine")
    return int(recv_x.size(0))


def fp8_and_cached_dispatch_match_cpu(ctx):
    cpu, tri = buffers(ctx)
    num_experts, hidden = 4 * ctx.world_size, 256
    x, topk_idx, topk_weights = make_inputs(ctx, 24, hidden, num_experts, 2, seed=11)
    x_fp8 = per_token_cast_to_fp8(x)
    (_, out_c), (_, out_t) = _dispatch_both(cpu, tri, x_fp8, topk_idx, topk_weights, num_experts)
    _equal(out_c[0], out_t[0], "fp8 rows and scales")
    _equal(out_c[1:4], out_t[1:4], "fp8 top-k and counts")
    again = [buffer.dispatch(x, handle=out[4])[0] for buffer, out in ((cpu, out_c), (tri, out_t))]
    _equal(again[0], again[1], "cached dispatch")
