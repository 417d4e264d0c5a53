"""Helpers of the normal-mode conformance cases: inputs, the reference checks of a dispatch, combine tolerances.

Every check compares with the plain-PyTorch reference of `mtdeepep.utils.refs` on the gathered global view, on the
host: inputs are made on the host, moved to the topology's placement (placement.py) and the results copied back.

Tolerances: dispatch moves bytes, so it must be exact. Combine sums rows in FP32 and rounds to the dtype of x: on
one node once; on several nodes twice, since each node's partial sum (the FP32 sum of its ranks' rows) is rounded
to the dtype before the network stage and the FP32 sum of the node partials (plus bias) is rounded once more. With
u the unit roundoff of the dtype (bf16 2^-8, fp16 2^-11, fp32 2^-24), S the exact sum and P_n the exact partial of
node n: `|out - S| <= u |S| (+ u (1 + u) sum_n |P_n| on several nodes) + 4 * 2^-24 * sum |terms|`, the last term
for the FP32 additions (at most a handful per element here). `node_partials_f64` computes the P_n in float64.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import mtdeepep as deep_ep
from mtdeepep.utils import refs

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
ROUTINGS = ("uniform", "skewed")


# ---------------------------------------------------------------------------------------------------------------
# The ranks' collectives: a rank process's gloo group, or the ranks as threads of one process
# (`mtdeepep.utils.local_ranks`, whose context has no group and gathers itself)


def gather(ctx, value):
    """Every rank's `value` (any picklable object), ordered by rank."""
    if hasattr(ctx, "all_gather_object"):
        return ctx.all_gather_object(value)
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value, group=ctx.group)
    return out


def barrier(ctx) -> None:
    """Every rank of the case arrives."""
    if hasattr(ctx, "barrier"):
        ctx.barrier()
    else:
        dist.barrier(group=ctx.group)


def all_reduce_sum(ctx, tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of a host tensor (a new tensor of its dtype)."""
    return torch.stack(gather(ctx, tensor)).sum(dim=0).to(tensor.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Inputs and the checks of a dispatch


def make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed, dtype=torch.bfloat16, masked=0.1,
                routing="uniform"):  # fmt: skip
    """Host tensors, different on every rank: random `x [T, H]`, top-k of random scores `topk_idx [T, K]` (distinct
    experts per token) with a share `masked` of slots set to -1, and positive `topk_weights [T, K]`.

    routing: 'uniform' takes the top-k of uniform random scores; 'skewed' multiplies the scores by a factor falling
    from 4 to 1/4 across the experts, so the first rank's experts get most of the traffic (a hot rank, as unbalanced
    routers give).
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    generator = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
    x = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float32).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float32)
    if routing == "skewed":
        scores = scores * torch.logspace(2, -2, num_experts, base=2.0, dtype=torch.float32)
    topk_idx = scores.topk(num_topk, dim=1).indices
    drop = torch.rand(num_tokens, num_topk, generator=generator, dtype=torch.float32) < masked
    topk_idx = topk_idx.masked_fill(drop, -1)
    topk_weights = torch.rand(num_tokens, num_topk, generator=generator, dtype=torch.float32) + 0.1
    return x, topk_idx, topk_weights


def layout_kwargs(buffer, topk_idx, num_experts, **kwargs) -> dict:
    """`get_dispatch_layout`'s counts as `dispatch` keyword arguments (the per-node counts are None on one node)."""
    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts, **kwargs)
    return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)  # fmt: skip


def layout_and_dispatch(buffer, x, topk_idx, topk_weights, num_experts, with_topk=True, **kwargs):
    """`get_dispatch_layout` then `dispatch` (without top-k when not `with_topk`: upstream's layout-only mode)."""
    topk = dict(topk_idx=topk_idx, topk_weights=topk_weights) if with_topk else {}
    return buffer.dispatch(x, **layout_kwargs(buffer, topk_idx, num_experts), **topk, **kwargs)


def tokens_in_rank(ctx, topk_idx, num_experts) -> torch.Tensor:
    """`[T, R]` bool: which ranks each token reaches (the reference layout)."""
    return refs.ref_dispatch_layout(topk_idx, num_experts, ctx.world_size)[2]


def reference_dispatch(ctx, x, topk_idx, topk_weights, num_experts, expert_alignment=1) -> refs.RefDispatchResult:
    """`refs.ref_dispatch` of every rank's host inputs, for this rank."""
    everyone = gather(ctx, (x, topk_idx, topk_weights))
    return refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], num_experts, ctx.rank, expert_alignment)


@dataclass
class Dispatched:
    """A checked dispatch: this rank's host inputs and their copies on the device (`inputs`: x, topk_idx,
    topk_weights), the buffer's outputs (on the device) and the reference's."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    inputs: tuple
    recv_x: torch.Tensor
    recv_idx: torch.Tensor
    recv_w: torch.Tensor
    counts: list[int]
    handle: tuple
    ref: refs.RefDispatchResult
    in_rank: torch.Tensor  # [T, R] bool, the reference layout


def check_dispatch(ctx, topo, buffer, num_tokens, hidden, num_experts, num_topk, seed, dtype=torch.bfloat16,
                   masked=0.1, expert_alignment=1, routing="uniform", **dispatch_kwargs) -> Dispatched:  # fmt: skip
    """Dispatch random inputs on the topology's placement; every output equal to the reference, plus upstream's own
    checks and the handle's. `dispatch_kwargs` go to the dispatch (e.g. a `config`)."""
    placement = topo.placement
    x, topk_idx, topk_weights = make_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed, dtype, masked,
                                            routing)  # fmt: skip
    inputs = placement.to(x, topk_idx, topk_weights)
    recv_x, recv_idx, recv_w, counts, handle, event = layout_and_dispatch(
        buffer, *inputs, num_experts, expert_alignment=expert_alignment, **dispatch_kwargs
    )
    assert event.query()
    placement.assert_on_device(recv_x, recv_idx, recv_w)
    got_x, got_idx, got_w = placement.host((recv_x, recv_idx, recv_w))
    ref = reference_dispatch(ctx, x, topk_idx, topk_weights, num_experts, expert_alignment)
    assert torch.equal(got_x, ref.recv_x), "recv_x differs from the reference"
    assert torch.equal(got_idx, ref.recv_topk_idx), "recv_topk_idx differs"
    assert torch.equal(got_w, ref.recv_topk_weights), "recv_topk_weights differs"
    assert counts == ref.num_recv_tokens_per_expert, (counts, ref.num_recv_tokens_per_expert)
    # Upstream's own checks: local ids in [-1, E_local), weights 0 exactly where the id is -1, counts equal to
    # the all-reduced per-expert counts.
    num_local = num_experts // ctx.world_size
    assert bool(((got_idx >= -1) & (got_idx < num_local)).all())
    assert bool((got_w[got_idx < 0] == 0).all())
    global_counts = all_reduce_sum(ctx, (topk_idx.unsqueeze(-1) == torch.arange(num_experts)).sum(dim=(0, 1)).int())
    local_counts = global_counts[ctx.rank * num_local : (ctx.rank + 1) * num_local]
    assert counts == [refs.align_up(c, expert_alignment) for c in local_counts.tolist()]
    in_rank = tokens_in_rank(ctx, topk_idx, num_experts)
    check_handle(ctx, topo, placement.host(handle), ref, in_rank)
    return Dispatched(x, topk_idx, topk_weights, inputs, recv_x, recv_idx, recv_w, counts, handle, ref, in_rank)


def check_handle(ctx, topo, handle, ref: refs.RefDispatchResult, in_rank: torch.Tensor) -> None:
    """The handle's documented contents (upstream's positions, on the host): the one place that reads inside a
    handle. The channel prefixes and send_head are the executor's own bookkeeping: checked on the CPU executor."""
    assert isinstance(handle, tuple)
    if topo.internode:
        # is_token_in_rank first, upstream's recv_gbl_rank_prefix_sum at [-4], then the sources of the rows.
        assert len(handle) == 8 and torch.equal(handle[0], in_rank)
        assert torch.equal(handle[-4], ref.rank_prefix_matrix[:, ctx.rank])
        assert torch.equal(handle.recv_src_meta.long(), torch.stack([ref.recv_src_rank, ref.recv_src_idx], dim=1))
        return
    rank_prefix_matrix, channel_prefix, recv_channel_prefix, recv_src_idx, handle_in_rank, send_head = handle
    assert torch.equal(rank_prefix_matrix, ref.rank_prefix_matrix), "handle: rank_prefix_matrix"
    assert torch.equal(recv_src_idx.long(), ref.recv_src_idx), "handle: recv_src_idx"
    assert torch.equal(handle_in_rank, in_rank), "handle: is_token_in_rank"
    if topo.placement.on_gpu:
        return
    assert channel_prefix.shape == recv_channel_prefix.shape == (ctx.world_size, deep_ep.Buffer.num_sms // 2)
    # send_head: each token's position among the tokens sent to each rank, -1 where it is not sent.
    for r in range(ctx.world_size):
        sent = in_rank[:, r]
        assert bool((send_head[~sent, r] == -1).all())
        assert torch.equal(send_head[sent, r], torch.arange(int(sent.sum()), dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------------
# Combine tolerances


def identity_partials(topo, x: torch.Tensor, in_rank: torch.Tensor) -> torch.Tensor:
    """`[num_nodes, T, H]` float64 node partials when every rank returns its received rows unchanged: each token
    times the number of ranks of the node that it reaches."""
    per_node = in_rank.view(in_rank.size(0), topo.num_nodes, topo.node_size).sum(dim=2)
    return x.double().unsqueeze(0) * per_node.T.unsqueeze(2)


def node_partials_f64(ctx, topo, expert_out, src_rank, src_idx, num_tokens) -> torch.Tensor:
    """`[num_nodes, T, H]` float64: for each node, the exact sum of the rows its ranks send back to this rank."""
    everyone = gather(ctx, (expert_out, src_rank, src_idx))
    partials = torch.zeros(topo.num_nodes, num_tokens, expert_out.size(1), dtype=torch.float64)
    for j, (rows, ranks, idx) in enumerate(everyone):
        mine = ranks == ctx.rank
        partials[j // topo.node_size].index_add_(0, idx[mine], rows[mine].double())
    return partials


def assert_combine_close(actual, partials, dtype, extra=None) -> None:
    """`actual` vs the exact sum of `partials [num_nodes, T, H]` (+ `extra`), within the module docstring's bound."""
    assert actual.dtype == dtype, (actual.dtype, dtype)
    actual = actual.to(partials.device)  # the GPU executors' outputs against the host's exact sums
    extra = None if extra is None else extra.to(partials.device)
    u = UNIT_ROUNDOFF[dtype]
    exact = partials.sum(dim=0) + (0 if extra is None else extra)
    magnitude = partials.abs().sum(dim=0) + (0 if extra is None else extra.abs())
    bound = u * exact.abs() + 4 * 2.0**-24 * magnitude + 1e-30
    if partials.size(0) > 1:
        bound = bound + u * (1 + u) * partials.abs().sum(dim=0)
    excess = (actual.double() - exact).abs() - bound
    assert bool((excess <= 0).all()), f"max excess {excess.max().item():.3e}"


# ---------------------------------------------------------------------------------------------------------------
# Errors


def first_error(topo, kind: type[Exception], call, *later) -> Exception | None:
    """The `kind` error that `call` raises, or None. The CPU executor raises in the call. On a GPU the host learns of
    a device-side error where it synchronises: in the call when it does (a dispatch that returns counts), else at an
    event's wait, at the device synchronisation, at the latest at the buffer's next call: `later`, those points in
    order, are tried there until one raises."""
    steps = [call, *later] if topo.placement.on_gpu else [call]
    for step in steps:
        try:
            step()
        except kind as error:
            return error
    return None


def assert_value_errors(calls: dict) -> dict[str, ValueError]:
    """Every call of `calls` (name -> function) raises ValueError; returns the errors by name for message checks."""
    errors, wrong = {}, []
    for name, call in calls.items():
        try:
            call()
        except ValueError as error:
            errors[name] = error
        except Exception as error:  # noqa: BLE001 - reported below with the calls that raised nothing
            wrong.append(f"{name}: {type(error).__name__}")
        else:
            wrong.append(f"{name}: no error")
    assert not wrong, f"expected ValueError: {wrong}"
    return errors


# ---------------------------------------------------------------------------------------------------------------
# Overlap


def assert_overlaps(ctx, run, calibrate: int, repeats: int, what: str) -> tuple[float, float, float]:
    """Asserts that `run(work_s)` (the communication with `work_s` seconds of the caller's work in its window; 0:
    none) overlaps the two; `run` starts with a barrier of all ranks, so they time the same operation.

    With work time S ~ t = `run(0)`, serial execution takes t + S; perfect overlap saves min(t, S), none saves
    nothing. Require half. S is the median of `calibrate` runs; t and the overlapped time are medians of `repeats`
    interleaved runs (slow drifts of a noisy machine hit both alike); up to three attempts, agreed by all ranks, so
    that a burst of outside load cannot fail the test while a missing overlap fails all three.
    Returns `(t, S, overlapped time)` in seconds.
    """
    for _ in range(3):
        work_s = statistics.median(run(0.0) for _ in range(calibrate))
        serial, overlapped = [], []
        for _ in range(repeats):
            serial.append(run(0.0))
            overlapped.append(run(work_s))
        t_comm, t_overlapped = statistics.median(serial), statistics.median(overlapped)
        saved = t_comm + work_s - t_overlapped
        if all(gather(ctx, saved >= 0.5 * min(t_comm, work_s))):
            break
    assert saved >= 0.5 * min(t_comm, work_s), (
        f"no overlap: {what} with work {t_overlapped * 1e3:.2f} ms vs {t_comm * 1e3:.2f} ms + work"
        f" {work_s * 1e3:.2f} ms"
    )
    return t_comm, work_s, t_overlapped


def assert_async_overlaps(ctx, buffer, x, dispatch_kwargs) -> tuple[float, float, float]:
    """Work between an `async_finish=True` dispatch/combine and its wait overlaps the transfer (`assert_overlaps`).

    The rows move on the buffer's comm thread; the caller's work is `time.sleep`, a stand-in for accelerator work
    that frees the core (a CPU-bound computation cannot overlap a CPU copy on a 2-core machine: both need the same
    cores).
    """

    def run(work_s: float) -> float:
        barrier(ctx)
        start = time.perf_counter()
        recv_x, _, _, _, handle, event = buffer.dispatch(x, async_finish=True, **dispatch_kwargs)
        if work_s:
            time.sleep(work_s / 2)
        event.current_stream_wait()
        combined, _, event = buffer.combine(recv_x, handle, async_finish=True)
        if work_s:
            time.sleep(work_s / 2)
        event.current_stream_wait()
        return time.perf_counter() - start

    return assert_overlaps(ctx, run, calibrate=3, repeats=5, what="dispatch+combine")
