"""Cases for the delayed expert weight gradients (`overlap_dispatch_backward_with_experts_wgrad`, moe/layer/wgrad.py),
run in every rank of a `RankPool` by test_moe_seams.py: gradients bitwise those without the delay, and the
weight-gradient GEMMs run between the start and the wait of the dispatch's backward communication. Collectives of a case
run before its assertions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch
import torch.distributed as dist

import moe.layer.dispatcher.comm as comm
import mtdeepep as deep_ep
from moe import EPBuffers, MoEConfig, MoELayer
from moe.layer import wgrad as wgrad_module
from moe.layer.fp8 import Fp8SwiGLUExperts
from moe.layer.fp8.recipe import BlockwiseScaling, DelayedScaling
from mtdeepep import in_flight

from .ep_buffer_cases import config
from .moe_testlib import ep_group

H = 32

# (dispatcher, MoEConfig overrides, hidden, dtype, FP8 recipe of `moe.layer.fp8` or None).
VARIANTS = {
    "flex": ("flex", {}, H, torch.float32, None),
    "flex_shared_overlap_aux": (
        "flex",
        dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_overlap=True, moe_aux_loss_coeff=0.01),
        H,
        torch.float32,
        None,
    ),  # fmt: skip
    "flex_light": ("flex", dict(moe_recompute_level="light"), H, torch.float32, None),
    "flex_medium": ("flex", dict(moe_recompute_level="medium"), H, torch.float32, None),
    "flex_full": ("flex", dict(moe_recompute_level="full"), H, torch.float32, None),
    "flex_loop_bf16": ("flex", dict(moe_grouped_gemm=False), H, torch.bfloat16, None),
    "flex_padded": ("flex", dict(moe_padded_batch_gemm=True), H, torch.float32, None),
    "flex_fp8_e4m3": ("flex", dict(fp8="e4m3"), 128, torch.float32, None),
    "flex_fp8_blockwise_bf16": ("flex", {}, 128, torch.bfloat16, BlockwiseScaling()),
    "flex_fp8_delayed_bf16": ("flex", {}, 128, torch.bfloat16, DelayedScaling()),
    "flex_fp8_dispatch": ("flex", dict(moe_flex_use_fp8=True), 128, torch.float32, None),
    "alltoall": ("alltoall", {}, H, torch.float32, None),
    "alltoall_medium_bf16": ("alltoall", dict(moe_recompute_level="medium"), H, torch.bfloat16, None),
    "allgather": ("allgather", {}, H, torch.float32, None),
}
# Variants also run with both micro-batches' forwards before one backward (two stores in flight at once).
TOGETHER = ("flex", "flex_full", "flex_fp8_delayed_bf16", "alltoall")


def _train(layer: MoELayer, ctx, hidden: int, dtype: torch.dtype, together: bool) -> list[torch.Tensor]:
    """Two micro-batches accumulated into the same `.grad` (one backward after the other, or both forwards then one
    backward of the sum when `together`); returns the outputs, the input grads and every parameter grad."""
    gen = torch.Generator().manual_seed(70 + ctx.rank)
    xs = [torch.randn(11 + 2 * ctx.rank + mb, hidden, generator=gen).to(dtype).requires_grad_() for mb in range(2)]
    grads = [torch.randn(x.shape, generator=gen).to(dtype) for x in xs]
    outs = []
    for x, g in zip(xs, grads):
        out = layer(x)
        outs.append(out)
        if not together:
            out.backward(g)
    if together:
        torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [x.grad for x in xs] + [p.grad for p in layer.parameters()]


@contextlib.contextmanager
def _patched(owner, name: str, value):
    """`owner.name = value` inside the block."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _logging_put(on_run):
    """A `WeightGradStore.put` whose queued closures call `on_run()` when they start."""
    put = wgrad_module.WeightGradStore.put

    def logged_put(self, index, fn):
        def run():
            on_run()
            return fn()

        return put(self, index, run)

    return logged_put


def delayed_wgrad_is_bitwise_the_undelayed(ctx) -> dict[str, int]:
    """Every variant (dispatchers, recompute levels, FP8 experts of both kinds, FP8 dispatch, shared expert, bf16),
    two micro-batches of gradient accumulation: outputs, input gradients and every parameter gradient with the
    delay are bitwise those without it (the delayed GEMMs are autograd's own; each gradient still reaches `.grad`
    once per micro-batch through AccumulateGrad). Returns the delayed GEMMs each variant ran (for -s)."""
    group = ep_group(ctx)
    ep_buffers = EPBuffers()
    results, delayed = {}, {}
    ran = [0]
    with _patched(wgrad_module.WeightGradStore, "put", _logging_put(lambda: ran.__setitem__(0, ran[0] + 1))):
        for name, (dispatcher, overrides, hidden, dtype, recipe) in VARIANTS.items():
            base = config(hidden, dispatcher, **overrides)
            for on in (False, True):
                cfg = dataclasses.replace(base, overlap_dispatch_backward_with_experts_wgrad=on)
                for together in (False, True)[: 1 + (name in TOGETHER)]:
                    torch.manual_seed(5)
                    layer = MoELayer(cfg, ep_group=group, ep_buffers=ep_buffers, dtype=dtype)
                    if recipe is not None:
                        layer.experts = Fp8SwiGLUExperts.from_experts(layer.experts, recipe)
                    ran[0] = 0
                    results[name, on, together] = _train(layer, ctx, hidden, dtype, together)
                    delayed[name, on, together] = ran[0]
    ep_buffers.destroy()

    for name in VARIANTS:
        for together in (False, True)[: 1 + (name in TOGETHER)]:
            off, on = results[name, False, together], results[name, True, together]
            assert len(on) == len(off)
            for i, (a, b) in enumerate(zip(on, off)):
                assert a is not None and b is not None, f"{name}: tensor {i} has no gradient"
                assert a.dtype == b.dtype and torch.equal(a, b), f"{name} (together={together}): tensor {i} differs"
            assert delayed[name, False, together] == 0, f"{name}: delayed GEMMs with the option off"
            # 2 micro-batches x (FC1, FC2) weight gradients, delayed and run.
            assert delayed[name, True, together] == 4, f"{name}: {delayed[name, True, together]} delayed GEMMs ran"
    assert not in_flight.has_work(), "a queued weight gradient was left behind"
    return {name: delayed[name, True, False] for name in VARIANTS}


def _order_config(hidden: int, dispatcher: str, on: bool) -> MoEConfig:
    return dataclasses.replace(
        config(hidden, dispatcher), moe_router_topk=2, moe_ffn_hidden_size=8,
        overlap_dispatch_backward_with_experts_wgrad=on,
    )  # fmt: skip


def _comm_log(dispatcher: str, layer: MoELayer, events: list, in_flight: list):
    """Context logging the start ('comm_begin') and the wait ('comm_end') of every gradient communication that
    could overlap: the buffer's asynchronous combines ('flex': the dispatch's backward; a synchronous one is
    'comm_sync') or the asynchronous
    all-to-alls ('alltoall': the combine's and the dispatch's backward). `in_flight[0]()` then tells whether the
    last one started is still running."""
    if dispatcher == "flex":
        buffer = layer.dispatcher.buffer
        combine = buffer.combine

        def logged_combine(*args, **kwargs):
            out = combine(*args, **kwargs)
            event = out[-1]
            if not kwargs.get("async_finish"):  # nothing to run while in flight: the op's backward waits at once
                events.append(("comm_sync",))
                return out
            if not isinstance(event, deep_ep.EventOverlap):
                return out
            events.append(("comm_begin",))
            in_flight[0] = lambda: not event.query()
            wait = event.current_stream_wait

            def logged_wait(*a, **k):
                events.append(("comm_end",))
                return wait(*a, **k)

            event.current_stream_wait = logged_wait
            return out

        return _patched(buffer, "combine", logged_combine)

    raw = comm._all_to_all_raw

    def logged_raw(x, output_splits, input_splits, group, async_op):
        out, work = raw(x, output_splits, input_splits, group, async_op)
        if work is None:
            return out, work
        events.append(("comm_begin",))
        in_flight[0] = lambda: not work.is_completed()

        class _LoggedWork:
            def wait(self):
                events.append(("comm_end",))
                return work.wait()

        return out, _LoggedWork()

    return _patched(comm, "_all_to_all_raw", logged_raw)


def delayed_wgrad_runs_inside_the_dispatch_backward(ctx, dispatcher: str) -> None:
    """The order of events in one backward: the dispatch's backward starts its gradient communication, the two
    delayed expert weight-gradient GEMMs run, then it waits (option on); with the option off no GEMM runs in
    between. 'flex' also: in at least one of up to 10 attempts the communication was still in flight when the first
    delayed GEMM started (timing-dependent: some 4 MB of gradients per rank take milliseconds on the comm thread,
    the GEMM starts microseconds after the start returns; the ranks agree on stopping, so they run the same
    collectives). ('alltoall' over gloo: the order only.)"""
    group = ep_group(ctx)
    ep_buffers = EPBuffers()
    T, hidden = (1024, 1024) if dispatcher == "flex" else (64, H)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(ctx.rank), requires_grad=True)
    orders, seen_in_flight = {}, False
    for on in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(_order_config(hidden, dispatcher, on), ep_group=group, ep_buffers=ep_buffers)
        observe_timing = on and dispatcher == "flex"
        for _ in range(10 if observe_timing else 1):
            out = layer(x)
            events, in_flight = [], [lambda: False]

            def log_wgrad(events=events, in_flight=in_flight):
                events.append(("wgrad", in_flight[0]()))

            gc.collect()  # no finalizer inside the observed window
            with (
                _comm_log(dispatcher, layer, events, in_flight),
                _patched(wgrad_module.WeightGradStore, "put", _logging_put(log_wgrad)),
            ):
                out.backward(torch.ones(T, hidden))
            orders[on] = [event[0] for event in events]
            seen_in_flight |= any(event[1] for event in events if event[0] == "wgrad")
            everyone = torch.tensor([int(seen_in_flight or not observe_timing)])
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
            if everyone.item():
                break
    ep_buffers.destroy()

    expected_on, expected_off = ["comm_begin", "wgrad", "wgrad", "comm_end"], ["comm_begin", "comm_end"]
    if dispatcher == "flex":  # with no in-flight work the op's backward combines synchronously (mtdeepep.in_flight)
        expected_off = ["comm_sync"]
    if dispatcher == "alltoall":  # the combine's backward all-to-all comes first, with nothing delayed yet
        expected_on, expected_off = expected_off + expected_on, expected_off * 2
    assert orders[True] == expected_on, f"option on: {orders[True]}"
    assert orders[False] == expected_off, f"option off: {orders[False]}"
    if dispatcher == "flex":
        assert seen_in_flight, "the gradient combine had always completed before the first delayed GEMM started"


CASES = {
    "delayed_wgrad_bitwise_the_undelayed": delayed_wgrad_is_bitwise_the_undelayed,
    "delayed_wgrad_inside_dispatch_backward_flex": lambda ctx: delayed_wgrad_runs_inside_the_dispatch_backward(
        ctx, "flex"
    ),
    "delayed_wgrad_inside_dispatch_backward_alltoall": lambda ctx: delayed_wgrad_runs_inside_the_dispatch_backward(
        ctx, "alltoall"
    ),
}
