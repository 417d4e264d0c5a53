"""Reproductions of a hostile-user review, run as `case(ctx, ...)` in the rank processes of a `RankPool`, or as
`target(proc, ...)` of `run_processes` where a process must die or exit (see test_reliability.py).

Each case repeats the attack exactly (public API, 2 CPU ranks) and checks the fixed behaviour: a crash (SIGSEGV)
shows as a dead rank, a hang as the pool's deadline, a wrong result as an assertion against `mtdeepep.utils.refs`
(normal mode, through the conformance helpers) or an exact low-latency reference (below).

Exact low-latency reference: the races and the hidden-size change are checked row by row with `==`, so that one
overwritten row counts. Inputs are chosen so that the FP32 combine is exact whatever its order of operations: bf16
rows (8 significant bits), expert factors `1 + g / 8` (g < 8: at most 4 bits, so `bf16(x * f)` is one rounding that
plain PyTorch reproduces), weights in {0.25, 0.5, ..., 1.5} (3 bits), at most 4 slots per token. Each product then
has at most 11 significant bits, the terms of a token span at most 4 binades and their sum carries at most 2 more
bits: 17 < 24, so the library's FP32 sum and the float64 reference are the same number, and rounding it once to bf16
gives the same bits.
"""

from __future__ import annotations

import gc
import os
import random
import re
import signal
import threading
import time

import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from mtdeepep.engines.handles import flatten_handle, record_of, unflatten_handle

from .conformance.common import (
    assert_combine_close,
    check_dispatch,
    identity_partials,
    layout_and_dispatch,
    layout_kwargs,
    make_inputs,
)
from .conformance.topology import Topology

# ---------------------------------------------------------------------------------------------------------------
# Helpers


def refusals_missing(calls: dict, must_mention: str) -> list[str]:
    """Runs every call; returns a line for each that did not raise a ValueError mentioning `must_mention`."""
    wrong = []
    for name, call in calls.items():
        try:
            call()
        except ValueError as error:
            if must_mention not in str(error):
                wrong.append(f"{name}: {error}")
        except Exception as error:  # noqa: BLE001 - reported
            wrong.append(f"{name}: {type(error).__name__}: {error}")
        else:
            wrong.append(f"{name}: accepted")
    return wrong


def ll_buffer(ctx, topo: Topology, num_max_tokens: int, hidden: int, experts_per_rank: int = 4,
              **kwargs) -> deep_ep.Buffer:  # fmt: skip
    """A fresh low-latency buffer sized by the size hint (the caller destroys or caches it)."""
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_tokens, hidden, ctx.world_size, experts_per_rank * ctx.world_size
    )
    return deep_ep.Buffer(ctx.group, 0, hint, low_latency_mode=True, **{**topo.buffer_kwargs(), **kwargs})


def cached_ll_buffer(ctx, topo, name, num_max_tokens, hidden, experts_per_rank=4) -> deep_ep.Buffer:
    key = f"rel-ll-{topo}-{name}-{num_max_tokens}-{hidden}-{experts_per_rank}"
    if key not in ctx.cache:
        ctx.cache[key] = ll_buffer(ctx, topo, num_max_tokens, hidden, experts_per_rank)
    return ctx.cache[key]


def exact_routing(generator, num_tokens, num_experts, num_topk=3, num_masked=4):
    """Distinct experts per token (a few slots -1) and weights in {0.25, ..., 1.5} (see the module docstring)."""
    topk_idx = torch.rand(num_tokens, num_experts, generator=generator).topk(num_topk, dim=1).indices
    rows = torch.randint(num_tokens, (num_masked,), generator=generator)
    cols = torch.randint(num_topk, (num_masked,), generator=generator)
    topk_idx[rows, cols] = -1
    weights = torch.randint(1, 7, (num_tokens, num_topk), generator=generator).float() / 4
    return topk_idx, weights


def expert_factor(global_expert):
    return 1.0 + global_expert / 8.0


def local_factors(ctx, num_experts) -> torch.Tensor:
    """`[E_local, 1, 1]` bfloat16: this rank's expert factors (exact in bfloat16)."""
    num_local = num_experts // ctx.world_size
    return torch.tensor([expert_factor(ctx.rank * num_local + e) for e in range(num_local)]).bfloat16().view(-1, 1, 1)


def exact_combine(x, topk_idx, weights, applied: bool) -> torch.Tensor:
    """What `low_latency_combine` must return, bit for bit, when each expert g returned `bf16(x * (1 + g / 8))`
    (`applied`) or x itself for the tokens it received."""
    valid = topk_idx >= 0
    factors = expert_factor(topk_idx.clamp(min=0).double()) if applied else torch.ones(topk_idx.shape).double()
    y = (x.float().unsqueeze(1) * factors.float().unsqueeze(2)).bfloat16().double()  # [T, K, H] per slot
    total = (weights.double().unsqueeze(2) * y * valid.unsqueeze(2)).sum(dim=1)
    return total.float().bfloat16()


def run_hook(hook) -> None:
    if hook is not None:
        hook()


def named_missing_ranks(message: str) -> list[int]:
    """The ranks a timeout message names as missing: node-local (`rank(s) [1, 2] did not arrive`) or network stage
    (`rank(s) 1 (at operation #3) did not arrive`). Empty if it names none."""
    local = re.search(r"rank\(s\) \[([0-9, ]+)\] did not arrive", message)
    if local:
        return [int(r) for r in local.group(1).split(",")]
    return [int(r) for r in re.findall(r"(\d+) \(at operation #\d+\)", message)]


def wait_child(pid: int, deadline_s: float) -> int:
    """Exit code of child `pid` (negative: killed by that signal); kills it if it is still running after
    `deadline_s` (a hung child fails the case instead of the pool)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child {pid} did not exit within {deadline_s} s")


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie waiting for its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def barrier(ctx) -> None:
    dist.barrier(group=ctx.group)


# ---------------------------------------------------------------------------------------------------------------
# 1. Views of the region outlive the Buffer


def _address_range(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()


def _release(buffers: list, explicit: bool) -> None:
    """`destroy()` every buffer, or drop the last references and collect them."""
    if explicit:
        for buffer in buffers:
            buffer.destroy()
    buffers.clear()
    gc.collect()


def views_outlive_the_buffer(ctx, topo, release: str):
    """Received rows (normal and low-latency, and the handle's tensors) are read after `destroy()`
    (`release='destroy'`) or after the Buffers were garbage-collected (`'collect'`), and after new buffers were
    mapped and used (they would land in the old address range had it been unmapped): same values, no SIGSEGV. No
    `get_local_buffer_tensor` view is held meanwhile (one keeps the mapping alive by itself). Then the same for a
    `get_local_buffer_tensor` view obtained before the release, and `get_local_buffer_tensor` after `destroy()`
    raises CommError. Returns the names of the held tensors that viewed a shared region."""
    explicit = release == "destroy"
    E = 4 * ctx.world_size
    buffers = [topo.new_buffer(ctx, 4 << 20, explicitly_destroy=explicit),
               ll_buffer(ctx, topo, 64, 512, explicitly_destroy=explicit)]  # fmt: skip
    areas = [_address_range(buffers[0].get_local_buffer_tensor(torch.uint8)),
             _address_range(buffers[1].get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True))]  # fmt: skip

    d = check_dispatch(ctx, topo, buffers[0], 300, 512, 16, 4, seed=1)
    held = {"recv_x": d.recv_x, "recv_topk_idx": d.recv_idx, "recv_topk_weights": d.recv_w}
    held.update({f"handle[{i}]": t for i, t in enumerate(flatten_handle(d.handle))})
    del d
    generator = torch.Generator().manual_seed(10 + ctx.rank)
    x = torch.randn(64, 512, generator=generator).bfloat16()
    topk_idx, _ = exact_routing(generator, 64, E)
    recv, count, handle, _, _ = buffers[1].low_latency_dispatch(x, topk_idx, 64, E, use_fp8=False)
    (recv8, scales), *_ = buffers[1].low_latency_dispatch(x, topk_idx, 64, E, use_fp8=True)
    held.update({"ll_recv_x": recv, "ll_recv_count": count, "ll_fp8_recv_x": recv8.view(torch.uint8),
                 "ll_fp8_scales": scales, "ll_src_info": handle[0], "ll_layout_range": handle[1]})  # fmt: skip
    del recv, count, handle, recv8, scales
    in_regions = sorted(name for name, t in held.items() if any(lo <= t.data_ptr() < hi for lo, hi in areas))
    expected = {name: t.clone() for name, t in held.items()}
    barrier(ctx)  # every peer has finished writing into this rank's regions

    _release(buffers, explicit)
    changed = [name for name, t in held.items() if not torch.equal(t, expected[name])]  # unmapped: SIGSEGV
    assert not changed, f"held views changed after the buffers were released: {changed}"
    # New buffers, mapped and used: the old regions must not have been reused under the held views.
    fresh = [topo.new_buffer(ctx, 4 << 20, explicitly_destroy=True),
             ll_buffer(ctx, topo, 64, 512, explicitly_destroy=True)]  # fmt: skip
    check_dispatch(ctx, topo, fresh[0], 300, 512, 16, 4, seed=2)
    fresh[1].low_latency_dispatch(x, topk_idx, 64, E, use_fp8=False)
    changed = [name for name, t in held.items() if not torch.equal(t, expected[name])]
    assert not changed, f"held views changed once new buffers were mapped: {changed}"

    # get_local_buffer_tensor views obtained before the release.
    buffers = [topo.new_buffer(ctx, 1 << 20, explicitly_destroy=explicit),
               ll_buffer(ctx, topo, 64, 512, explicitly_destroy=explicit)]  # fmt: skip
    views = [buffers[0].get_local_buffer_tensor(torch.float32, torch.Size([64, 64]), offset=1024),
             buffers[1].get_local_buffer_tensor(torch.float32, torch.Size([64, 64]), use_rdma_buffer=True)]  # fmt: skip
    for k, view in enumerate(views):
        view.copy_(torch.arange(4096.0).view(64, 64) + k)
    destroyed = list(buffers)  # kept for the calls after destroy() below (collect: dropped)
    if not explicit:
        destroyed.clear()
    _release(buffers, explicit)
    check_dispatch(ctx, topo, fresh[0], 300, 512, 16, 4, seed=3)
    for k, view in enumerate(views):
        assert torch.equal(view, torch.arange(4096.0).view(64, 64) + k), f"local buffer view {k} changed"
        view.mul_(2)  # still writable, still this rank's memory
        assert torch.equal(view, 2 * (torch.arange(4096.0).view(64, 64) + k))
    for k, buffer in enumerate(destroyed):
        try:
            buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=k == 1)
        except deep_ep.CommError as error:
            assert "destroyed" in str(error), error
        else:
            raise AssertionError("get_local_buffer_tensor after destroy() raised nothing")
    barrier(ctx)
    for buffer in fresh:
        buffer.destroy()
    return in_regions


# ---------------------------------------------------------------------------------------------------------------
# 2. Handles changed in place, copied or hand-made

TAMPERINGS = {
    "huge": lambda t: t.fill_(True) if t.dtype == torch.bool else t.fill_(2**30),
    "negative": lambda t: t.fill_(False) if t.dtype == torch.bool else t.fill_(-7),
    "random": lambda t: t.copy_(torch.randint(-(2**20), 2**20, t.shape).to(t.dtype)),
    "zero": lambda t: t.zero_(),
}


def tampered_handle_is_harmless(ctx, topo):
    """Every tensor of a handle (rank_prefix_matrix, send_head, ... or the internode ones) overwritten in place with
    garbage: combine (sync and async) and cached dispatch still return the right results on every rank."""
    buffer = topo.buffer(ctx)
    for i, (name, tamper) in enumerate(TAMPERINGS.items()):
        d = check_dispatch(ctx, topo, buffer, 300, 128, 16, 3, seed=200 + i)
        for tensor in flatten_handle(d.handle):
            tamper(tensor)
        weights_ref = d.topk_weights.masked_fill(d.topk_idx < 0, 0.0)
        for async_finish in (False, True):
            combined, combined_w, event = buffer.combine(d.recv_x, d.handle, topk_weights=d.recv_w,
                                                         async_finish=async_finish)  # fmt: skip
            event.current_stream_wait()
            assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)
            assert torch.allclose(combined_w, weights_ref, rtol=1e-6, atol=0), name
        again, *_ = buffer.dispatch(d.x, handle=d.handle)
        assert torch.equal(again, d.recv_x), f"cached dispatch with a handle tampered ({name})"


def copied_handles_are_refused(ctx, topo):
    """A cloned handle and a hand-made one (fresh tensors of the right shapes), normal and low-latency: ValueError
    on every rank before any communication, so the ranks stay in step."""
    buffer = topo.buffer(ctx)
    d = check_dispatch(ctx, topo, buffer, 100, 64, 8, 2, seed=210)
    flat = flatten_handle(d.handle)
    copies = {
        "cloned": unflatten_handle([t.clone() for t in flat]),
        "hand-made": unflatten_handle([torch.zeros_like(t) for t in flat]),
    }
    ll = cached_ll_buffer(ctx, topo, "main", 32, 256)
    generator = torch.Generator().manual_seed(211 + ctx.rank)
    x = torch.randn(32, 256, generator=generator).bfloat16()
    topk_idx, weights = exact_routing(generator, 32, 4 * ctx.world_size)
    recv, _, ll_handle, _, _ = ll.low_latency_dispatch(x, topk_idx, 32, 4 * ctx.world_size, use_fp8=False)
    ll_copies = {"ll cloned": tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in ll_handle)}
    calls = {}
    for name, handle in copies.items():
        calls[f"combine, {name}"] = lambda h=handle: buffer.combine(d.recv_x, h)
        calls[f"cached dispatch, {name}"] = lambda h=handle: buffer.dispatch(d.x, handle=h)
    for name, handle in ll_copies.items():
        calls[f"low_latency_combine, {name}"] = lambda h=handle: ll.low_latency_combine(recv, topk_idx, weights, h)
        calls[f"next combine buffer, {name}"] = lambda h=handle: ll.get_next_low_latency_combine_buffer(h)
    wrong = refusals_missing(calls, "handle")
    assert not wrong, wrong
    # Still in step: the real handles work.
    combined, _, _ = buffer.combine(d.recv_x, d.handle)
    assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)
    combined, _, _ = ll.low_latency_combine(recv, topk_idx, weights, ll_handle)
    assert torch.equal(combined, exact_combine(x, topk_idx, weights, applied=False))


def ll_tampered_handle_is_harmless(ctx, topo):
    """The low-latency handle's tensors (src_info, layout_range) overwritten in place with out-of-range garbage on
    every rank: the combine must not crash; it raises ValueError on every rank (the engine validates what it reads),
    and the buffer stays usable."""
    ll = cached_ll_buffer(ctx, topo, "main", 32, 256)
    E = 4 * ctx.world_size
    generator = torch.Generator().manual_seed(220 + ctx.rank)
    outcomes = []
    for name, tamper in TAMPERINGS.items():
        if name == "zero":  # in range: a valid (if meaningless) layout, not an attack on memory safety
            continue
        x = torch.randn(32, 256, generator=generator).bfloat16()
        topk_idx, weights = exact_routing(generator, 32, E)
        recv, _, handle, _, _ = ll.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
        for tensor in handle[:2]:
            tamper(tensor)
        try:
            ll.low_latency_combine(recv, topk_idx, weights, handle)
        except ValueError:
            outcomes.append("value-error")
        except deep_ep.CommError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
        else:
            outcomes.append("accepted")
        # still usable
        x = torch.randn(32, 256, generator=generator).bfloat16()
        recv, _, handle, _, _ = ll.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
        combined, _, _ = ll.low_latency_combine(recv, topk_idx, weights, handle)
        assert torch.equal(combined, exact_combine(x, topk_idx, weights, applied=False)), name
    return outcomes


# ---------------------------------------------------------------------------------------------------------------
# 3. A forked child drops an inherited Buffer


def _in_forked_child(variant: str, holder: list) -> None:
    """The forked child's whole life: release the inherited buffer as `variant` says, run what an interpreter exit
    runs (the threading exit hooks, where mtdeepep shuts its runtimes down), collect garbage, and leave without
    returning into the rank process's code."""
    code = 0
    try:
        if variant == "destroy":
            holder[0].destroy()
        holder.clear()
        gc.collect()
        threading._shutdown()  # what the interpreter runs first at exit (mtdeepep's exit hook among them)
        gc.collect()
    except BaseException:  # noqa: BLE001 - reported through the exit code
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def fork_child_leaves_the_group_alone(ctx, topo, mode: str, rounds: int):
    """Each rank forks children that drop (garbage-collect), destroy, or exit with an inherited Buffer; after each,
    `rounds` dispatch/combine rounds of the parents are checked against the reference."""
    if mode == "low-latency":
        holder = [ll_buffer(ctx, topo, 32, 256, explicitly_destroy=True)]
    else:
        holder = [topo.new_buffer(ctx, 1 << 22, explicitly_destroy=True)]
    E = 4 * ctx.world_size
    generator = torch.Generator().manual_seed(300 + ctx.rank)
    children = []

    def check_rounds(seed):
        buffer = holder[0]
        for i in range(rounds):
            if mode == "low-latency":
                x = torch.randn(32, 256, generator=generator).bfloat16()
                topk_idx, weights = exact_routing(generator, 32, E)
                recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
                combined, _, _ = buffer.low_latency_combine(recv, topk_idx, weights, handle)
                assert torch.equal(combined, exact_combine(x, topk_idx, weights, applied=False))
            else:
                d = check_dispatch(ctx, topo, buffer, 64, 64, E, 2, seed=seed * 1000 + i)
                combined, _, _ = buffer.combine(d.recv_x, d.handle)
                assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)

    check_rounds(0)
    try:
        for k, variant in enumerate(("drop", "destroy", "exit")):
            barrier(ctx)
            pid = os.fork()
            if pid == 0:
                _in_forked_child(variant, holder)
            children.append(pid)
            code = wait_child(pid, 30)
            assert code == 0, f"the child ({variant}) exited with {code}"
            barrier(ctx)  # every rank's child is gone before the parents communicate again
            check_rounds(k + 1)
    finally:
        holder[0].destroy()
    return children


# ---------------------------------------------------------------------------------------------------------------
# 4. Low-latency: recv_x straight into combine while a peer runs ahead


def _race_inputs(ctx, role: str, num_tokens: int, hidden: int, num_experts: int, num_topk: int, generator):
    """One round's inputs for a rank `behind` (all its tokens to its own experts: a long copy to itself at the end
    of its combine send) or the `leader` (few tokens, all to the next rank's experts: its next dispatch writes into
    that rank's receive half at once), with both exact expected combines (expert outputs = x, or x times the
    expert's factor)."""
    num_local = num_experts // ctx.world_size
    target = ctx.rank if role == "behind" else (ctx.rank + 1) % ctx.world_size
    n = num_tokens if role == "behind" else num_tokens // 8
    x = torch.randn(n, hidden, generator=generator).bfloat16()
    topk_idx = target * num_local + torch.rand(n, num_local, generator=generator).argsort(dim=1)[:, :num_topk]
    weights = torch.randint(1, 7, (n, num_topk), generator=generator).float() / 4
    return x, topk_idx, weights, [exact_combine(x, topk_idx, weights, applied) for applied in (False, True)]


def ll_recv_x_straight_to_combine(ctx, topo, mode: str, rounds: int):
    """`rounds` of dispatch -> combine(recv_x itself, or recv_x after an expert factor applied in place) in sync, hook
    or async mode, while one rank runs ahead (the leader changes every 25 rounds): the ranks behind pause at random
    (up to 0.3 ms) before each combine, so the leader is always waiting for their rows, and its next dispatch comes
    while they still send theirs; the leader's path is short (inputs and references precomputed, results compared
    every 25 rounds). Every combine is compared row by row with the exact reference; returns the wrong rows."""
    T, H, E, K = 128, 1024, 4 * ctx.world_size, 4
    buffer = cached_ll_buffer(ctx, topo, "race", T, H)
    factors = local_factors(ctx, E)
    generator = torch.Generator().manual_seed(400 + ctx.rank)
    inputs = {role: [_race_inputs(ctx, role, T, H, E, K, generator) for _ in range(4)] for role in ("behind", "lead")}
    rng = random.Random(401 + ctx.rank)
    hook_mode, async_mode = mode == "hook", mode == "async"
    wrong_rows, wrong_rounds, pending = 0, [], []

    def compare():
        nonlocal wrong_rows
        for i, combined, expected in pending:
            bad = int((combined != expected).any(dim=1).sum())
            if bad:
                wrong_rows += bad
                wrong_rounds.append(i)
        pending.clear()

    barrier(ctx)
    for i in range(rounds):
        behind = ctx.rank != (i // 25) % ctx.world_size
        x, topk_idx, weights, expected = inputs["behind" if behind else "lead"][i % 4]
        applied = i % 2 == 1
        recv_x, _, handle, event, hook = buffer.low_latency_dispatch(
            x, topk_idx, T, E, use_fp8=False, async_finish=async_mode, return_recv_hook=hook_mode
        )
        run_hook(hook)
        event.current_stream_wait()
        if applied:
            recv_x.mul_(factors)  # the expert's output, computed in place in the receive half
        if behind:
            time.sleep(rng.random() * 3e-4)
        combined, event, hook = buffer.low_latency_combine(
            recv_x, topk_idx, weights, handle, async_finish=async_mode, return_recv_hook=hook_mode
        )
        run_hook(hook)
        event.current_stream_wait()
        pending.append((i, combined, expected[applied]))
        if len(pending) == 25:
            compare()
    compare()
    barrier(ctx)
    return wrong_rows, wrong_rounds[:10]


# ---------------------------------------------------------------------------------------------------------------
# 5. Low-latency: a change of hidden size keeps the other half's results


HIDDEN_PAIRS = [(512, 128), (128, 512), (384, 256), (256, 1024), (1024, 128), (128, 384)]


def ll_hidden_change_keeps_results(ctx, topo, rounds: int):
    """Result A (a dispatch of hidden H1, BF16 or FP8) stays intact across the next call of hidden H2 != H1: a
    dispatch (even rounds) or a combine (odd rounds), for both orders of every pair in HIDDEN_PAIRS. The combines
    are checked exactly too. Returns the number of A's valid rows that changed."""
    T, E = 32, 4 * ctx.world_size
    buffer = cached_ll_buffer(ctx, topo, "hidden", T, max(max(p) for p in HIDDEN_PAIRS))
    factors = local_factors(ctx, E)
    generator = torch.Generator().manual_seed(500 + ctx.rank)
    wrong_rows = 0
    failures = []

    def dispatch(hidden, use_fp8=False):
        x = torch.randn(T, hidden, generator=generator).bfloat16()
        topk_idx, weights = exact_routing(generator, T, E)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=use_fp8)
        return x, topk_idx, weights, recv, count, handle

    def kept(recv, count, handle):
        data, scales = recv if isinstance(recv, tuple) else (recv, None)
        parts = [data.view(torch.uint8), count, handle[0], handle[1]] + ([scales] if scales is not None else [])
        return parts, [p.clone() for p in parts]

    def count_changed(parts, copies, count):
        data, copy = parts[0], copies[0]
        rows = sum(int((data[e, : int(count[e])] != copy[e, : int(count[e])]).any(dim=-1).sum())
                   for e in range(data.size(0)))  # fmt: skip
        others = [j for j in range(1, len(parts)) if not torch.equal(parts[j], copies[j])]
        return rows, not torch.equal(data, copy) or bool(others)

    def combine_exact(x, topk_idx, weights, y, handle, applied, what):
        combined, _, _ = buffer.low_latency_combine(y, topk_idx, weights, handle)
        if not torch.equal(combined, exact_combine(x, topk_idx, weights, applied)):
            failures.append(what)

    for i in range(rounds):
        h1, h2 = HIDDEN_PAIRS[i % len(HIDDEN_PAIRS)]
        fp8 = i % 4 >= 2
        if i % 2 == 0:  # A (H1), then a dispatch B (H2)
            xa, ia, wa, recv_a, count_a, handle_a = dispatch(h1, fp8)
            parts, copies = kept(recv_a, count_a, handle_a)
            xb, ib, wb, recv_b, _, handle_b = dispatch(h2)
            changed_rows, changed = count_changed(parts, copies, count_a)
            combine_exact(xb, ib, wb, recv_b, handle_b, False, f"round {i}: combine of B")  # gives A up
        else:  # B (H2), then A (H1), then the combine of B (H2)
            xb, ib, wb, recv_b, _, handle_b = dispatch(h2)
            xa, ia, wa, recv_a, count_a, handle_a = dispatch(h1, fp8)
            parts, copies = kept(recv_a, count_a, handle_a)
            y_b = recv_b * factors  # out of place: B's half is given up by the combine, the call after next
            combine_exact(xb, ib, wb, y_b, handle_b, True, f"round {i}: combine of B")
            changed_rows, changed = count_changed(parts, copies, count_a)
        wrong_rows += changed_rows
        if changed:
            failures.append(f"round {i}: A (hidden {h1}, fp8={fp8}) changed by a call of hidden {h2} "
                            f"({changed_rows} valid rows)")  # fmt: skip
        if not fp8:  # A's combine, from a copy (A's half is given up by the call after next)
            y = (copies[0].view(torch.bfloat16) * factors).contiguous()
            combine_exact(xa, ia, wa, y, handle_a, True, f"round {i}: combine of A")
    return wrong_rows, failures[:10]


# ---------------------------------------------------------------------------------------------------------------
# 6. Handles of other dispatches, other buffers, other groups


def _expect_group_mismatch(call, what: str) -> str:
    try:
        call()
    except deep_ep.GroupMismatchError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - reported
        raise AssertionError(f"{what}: expected GroupMismatchError, got {type(error).__name__}: {error}") from error
    raise AssertionError(f"{what}: the ranks passed handles of different dispatches and nothing was raised")


def _self_group_buffer(ctx, **kwargs) -> deep_ep.Buffer:
    """A buffer of the group of this rank alone (a group other than the pool's)."""
    groups = ctx.cache.setdefault("rel-self-groups", [dist.new_group([r]) for r in range(ctx.world_size)])
    key = f"rel-self-buffer-{sorted(kwargs.items())}"
    if key not in ctx.cache:
        ctx.cache[key] = deep_ep.Buffer(groups[ctx.rank], **kwargs)
    return ctx.cache[key]


def normal_handles_of_other_dispatches(ctx, topo):
    """Interleaved micro-batches: rank 0 combines (and re-dispatches) dispatch 1 while the others use dispatch 2,
    sync and async: every rank raises GroupMismatchError; then both dispatches combine correctly. A handle of
    another live buffer of the same group, used by every rank, is accepted and correct; one rank using it while the
    others use their own is a mismatch; a handle of a buffer of another group raises ValueError."""
    buffer = topo.buffer(ctx)
    d1 = check_dispatch(ctx, topo, buffer, 200, 64, 16, 3, seed=600)
    d2 = check_dispatch(ctx, topo, buffer, 200, 64, 16, 3, seed=601)
    mine = d1 if ctx.rank == 0 else d2
    messages = []
    for async_finish in (False, True):

        def combine(a=async_finish):
            _, _, event = buffer.combine(mine.recv_x, mine.handle, async_finish=a)
            event.current_stream_wait()

        messages.append(_expect_group_mismatch(combine, f"combine (async_finish={async_finish})"))
    messages.append(_expect_group_mismatch(lambda: buffer.dispatch(mine.x, handle=mine.handle), "cached dispatch"))
    for d in (d1, d2):  # the buffer and both handles are still usable
        combined, _, _ = buffer.combine(d.recv_x, d.handle)
        assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)

    # Another live buffer of the same group (Megatron replacing its global buffer).
    other = topo.new_buffer(ctx, 1 << 21, explicitly_destroy=True)
    try:
        d_other = check_dispatch(ctx, topo, other, 200, 64, 16, 3, seed=602)
        combined, _, _ = buffer.combine(d_other.recv_x, d_other.handle)
        assert_combine_close(combined, identity_partials(topo, d_other.x, d_other.in_rank), torch.bfloat16)
        again, *_ = buffer.dispatch(d_other.x, handle=d_other.handle)
        assert torch.equal(again, d_other.recv_x)
        d_own = check_dispatch(ctx, topo, buffer, 200, 64, 16, 3, seed=602)  # same inputs, this buffer's handle
        mixed = d_other if ctx.rank == 0 else d_own
        messages.append(_expect_group_mismatch(lambda: buffer.combine(mixed.recv_x, mixed.handle),
                                               "combine, one rank with another buffer's handle"))  # fmt: skip
    finally:
        other.destroy()

    # A buffer of another group: refused before any communication.
    alone = _self_group_buffer(ctx, num_nvl_bytes=1 << 20)
    x, topk_idx, topk_weights = make_inputs(ctx, 50, 64, 4, 2, seed=603)
    recv_x, *_, alone_handle, _ = layout_and_dispatch(alone, x, topk_idx, topk_weights, 4)
    for what, call in {"combine": lambda: buffer.combine(recv_x, alone_handle),
                       "cached dispatch": lambda: buffer.dispatch(x, handle=alone_handle)}.items():  # fmt: skip
        try:
            call()
        except ValueError as error:
            assert "group" in str(error) or "intranode" in str(error), (what, error)
        else:
            raise AssertionError(f"{what}: a handle of another group was accepted")
    check_dispatch(ctx, topo, buffer, 64, 64, 16, 3, seed=604)  # still in step
    return messages


def different_operations_leave_the_buffer_usable(ctx, topo):
    """Issue 23, item 4: the ranks call different operations (rank 0 one, the others another): every rank raises
    GroupMismatchError, found before any row moves, and the buffer stays usable: the next correct round (a dispatch
    and its combine on every rank) is right. Every pair of the normal mode's operations, then the same in
    low-latency mode (rank 0 dispatches while the others combine)."""
    buffer = topo.buffer(ctx)
    earlier = check_dispatch(ctx, topo, buffer, 100, 64, 16, 3, seed=650)
    x, topk_idx, topk_weights = make_inputs(ctx, 100, 64, 16, 3, seed=651)
    calls = {
        "dispatch": lambda: layout_and_dispatch(buffer, x, topk_idx, topk_weights, 16),
        "combine": lambda: buffer.combine(earlier.recv_x, earlier.handle),
        "cached dispatch": lambda: buffer.dispatch(earlier.x, handle=earlier.handle),
    }
    messages = []
    for mine, theirs in (("dispatch", "combine"), ("combine", "dispatch"), ("dispatch", "cached dispatch"),
                         ("cached dispatch", "combine")):  # fmt: skip
        call = calls[mine] if ctx.rank == 0 else calls[theirs]
        messages.append(_expect_group_mismatch(call, f"rank 0 {mine}, the others {theirs}"))
        d = check_dispatch(ctx, topo, buffer, 64, 64, 16, 3, seed=652)  # usable: a correct round
        combined, _, _ = buffer.combine(d.recv_x, d.handle)
        assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)
    # Low latency: rank 0 dispatches, the others combine an earlier dispatch.
    ll = cached_ll_buffer(ctx, topo, "different-ops", 32, 128)
    num_experts = 4 * ctx.world_size
    generator = torch.Generator().manual_seed(653 + ctx.rank)
    ll_x = torch.randn(32, 128, generator=generator).bfloat16()
    ll_idx, ll_w = exact_routing(generator, 32, num_experts)
    recv, _, handle, _, _ = ll.low_latency_dispatch(ll_x, ll_idx, 32, num_experts, use_fp8=False)
    y = recv.clone()
    ll_calls = {
        "dispatch": lambda: ll.low_latency_dispatch(ll_x, ll_idx, 32, num_experts, use_fp8=False),
        "combine": lambda: ll.low_latency_combine(y, ll_idx, ll_w, handle),
    }
    messages.append(_expect_group_mismatch(ll_calls["dispatch"] if ctx.rank == 0 else ll_calls["combine"],
                                           "low latency: rank 0 dispatch, the others combine"))  # fmt: skip
    recv, _, handle, _, _ = ll.low_latency_dispatch(ll_x, ll_idx, 32, num_experts, use_fp8=False)
    combined, _, _ = ll.low_latency_combine(recv.clone(), ll_idx, ll_w, handle)
    assert torch.isfinite(combined.float()).all()
    return messages


def ll_handles_of_other_dispatches(ctx, topo):
    """Low-latency: rank 0 combines dispatch A while the others combine dispatch B, then rank 0 combines with a
    handle of another buffer of the group: GroupMismatchError on every rank, the buffer stays usable. Every rank
    using the other buffer's handle is accepted and exact; another group's handle raises ValueError."""
    T, H, E = 32, 256, 4 * ctx.world_size
    buffer = cached_ll_buffer(ctx, topo, "main", T, H)
    other = cached_ll_buffer(ctx, topo, "other", T, H)
    generator = torch.Generator().manual_seed(610 + ctx.rank)

    def dispatch(buf):
        x = torch.randn(T, H, generator=generator).bfloat16()
        topk_idx, weights = exact_routing(generator, T, E)
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
        return x, topk_idx, weights, recv.clone(), handle

    def check_usable():
        x, topk_idx, weights, recv, handle = dispatch(buffer)
        combined, _, _ = buffer.low_latency_combine(recv, topk_idx, weights, handle)
        assert torch.equal(combined, exact_combine(x, topk_idx, weights, applied=False))

    a, b = dispatch(buffer), dispatch(buffer)
    mine = a if ctx.rank == 0 else b
    messages = [_expect_group_mismatch(lambda: buffer.low_latency_combine(mine[3], mine[1], mine[2], mine[4]),
                                       "low-latency combine of different dispatches")]  # fmt: skip
    check_usable()
    c, d = dispatch(other), dispatch(buffer)
    mine = c if ctx.rank == 0 else d
    messages.append(_expect_group_mismatch(lambda: buffer.low_latency_combine(mine[3], mine[1], mine[2], mine[4]),
                                           "low-latency combine, one rank with another buffer's handle"))  # fmt: skip
    check_usable()
    x, topk_idx, weights, recv, handle = dispatch(other)  # every rank: the other buffer's handle
    combined, _, _ = buffer.low_latency_combine(recv, topk_idx, weights, handle)
    assert torch.equal(combined, exact_combine(x, topk_idx, weights, applied=False)), "another buffer's handle"

    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    alone = _self_group_buffer(ctx, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True)
    x = torch.randn(T, H, generator=generator).bfloat16()
    topk_idx, weights = exact_routing(generator, T, E)
    recv, _, alone_handle, _, _ = alone.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    try:
        buffer.low_latency_combine(recv, topk_idx, weights, alone_handle)
    except ValueError as error:
        assert "group" in str(error), error
    else:
        raise AssertionError("a low-latency handle of another group was accepted")
    check_usable()
    return messages


# ---------------------------------------------------------------------------------------------------------------
# 7. Set-up: a missing rank and a rank killed during set-up (run_processes targets)


def _setup_attempt(group, timeout_s: float, num_nvl_bytes: int = 1 << 20):
    """`Buffer(group)`: ('ok' | error type, message, seconds)."""
    start = time.perf_counter()
    try:
        buffer = deep_ep.Buffer(group, num_nvl_bytes, explicitly_destroy=True, timeout_s=timeout_s)
    except Exception as error:  # noqa: BLE001 - returned for the test to judge
        return type(error).__name__, str(error), time.perf_counter() - start
    buffer.destroy()
    return "ok", "", time.perf_counter() - start


def _die_in_exchange(when: str) -> None:
    """Makes this process SIGKILL itself inside its next Buffer set-up: 'engine' while it creates its node engine,
    'before' publishing its set-up string, or 'after' the exchange (while the peers map segments and wait for it)."""
    import mtdeepep.engines as engine
    from mtdeepep.engines.setup import SetupRendezvous

    if when == "engine":
        engine.NODE_ENGINES["cpu"] = lambda **kwargs: os.kill(os.getpid(), signal.SIGKILL)
        return
    real = SetupRendezvous.exchange

    def exchange(self, value):
        if when == "after":
            real(self, value)
        os.kill(os.getpid(), signal.SIGKILL)

    SetupRendezvous.exchange = exchange


def setup_failures(proc, timeout_s: float):
    """3 processes. A: rank 0 never creates the world group's buffer (ranks 1, 2 wait); B at the same time: rank 0
    creates one on group [0, 2] whose rank 2 never does (it is busy in A). Then D: rank 2 is SIGKILLed during the
    set-up of group [1, 2] after the exchange (rank 1 waits for it to map); C: rank 1 is SIGKILLed during the set-up
    of group [0, 1] before it arrives (rank 0 waits). Every survivor reports (outcome, message, seconds)."""
    group = proc.init_group()
    pids = [None] * proc.num_processes
    dist.all_gather_object(pids, os.getpid())
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 2), (1, 2), (0, 1))}
    if proc.rank == 0:
        report = {"B": _setup_attempt(groups[(0, 2)], timeout_s)}
        report["C"] = _setup_attempt(groups[(0, 1)], timeout_s)
        return report, pids
    report = {"A": _setup_attempt(group, timeout_s)}
    if proc.rank == 2:
        proc.send(report)
        _die_in_exchange("after")
        _setup_attempt(groups[(1, 2)], timeout_s)
        raise AssertionError("rank 2 survived its set-up")
    report["D"] = _setup_attempt(groups[(1, 2)], timeout_s)
    proc.send(report)
    _die_in_exchange("before")
    _setup_attempt(groups[(0, 1)], timeout_s)
    raise AssertionError("rank 1 survived its set-up")


def peer_setup_failure_is_named(proc, big: int, timeout_s: float):
    """Issue 23, item 3: rank 0 asks for more /dev/shm than exists (`big` bytes) and fails at once; rank 1 must say
    at once that group rank 0 failed its set-up, with its reason (not time out without one, nor report the symptom,
    a peer segment that does not exist). Then both set up a buffer of the same group, which must work (the failed
    set-up does not leave the ranks' set-up numbers apart). Returns (first attempt, second attempt)."""
    group = proc.init_group()
    first = _setup_attempt(group, timeout_s, num_nvl_bytes=big if proc.rank == 0 else 1 << 20)
    return first, _setup_attempt(group, timeout_s)


def killed_during_setup_is_named_at_once(proc, timeout_s: float, when: str):
    """Issue 23, item 3: rank 1 is SIGKILLed inside its Buffer set-up (`_die_in_exchange(when)`); rank 0 must name it
    (its pid) at once, not after the timeout. Returns rank 0's (outcome, message, seconds) and the pids."""
    group = proc.init_group()
    pids = [None] * proc.num_processes
    dist.all_gather_object(pids, os.getpid())
    if proc.rank == 1:
        _die_in_exchange(when)
        _setup_attempt(group, timeout_s)
        raise AssertionError("rank 1 survived its set-up")
    return _setup_attempt(group, timeout_s), pids


def store_host_killed_during_setup(proc, timeout_s: float):
    """2 processes: rank 0 (the rendezvous store's host) is SIGKILLed inside its Buffer set-up, after the exchange;
    rank 1 reports (outcome, message, seconds)."""
    group = proc.init_group()
    if proc.rank == 0:
        _die_in_exchange("after")
    return _setup_attempt(group, timeout_s)


# ---------------------------------------------------------------------------------------------------------------
# 8. Dispatch outputs that fill the region


# The finding's case: 1798 tokens per rank, hidden 2549 (bf16), 16 experts, top-3, num_nvl_bytes = 8 MiB, 2 ranks.
FILL_TOKENS, FILL_HIDDEN, FILL_EXPERTS, FILL_TOPK, FILL_NVL_BYTES = 1798, 2549, 16, 3, 8 << 20


class _Filled:
    """A held dispatch of `_fill_dispatch` and what its combine must return."""

    def __init__(self, x, weights, outputs, in_region: bool) -> None:
        self.x, self.weights, self.in_region = x, weights, in_region
        self.recv_x, _, self.recv_w, _, self.handle, _ = outputs


def _fill_dispatch(ctx, buffer, region, num_to_rank0: int, num_tokens: int, hidden: int, seed: int) -> _Filled:
    """A dispatch in which rank 0 receives exactly `num_to_rank0` rows: each source sends its first tokens to rank 0's
    experts and the others to rank 1's (top-3 distinct experts of that rank, weights in {0.25, ..., 1.5}). Each
    token reaches one rank, so combine must return x and the weights exactly. recv_x is checked exactly here."""
    half = FILL_EXPERTS // 2
    to_rank0 = [num_to_rank0 - num_to_rank0 // 2, num_to_rank0 // 2]  # from source 0, source 1
    xs, routes = [], []
    for source in range(2):
        generator = torch.Generator().manual_seed(seed * 10 + source)
        xs.append(torch.randn(num_tokens, hidden, generator=generator).bfloat16())
        topk_idx = torch.rand(num_tokens, half, generator=generator).argsort(dim=1)[:, :FILL_TOPK]
        topk_idx[to_rank0[source] :] += half
        weights = torch.randint(1, 7, (num_tokens, FILL_TOPK), generator=generator).float() / 4
        routes.append((topk_idx, weights))
    topk_idx, weights = routes[ctx.rank]
    outputs = layout_and_dispatch(buffer, xs[ctx.rank], topk_idx, weights, FILL_EXPERTS)
    mine = [slice(0, n) if ctx.rank == 0 else slice(n, None) for n in to_rank0]
    expected = torch.cat([xs[0][mine[0]], xs[1][mine[1]]])
    assert torch.equal(outputs[0], expected), "recv_x differs from the reference"
    inside = region.data_ptr() <= outputs[0].data_ptr() < region.data_ptr() + region.numel()
    return _Filled(xs[ctx.rank], weights, outputs, inside)


def _fill_combine(buffer, filled: _Filled) -> str:
    """'ok' when the combine returns x and the weights exactly, else the error."""
    try:
        combined, combined_w, _ = buffer.combine(filled.recv_x, filled.handle, topk_weights=filled.recv_w)
    except deep_ep.GroupMismatchError as error:  # raised on every rank: the sweep goes on in step
        return f"GroupMismatchError: {error}"
    assert torch.equal(combined, filled.x) and torch.equal(combined_w, filled.weights), "combine is wrong"
    return "ok"


def _fill_buffer(ctx, topo):
    buffer = topo.buffer(ctx, num_nvl_bytes=FILL_NVL_BYTES)
    return buffer, buffer.get_local_buffer_tensor(torch.uint8)


def dispatch_outputs_fill_the_region(ctx, topo, lo: int, hi: int):
    """The finding's case with rank 0 receiving N rows, for every N in [lo, hi): around the N at which its outputs
    fill the region, whatever the layout. Then two held dispatches of that case (the largest N whose outputs stay
    in the region, then another), combined in order. Returns (largest N whose outputs are in the region, failures)."""
    assert ctx.world_size == 2, "the finding's case has 2 ranks"
    buffer, region = _fill_buffer(ctx, topo)
    failures, in_region = [], []

    def one(n):  # a function, so that the outputs are released before the next dispatch
        try:
            filled = _fill_dispatch(ctx, buffer, region, n, FILL_TOKENS, FILL_HIDDEN, seed=n)
        except deep_ep.GroupMismatchError as error:  # raised on every rank: the sweep goes on in step
            failures.append(f"N={n}: dispatch: {error}")
            return
        in_region.append((n, filled.in_region))
        outcome = _fill_combine(buffer, filled)
        if outcome != "ok":
            failures.append(f"N={n}: {outcome}")

    def held(boundary):
        try:
            filled = [_fill_dispatch(ctx, buffer, region, n, FILL_TOKENS, FILL_HIDDEN, seed=7 + n)
                      for n in (boundary, boundary - 40)]  # fmt: skip
        except deep_ep.GroupMismatchError as error:
            failures.append(f"two held dispatches (N={boundary}, then {boundary - 40}): dispatch: {error}")
            return
        for k, one_filled in enumerate(filled):
            outcome = _fill_combine(buffer, one_filled)
            if outcome != "ok":
                failures.append(f"two held dispatches (N={boundary}, then {boundary - 40}), combine {k}: {outcome}")

    for n in range(lo, hi):
        one(n)
    everyone = [None, None]
    dist.all_gather_object(everyone, in_region)
    boundary = max((n for n, inside in everyone[0] if inside), default=None)  # rank 0's outputs
    if boundary is not None:
        held(boundary)
    return boundary, [n for n, inside in everyone[0] if not inside][:1], failures


def smaller_dispatch_held_after_a_filling_one(ctx, topo, boundary: int, counts: list[int]):
    """Several dispatches held, then combined in order: the finding's case with rank 0's outputs just fitting the
    region (N = `boundary`), then a dispatch of hidden 16 (200 tokens per rank, rank 0 receives each of `counts`) whose
    outputs take the space left. Both combines must work. Returns the failures."""
    buffer, region = _fill_buffer(ctx, topo)
    failures = []

    def one(n2):
        try:
            first = _fill_dispatch(ctx, buffer, region, boundary, FILL_TOKENS, FILL_HIDDEN, seed=1)
            second = _fill_dispatch(ctx, buffer, region, n2, 200, 16, seed=2)
        except deep_ep.GroupMismatchError as error:
            failures.append(f"second dispatch of {n2} rows: dispatch: {error}")
            return
        for name, filled in (("first", first), ("second", second)):
            outcome = _fill_combine(buffer, filled)
            if outcome != "ok":
                failures.append(f"second dispatch of {n2} rows, combine of the {name}: {outcome}")

    for n2 in counts:
        one(n2)
    return failures


def placed_outputs_are_checked(ctx, topo):
    """The node engine's placed outputs (where the internode dispatch's node stage writes recv_x straight into the
    receiver's region; the peers write them without further checks): a tensor outside the region, too few rows,
    another dtype or width, or scales that x lacks are refused with ValueError on the rank that passed them, before
    anything moves (the peers are not involved). Then a placed cached dispatch, by rank 0 only and then by every rank,
    returns the given tensors filled as the plain cached dispatch fills its own; a request larger than the region is
    answered None; the held placed tensors leave room for the buffer's combine. Returns the refusals' messages."""
    buffer = topo.new_buffer(ctx, 4 << 20, explicitly_destroy=True)
    try:
        engine = buffer._engine
        d = check_dispatch(ctx, topo, buffer, 300, 512, 16, 4, seed=3)
        record = record_of(d.handle, engine.handle_kind, engine.group, "placed outputs")
        rows, hidden = d.recv_x.shape
        before, _, _ = buffer.combine(d.recv_x, d.handle, topk_weights=d.recv_w)
        placed = engine.placed_empty((rows, hidden), d.x.dtype, 4)
        assert placed is not None and placed.shape == (rows, hidden)
        assert engine.placed_empty((1 << 20, hidden), torch.float32, 4) is None  # 2 GiB: more than the region
        refused = {}
        attempts = {
            "outside the region": (torch.empty(rows, hidden, dtype=d.x.dtype), None),
            "too few rows": (placed[: rows - 1], None),
            "another dtype": (placed.view(torch.float16), None),
            "another width": (placed.view(-1)[: rows * (hidden // 2)].view(rows, hidden // 2), None),
            "scales x lacks": (placed, placed[:, :4]),
        }
        for name, out in attempts.items():
            try:
                engine.cached_dispatch(d.x, None, record, 0, 1, None, False, out=out)
            except ValueError as error:
                refused[name] = str(error)
        assert set(refused) == set(attempts), f"accepted: {set(attempts) - set(refused)}"
        plain, _, _ = engine.cached_dispatch(d.x, None, record, 0, 1, None, False)
        assert torch.equal(plain, d.recv_x)
        for placing_ranks in ([0], list(range(ctx.world_size))):
            placed.zero_()
            out = (placed, None) if ctx.rank in placing_ranks else None
            recv, _, _ = engine.cached_dispatch(d.x, None, record, 0, 1, None, False, out=out)
            assert torch.equal(recv, d.recv_x), f"placed by ranks {placing_ranks}: rows differ"
            if out is not None:
                assert recv.data_ptr() == placed.data_ptr()
        combined, _, _ = buffer.combine(recv, d.handle, topk_weights=d.recv_w)  # with the placed tensor held
        assert torch.equal(combined, before)
        return refused
    finally:
        buffer.destroy()


# ---------------------------------------------------------------------------------------------------------------
# 9. Timeouts name the missing rank; previous_event; destroyed low-latency buffers; Ctrl-C


def missing_rank_in_cached_dispatch(ctx, topo, timeout_s: float, async_finish: bool):
    """Rank 1 skips a cached dispatch: the others time out after about `timeout_s` and name rank 1."""
    buffer = topo.new_buffer(ctx, 1 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    try:
        d = check_dispatch(ctx, topo, buffer, 64, 64, 8, 2, seed=900)
        if ctx.rank == 1:
            return "skipped"
        start = time.perf_counter()
        try:
            _, *_, event = buffer.dispatch(d.x, handle=d.handle, async_finish=async_finish)
            event.current_stream_wait()
        except deep_ep.CommTimeoutError as error:
            elapsed = time.perf_counter() - start
            assert elapsed < timeout_s + 2, elapsed
            return named_missing_ranks(str(error)), str(error)
        raise AssertionError("the cached dispatch finished without rank 1")
    finally:
        barrier(ctx)  # rank 1 stays until the others have timed out
        buffer.destroy()


def ll_missing_rank_times_out(ctx, topo, timeout_s: float):
    """Low-latency: rank 1 skips a dispatch; the others time out after about `timeout_s` and name rank 1."""
    E = 4 * ctx.world_size
    buffer = ll_buffer(ctx, topo, 32, 256, explicitly_destroy=True, timeout_s=timeout_s)
    try:
        generator = torch.Generator().manual_seed(910 + ctx.rank)
        x = torch.randn(32, 256, generator=generator).bfloat16()
        topk_idx, _ = exact_routing(generator, 32, E)
        buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
        if ctx.rank == 1:
            return "skipped"
        start = time.perf_counter()
        try:
            buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
        except deep_ep.CommTimeoutError as error:
            elapsed = time.perf_counter() - start
            assert elapsed < timeout_s + 2, elapsed
            return named_missing_ranks(str(error)), str(error)
        raise AssertionError("the dispatch finished without rank 1")
    finally:
        barrier(ctx)
        buffer.destroy()


def previous_event_must_be_an_event(ctx, topo):
    """`previous_event` that is not an event (an object, a string, a tensor, the EventOverlap class): ValueError
    from layout, dispatch, cached dispatch and combine, before any communication; then still in step."""
    buffer = topo.buffer(ctx)
    E = 8
    d = check_dispatch(ctx, topo, buffer, 64, 64, E, 2, seed=920)
    layout = layout_kwargs(buffer, d.topk_idx, E)
    wrong = []
    for bad in (object(), "event", torch.ones(1), deep_ep.EventOverlap):
        calls = {
            "get_dispatch_layout": lambda b=bad: buffer.get_dispatch_layout(d.topk_idx, E, previous_event=b),
            "dispatch": lambda b=bad: buffer.dispatch(d.x, topk_idx=d.topk_idx, previous_event=b, **layout),
            "cached dispatch": lambda b=bad: buffer.dispatch(d.x, handle=d.handle, previous_event=b),
            "combine": lambda b=bad: buffer.combine(d.recv_x, d.handle, previous_event=b),
        }
        wrong += refusals_missing({f"{name}({bad!r})": call for name, call in calls.items()}, "previous_event")
    assert not wrong, wrong
    combined, _, _ = buffer.combine(d.recv_x, d.handle)  # still in step
    assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)


def low_latency_after_destroy_says_destroyed(ctx, topo):
    """Every low-latency call on a destroyed buffer raises CommError saying it was destroyed."""
    E = 4 * ctx.world_size
    buffer = ll_buffer(ctx, topo, 32, 256, explicitly_destroy=True)
    generator = torch.Generator().manual_seed(930 + ctx.rank)
    x = torch.randn(32, 256, generator=generator).bfloat16()
    topk_idx, weights = exact_routing(generator, 32, E)
    recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
    barrier(ctx)
    buffer.destroy()
    calls = {
        "low_latency_dispatch": lambda: buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False),
        "low_latency_combine": lambda: buffer.low_latency_combine(recv, topk_idx, weights, handle),
        "clean_low_latency_buffer": lambda: buffer.clean_low_latency_buffer(32, 256, E),
        "get_next_low_latency_combine_buffer": lambda: buffer.get_next_low_latency_combine_buffer(handle),
        "get_local_buffer_tensor": lambda: buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True),
    }
    wrong = []
    for name, call in calls.items():
        try:
            call()
        except deep_ep.CommError as error:
            if "destroyed" not in str(error):
                wrong.append(f"{name}: {error}")
        except Exception as error:  # noqa: BLE001 - reported
            wrong.append(f"{name}: {type(error).__name__}: {error}")
        else:
            wrong.append(f"{name}: accepted")
    assert not wrong, wrong


def sigint_ends_a_blocked_wait(ctx, topo, mode: str, timeout_s: float):
    """Rank 0 blocks in a call whose peer never comes; a timer thread sends SIGINT to its own process 0.3 s later.
    Rank 0 must raise KeyboardInterrupt promptly; rank 1 then makes the call (and, in low-latency mode, the next
    one) and must get a CommError that names rank 0, long before `timeout_s`.

    Returns (rank 0: seconds from the signal to KeyboardInterrupt, rank 1: (seconds, message) of its error)."""
    E = 4 * ctx.world_size
    generator = torch.Generator().manual_seed(940 + ctx.rank)
    x = torch.randn(32, 128, generator=generator).bfloat16()
    topk_idx, weights = exact_routing(generator, 32, E)
    if mode == "low-latency":
        buffer = ll_buffer(ctx, topo, 32, 128, explicitly_destroy=True, timeout_s=timeout_s)

        def calls():
            recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
            yield
            buffer.low_latency_combine(recv, topk_idx, weights, handle)
            yield
    else:
        buffer = topo.new_buffer(ctx, 1 << 20, explicitly_destroy=True, timeout_s=timeout_s)

        def calls():
            recv_x, *_, handle, _ = layout_and_dispatch(buffer, x, topk_idx, weights, E)
            yield
            buffer.combine(recv_x, handle)
            yield

    try:
        for _ in calls():  # one round together
            pass
        barrier(ctx)
        if ctx.rank == 0:
            signalled = []

            def interrupt():
                signalled.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGINT)

            # Python's own SIGINT handler, whatever the launcher left (a shell starting the suite in the background
            # sets SIGINT to ignored, and Python then installs no handler).
            previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
            timer = threading.Timer(0.3, interrupt)
            timer.start()
            try:
                next(calls())
            except KeyboardInterrupt:
                return time.perf_counter() - signalled[0]
            finally:
                timer.cancel()
                signal.signal(signal.SIGINT, previous_handler)
                barrier(ctx)  # now rank 1 comes
            raise AssertionError("the call returned although its peer never came")
        barrier(ctx)
        start = time.perf_counter()
        try:
            for _ in calls():
                pass
        except deep_ep.CommError as error:
            return time.perf_counter() - start, str(error)
        return time.perf_counter() - start, "no error"
    finally:
        barrier(ctx)
        buffer.destroy()


# ---------------------------------------------------------------------------------------------------------------
# 10. Timeouts: values refused; exiting with a wait in flight


def bad_timeouts_are_refused(ctx, topo):
    """NaN, infinities, 0, negatives and non-numbers, wherever a timeout enters: ValueError, nothing changes, and
    the ranks stay in step (no set-up exchange was started)."""
    buffer = topo.buffer(ctx)
    low_latency = cached_ll_buffer(ctx, topo, "main", 32, 256)
    bad = [float("nan"), float("inf"), float("-inf"), 0, 0.0, -1, -0.5, "3", None, True]
    wrong = []
    for value in bad:
        for name, call in {
            "set_timeout": lambda v=value: buffer.set_timeout(v),
            "set_timeout (low-latency)": lambda v=value: low_latency.set_timeout(v),
            "Buffer(timeout_s=...)": lambda v=value: topo.new_buffer(ctx, 1 << 20, timeout_s=v),
        }.items():
            if value is None and name.startswith("Buffer"):
                continue  # None means the default
            try:
                call()
            except ValueError:
                pass
            except Exception as error:  # noqa: BLE001 - reported
                wrong.append(f"{name}({value!r}): {type(error).__name__}: {error}")
            else:
                wrong.append(f"{name}({value!r}): accepted")
    previous = os.environ.get("MTDEEPEP_TIMEOUT_S")
    try:
        for text in ("nan", "NaN", "inf", "-inf", "0", "-3", "abc", ""):
            os.environ["MTDEEPEP_TIMEOUT_S"] = text
            try:
                topo.new_buffer(ctx, 1 << 20)
            except ValueError:
                pass
            except Exception as error:  # noqa: BLE001 - reported
                wrong.append(f"MTDEEPEP_TIMEOUT_S={text!r}: {type(error).__name__}: {error}")
            else:
                wrong.append(f"MTDEEPEP_TIMEOUT_S={text!r}: accepted")
    finally:
        if previous is None:
            os.environ.pop("MTDEEPEP_TIMEOUT_S", None)
        else:
            os.environ["MTDEEPEP_TIMEOUT_S"] = previous
    assert not wrong, wrong
    assert buffer.timeout_s == low_latency.timeout_s == 100.0, (buffer.timeout_s, low_latency.timeout_s)
    fresh = topo.new_buffer(ctx, 1 << 20, explicitly_destroy=True, timeout_s=7.5)  # the set-up exchanges still meet
    try:
        d = check_dispatch(ctx, topo, fresh, 64, 64, 8, 2, seed=1000)
        combined, _, _ = fresh.combine(d.recv_x, d.handle)
        assert_combine_close(combined, identity_partials(topo, d.x, d.in_rank), torch.bfloat16)
    finally:
        fresh.destroy()


_KEPT_UNTIL_EXIT: list = []  # buffers referenced until the interpreter exits, as a training script's global buffer


def _start_silent_waits(mode: str, group, timeout_s: float):
    """A buffer of `mode` after one dispatch on every rank. Returns `(buffer, combine, again)`: `combine(async)` makes
    the combine of that dispatch (returns `(combined, event, exact expected result or None)`), `again()` a whole
    dispatch/combine round."""
    E = 4 * group.size()
    generator = torch.Generator().manual_seed(1100 + group.rank())
    x = torch.randn(32, 128, generator=generator).bfloat16()
    topk_idx, weights = exact_routing(generator, 32, E)
    per_node = {"num_ranks_per_node": 1} if mode.startswith("internode") else {}
    if mode.endswith("low-latency"):
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(32, 128, group.size(), E)
        buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, timeout_s=timeout_s, **per_node)

        def dispatch():
            recv, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 32, E, use_fp8=False)
            return recv, handle

        def combine(recv, handle, async_finish=False):
            combined, event, _ = buffer.low_latency_combine(recv, topk_idx, weights, handle, async_finish=async_finish)
            return combined, event, exact_combine(x, topk_idx, weights, applied=False)
    else:
        buffer = deep_ep.Buffer(group, 1 << 20, timeout_s=timeout_s, **per_node)

        def dispatch():
            recv_x, *_, handle, _ = layout_and_dispatch(buffer, x, topk_idx, weights, E)
            return recv_x, handle

        def combine(recv_x, handle, async_finish=False):
            combined, _, event = buffer.combine(recv_x, handle, async_finish=async_finish)
            return combined, event, None

    first = dispatch()

    def again():
        combine(*dispatch())

    return buffer, lambda async_finish=False: combine(*first, async_finish=async_finish), again


def exit_with_waits_in_flight(proc, modes: list[str], timeout_s: float, stderr_path: str):
    """2 processes, a buffer per mode. Rank 1 starts an async combine on each (its comm thread then waits for rank
    0, which has not joined), keeps the buffers referenced, and returns: the process exits with the waits in flight
    (its stderr goes to `stderr_path`). Rank 0 measures how long rank 1 takes to exit, then makes the matching
    combine on each buffer (a low-latency combine may complete: rank 1's rows had arrived; it must then be exact)
    and one more round, and reports per mode (seconds, first error or 'no error', calls that completed)."""
    if proc.rank == 1:
        stderr = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(stderr, 2)
    group = proc.init_group()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    waits = [_start_silent_waits(mode, group, timeout_s) for mode in modes]
    dist.barrier()
    if proc.rank == 1:
        for buffer, combine, _ in waits:
            _, event, _ = combine(async_finish=True)
            assert not event.query()
            _KEPT_UNTIL_EXIT.append((buffer, event))
        return None
    start = time.time()
    while not process_gone(pids[1]) and time.time() - start < timeout_s + 20:
        time.sleep(0.01)
    exited_after = time.time() - start
    outcomes = {}
    for mode, (_, combine, again) in zip(modes, waits):
        begin = time.perf_counter()
        completed = []
        try:
            combined, _, expected = combine()
            assert expected is not None and torch.equal(combined, expected), f"{mode}: a combine without rank 1"
            completed.append("combine")
            again()
            completed.append("next round")
            message = "no error"
        except deep_ep.CommError as error:
            message = f"{type(error).__name__}: {error}"
        outcomes[mode] = (time.perf_counter() - begin, message, completed)
    return exited_after, outcomes
