"""Cases for the split combine (`combine_begin` / `combine_end`), run in every rank of a `RankPool` by
test_moe_seams.py: results do not depend on work run between the two calls, and for the asynchronous dispatchers that
work runs while the combine is in flight."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from moe.layer.dispatcher import build_dispatcher
from moe.layer.dispatcher.buffers import EPBuffers

from .ep_buffer_cases import config
from .moe_testlib import ep_group

E, K = 8, 3


def _inputs(ctx, num_tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    """This rank's `(x [T, H], probs [T, K] float32, topk_idx [T, K] int64, grad_out [T, H])`, with a dropped slot
    and a fully dropped token."""
    gen = torch.Generator().manual_seed(1000 * seed + ctx.rank)
    T = num_tokens + 2 * ctx.rank
    x = torch.randn(T, hidden, generator=gen).to(dtype)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    idx[1, 1:] = -1
    idx[2] = -1
    return x, torch.rand(T, K, generator=gen), idx, torch.randn(T, hidden, generator=gen)


def _busy_work() -> torch.Tensor:
    """Independent compute of a few milliseconds (what a schedule overlaps with the combine)."""
    a = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
    for _ in range(20):
        a = torch.tanh(a @ a) * 0.5
    return a


def _run(dispatcher, x, probs, idx, grad_out, work_between: bool, differentiable: bool):
    """Dispatch, a non-linear "expert", combine (plain, or begin -> work -> end); then the backward if
    `differentiable`. Returns the output and the gradients of x and probs."""
    x = x.clone().requires_grad_(differentiable)
    probs = probs.clone().requires_grad_(differentiable)
    result = dispatcher.dispatch(x, probs, idx)
    scale_H = torch.linspace(0.5, 1.5, x.size(1))
    y_NH = torch.tanh(result.expert_input_NH.float() * scale_H).to(x.dtype)
    if work_between:
        pending = dispatcher.combine_begin(y_NH, result.handle)
        _busy_work()
        out = dispatcher.combine_end(pending)
    else:
        out = dispatcher.combine(y_NH, result.handle)
    if not differentiable:
        return [out]
    (out.float() * grad_out).sum().backward()
    return [out.detach(), x.grad, probs.grad]


def combine_is_the_same_with_work_in_between(ctx) -> None:
    """Every built-in dispatcher: `combine_begin` -> other work -> `combine_end` gives bitwise what `combine`
    gives, forward and backward ('flex_ll' is inference only: forward, bfloat16)."""
    group = ep_group(ctx)
    ep_buffers = EPBuffers()
    results = {}
    for name in ("alltoall", "allgather", "flex", "flex_ll"):
        dispatcher = build_dispatcher(config(64, name, moe_flex_ll_num_max_dispatch_tokens_per_rank=16), group,
                                      ep_buffers)  # fmt: skip
        differentiable = name != "flex_ll"
        inputs = _inputs(ctx, 9, 64, torch.float32 if differentiable else torch.bfloat16, seed=3)
        with torch.set_grad_enabled(differentiable):
            for between in (False, True):
                results[name, between] = _run(dispatcher, *inputs, between, differentiable)
    ep_buffers.destroy()

    for name in ("alltoall", "allgather", "flex", "flex_ll"):
        for i, (a, b) in enumerate(zip(results[name, False], results[name, True])):
            assert torch.equal(a, b), f"{name}: tensor {i} (output, x grad, probs grad) changed by the work between"
    for name in ("allgather", "flex"):
        torch.testing.assert_close(results[name, True][0], results["alltoall", True][0], msg=f"{name} vs alltoall")


def _in_flight(dispatcher_name: str, pending) -> bool:
    """Whether the combine of `pending` has not completed yet (observed without waiting)."""
    if dispatcher_name == "flex":
        return isinstance(pending.event, deep_ep.EventOverlap) and not pending.event.query()
    return pending.a2a.work is not None and not pending.a2a.work.is_completed()


def work_runs_while_the_combine_is_in_flight(ctx, dispatcher_name: str) -> None:
    """'flex' and 'alltoall' (`supports_async_combine`), under autograd: right after `combine_begin` returns, its
    communication is still in flight (an incomplete `EventOverlap`, an incomplete all-to-all work) while independent
    work starts. The observation is timing-dependent (4 MB per rank move in milliseconds; the check runs microseconds
    after `combine_begin` returns), so it must hold in at least one of up to 10 attempts on every rank; the ranks agree
    on stopping, so they run the same collectives. A synchronous combine fails every attempt."""
    group = ep_group(ctx)
    ep_buffers = EPBuffers()
    T, H = 1024, 1024
    dispatcher = build_dispatcher(config(H, dispatcher_name), group, ep_buffers)
    x, probs, idx, _ = _inputs(ctx, T, H, torch.float32, seed=5)
    result = dispatcher.dispatch(x.requires_grad_(), probs, idx)  # the combine is recorded by autograd
    attempts, seen = [], False
    for _ in range(10):
        gc.collect()  # no finalizer inside the observed window
        pending = dispatcher.combine_begin(result.expert_input_NH, result.handle)
        in_flight = _in_flight(dispatcher_name, pending)
        _busy_work()
        dispatcher.combine_end(pending)
        attempts.append(in_flight)
        seen |= in_flight
        everyone = torch.tensor([int(seen)])
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
        if everyone.item():
            break
    ep_buffers.destroy()

    assert dispatcher.supports_async_combine
    assert seen, f"the combine had always completed when combine_begin returned ({len(attempts)} attempts)"


CASES = {
    "combine_same_with_work_in_between": combine_is_the_same_with_work_in_between,
    "combine_in_flight_flex": lambda ctx: work_runs_while_the_combine_is_in_flight(ctx, "flex"),
    "combine_in_flight_alltoall": lambda ctx: work_runs_while_the_combine_is_in_flight(ctx, "alltoall"),
}
