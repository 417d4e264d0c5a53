"""Multi-process cases: run inside every rank of a `RankPool` started by `test_moe_distributed.py`.

Each case builds a single-process reference layer (EP 1, 'alltoall' dispatcher, whatever the case's dispatcher) and
an expert-parallel layer with the same weights. The reference processes every rank's chunk of tokens in turn (data
parallel over the EP ranks), so for rank r: output(EP) == output(EP 1 on chunk r), expert grads == the reference's
grads of this rank's experts, and the sum over ranks of the replicated (router, shared expert) grads == the
reference's grads. All collectives of a case run before its assertions, so a failed check on one rank cannot leave
the others blocked in a collective.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from moe import MoEConfig, MoELayer, update_expert_bias
from moe.layer.parallel.sharding import tp_shard_of

from .moe_testlib import SIGMOID_V3, SMALL_LAYER, assert_close, ep_group, moe_config

CASES: dict[str, Callable[[int, int, dist.ProcessGroup], None]] = {}


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------


def build_pair(cfg: MoEConfig, group, seed: int = 0, skew: bool = False, etp_group=None) -> tuple[MoELayer, MoELayer]:
    """Reference (EP 1) and expert-parallel layers holding the same weights on every rank (with `etp_group`, the
    expert-parallel layer splits each expert over it: `group` is then the folded EP x ETP group)."""
    torch.manual_seed(seed)
    ref = MoELayer(dataclasses.replace(cfg, moe_token_dispatcher_type="alltoall"))
    with torch.no_grad():
        if ref.router.expert_bias is not None:
            ref.router.expert_bias.bias.copy_(torch.randn(cfg.num_moe_experts) * 0.05)
        if skew:  # experts 0 and 1 win every token: the other ranks' experts receive nothing
            ref.router.weight[2:].mul_(0.01)
            ref.router.weight[:2] = 0.0
            ref.router.weight[0, 0] = ref.router.weight[1, 1] = 1.0
    torch.manual_seed(seed + 1)
    ep = load_ep_from_ref(MoELayer(cfg, ep_group=group, etp_group=etp_group), ref)
    return ref, ep


def local_experts(ep: MoELayer, full: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's part of an `[E, ...]` expert tensor `full` of parameter `name` (its experts, its ETP shard)."""
    part = full[ep.local_expert_start : ep.local_expert_start + ep.num_local_experts]
    shard = tp_shard_of(getattr(ep.experts, name))
    return part if shard is None else shard.shard(part)


def load_ep_from_ref(ep: MoELayer, ref: MoELayer) -> MoELayer:
    with torch.no_grad():
        ep.router.load_state_dict(ref.router.state_dict())
        ep.experts.w13.copy_(local_experts(ep, ref.experts.w13, "w13"))
        ep.experts.w2.copy_(local_experts(ep, ref.experts.w2, "w2"))
        if ref.shared_experts is not None:
            ep.shared_experts.load_state_dict(ref.shared_experts.state_dict())
    return ep


def make_inputs(world: int, sizes: list[int] | None, seq: tuple[int, int] | None, seed: int = 7, skew=False):
    """Every rank's `(x, grad_out)`, generated identically on all ranks."""
    gen = torch.Generator().manual_seed(seed)
    H = SMALL_LAYER["hidden_size"]
    chunks = []
    for r in range(world):
        shape = (*seq, H) if seq is not None else ((sizes[r] if sizes else 12), H)
        x = torch.randn(shape, generator=gen)
        if skew:
            x[..., :2] = x[..., :2].abs() + 3.0
        chunks.append((x, torch.randn(shape, generator=gen)))
    return chunks


def forward_backward(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad, {k: v.clone() for k, v in layer.metrics.losses.items()}


def replicated_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    grads = {"router": layer.router.weight.grad}
    if layer.shared_experts is not None:
        grads["shared_w13"] = layer.shared_experts.w13.grad
        grads["shared_w2"] = layer.shared_experts.w2.grad
    return grads


def compare_with_ep1(
    rank: int,
    world: int,
    group,
    cfg: MoEConfig,
    *,
    sizes: list[int] | None = None,
    seq: tuple[int, int] | None = None,
    skew: bool = False,
    bias_update: bool = False,
    etp: int = 1,
) -> None:
    etp_group = None
    if etp > 1:  # consecutive ranks of `group` (ETP fastest); new_group is collective: every rank makes every one
        for start in range(0, world, etp):
            made = dist.new_group(list(range(start, start + etp)))
            etp_group = made if start <= rank < start + etp else etp_group
    ref, ep = build_pair(cfg, group, skew=skew, etp_group=etp_group)
    chunks = make_inputs(world, sizes, seq, skew=skew)

    ref_results = [forward_backward(ref, x, g) for x, g in chunks]  # one reference forward per rank's chunk
    out, x_grad, losses = forward_backward(ep, *chunks[rank])
    dropped = ep.metrics.num_dropped_tokens

    # Collectives first.
    summed = {}
    for name, grad in replicated_grads(ep).items():
        summed[name] = grad.clone()
        dist.all_reduce(summed[name], group=group)
    bias = ep.router.expert_bias
    if bias is not None:
        counts = bias.counts.clone()
        dist.all_reduce(counts, group=group)
        ref_counts = ref.router.expert_bias.counts.clone()
        if bias_update:
            update_expert_bias(ep, dp_group=group)
            update_expert_bias(ref)

    # Checks.
    ref_out, ref_x_grad, ref_losses = ref_results[rank]
    assert_close(out, ref_out, msg="output")
    assert_close(x_grad, ref_x_grad, msg="input grad")
    start = ep.local_expert_start
    assert ep.experts.w13.grad is not None and ep.experts.w2.grad is not None, "expert grads must exist"
    assert (ep.etp_size, ep.ep_size * ep.etp_size) == (etp, world)
    assert_close(ep.experts.w13.grad, local_experts(ep, ref.experts.w13.grad, "w13"), msg="w13 grad")
    assert_close(ep.experts.w2.grad, local_experts(ep, ref.experts.w2.grad, "w2"), msg="w2 grad")
    for name, grad in replicated_grads(ref).items():
        assert_close(summed[name], grad, msg=f"{name} grad summed over ranks")
    assert set(losses) == set(ref_losses)
    for name in losses:
        assert_close(losses[name], ref_losses[name], msg=f"loss {name}")
    if cfg.moe_expert_capacity_factor is None and not cfg.moe_padded_batch_gemm:
        assert dropped == 0
    if skew:
        assert sum(ep.metrics.tokens_per_expert[2:].tolist()) == 0, "skewed router should use experts 0 and 1 only"
        if start >= 2:
            assert ep.experts.w13.grad.abs().sum() == 0
    if bias is not None:
        assert float(counts.sum()) > 0
        assert_close(counts, ref_counts, msg="expert-bias counts summed over ranks")
        if bias_update:
            assert_close(bias.bias, ref.router.expert_bias.bias, msg="bias after update")
            assert float(bias.counts.abs().sum()) == 0


def _cfg(**overrides) -> MoEConfig:
    return moe_config(SMALL_LAYER, **overrides)


def compare_case(name: str, cfg: MoEConfig, **kwargs) -> None:
    """Registers the case `name`: `compare_with_ep1` of `cfg`, with `kwargs` (sizes, skew, ...)."""
    case(name)(lambda rank, world, group: compare_with_ep1(rank, world, group, cfg, **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# Cases: EP n == EP 1
# ---------------------------------------------------------------------------------------------------------------

for _disp in ("alltoall", "allgather", "flex"):
    _p = {"alltoall": "a2a", "allgather": "ag", "flex": "flex"}[_disp]
    compare_case(
        f"{_p}_softmax_aux_z", _cfg(moe_token_dispatcher_type=_disp, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)
    )
    compare_case(
        f"{_p}_sigmoid_v3_seq_aux_bias_update",
        _cfg(moe_token_dispatcher_type=_disp, **SIGMOID_V3),
        seq=(2, 6),
        bias_update=True,
    )
    compare_case(
        f"{_p}_uneven_tokens_per_rank",
        _cfg(moe_token_dispatcher_type=_disp, moe_aux_loss_coeff=0.01),
        sizes=[5, 12, 1, 9],
    )
    compare_case(f"{_p}_skewed_idle_ranks", _cfg(moe_token_dispatcher_type=_disp), skew=True)
    compare_case(
        f"{_p}_capacity_probs_shared",
        _cfg(
            moe_token_dispatcher_type=_disp,
            moe_expert_capacity_factor=0.75,
            moe_shared_expert_intermediate_size=24,
            moe_aux_loss_coeff=0.01,
        ),
    )

# Expert tensor parallelism: every expert split over 2 ranks (EP 1 x ETP 2 on 2 ranks, EP 2 x ETP 2 on 4), the
# tokens dispatched over the folded group to both shards of their experts, the partial outputs summed by the combine.
for _disp in ("alltoall", "flex"):
    _p = {"alltoall": "a2a", "flex": "flex"}[_disp]
    compare_case(
        f"{_p}_etp2_sigmoid_v3_shared_bias_update",
        _cfg(moe_token_dispatcher_type=_disp, moe_shared_expert_intermediate_size=24, **SIGMOID_V3),
        seq=(2, 6),
        bias_update=True,
        etp=2,
    )
    compare_case(
        f"{_p}_etp2_capacity_uneven", _cfg(moe_token_dispatcher_type=_disp, moe_expert_capacity_factor=0.75),
        sizes=[5, 12, 1, 9], etp=2,
    )  # fmt: skip
compare_case(
    "a2a_etp2_capacity_position_pad_to_capacity",
    _cfg(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True),
    etp=2,
)
compare_case("flex_etp2_skewed_idle_ranks", _cfg(moe_token_dispatcher_type="flex"), skew=True, etp=2)

compare_case(
    "a2a_capacity_position_pad_to_capacity",
    _cfg(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True),
)
compare_case("a2a_shared_expert_overlap", _cfg(moe_shared_expert_intermediate_size=24, moe_shared_expert_overlap=True))
compare_case("a2a_padded_batch_gemm_dropless", _cfg(moe_padded_batch_gemm=True, moe_padded_batch_gemm_alignment=4))
compare_case(
    "a2a_loop_experts_pre_softmax_top3",
    _cfg(moe_grouped_gemm=False, moe_router_topk=3, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.1),
)


# ---------------------------------------------------------------------------------------------------------------
# Other cases
# ---------------------------------------------------------------------------------------------------------------


def _same_as_alltoall(rank, world, group, other: str) -> None:
    """The layer with dispatcher `other` gives the 'alltoall' layer's outputs, losses and gradients."""
    results = []
    for disp in ("alltoall", other):
        cfg = _cfg(
            moe_token_dispatcher_type=disp,
            moe_router_topk=3,
            moe_aux_loss_coeff=0.01,
            moe_shared_expert_intermediate_size=8,
        )
        _, ep = build_pair(cfg, group, seed=3)
        out, x_grad, losses = forward_backward(ep, *make_inputs(world, [7, 3, 11, 4], None)[rank])
        grads = (ep.experts.w13.grad, ep.experts.w2.grad, ep.router.weight.grad, ep.shared_experts.w13.grad)
        results.append((out, x_grad, *grads, losses))
    a, b = results
    for name, u, v in zip(["out", "x grad", "w13 grad", "w2 grad", "router grad", "shared w13 grad"], a, b):
        assert_close(u, v, msg=name)
    assert_close(a[-1]["aux_loss"], b[-1]["aux_loss"], msg="aux loss")


case("alltoall_equals_allgather")(lambda rank, world, group: _same_as_alltoall(rank, world, group, "allgather"))
case("alltoall_equals_flex")(lambda rank, world, group: _same_as_alltoall(rank, world, group, "flex"))


@case("global_aux_loss_over_group")
def _global_aux_loss(rank, world, group):
    coeff = 0.1
    cfg = _cfg(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    torch.manual_seed(0)
    ep = MoELayer(cfg, ep_group=group, aux_loss_group=group)
    ref = MoELayer(_cfg())  # same router weights, no aux loss: the global loss is added by hand below
    ref.router.load_state_dict(ep.router.state_dict())
    chunks = make_inputs(world, None, None, seed=11)
    E = cfg.num_moe_experts

    # Global f from every rank's routing; P from this rank's tokens only, summed and divided by the token count of
    # every rank (Megatron's convention: the ranks' losses add up to the loss of the whole batch).
    routes = [ref.router(x) for x, _ in chunks]
    counts = sum(torch.bincount(r.topk_idx_TK.flatten(), minlength=E).float() for r in routes)
    f_global = counts / sum(r.topk_idx_TK.numel() for r in routes)
    num_tokens = sum(r.topk_idx_TK.size(0) for r in routes)
    expected = [coeff * E * (f_global * r.aux_scores_TE.sum(0) / num_tokens).sum() for r in routes]
    sum(expected).backward()  # reference router grad of the aux term, summed over ranks

    x = chunks[rank][0].clone().requires_grad_()
    out = ep(x)
    (out * 0).sum().backward()  # only the attached aux loss reaches the router
    got = ep.metrics.losses["global_aux_loss"]
    grad = ep.router.weight.grad.clone()
    dist.all_reduce(grad, group=group)

    assert_close(got, expected[rank].detach(), msg="global aux loss")
    assert grad.abs().max() > 0
    assert_close(grad, ref.router.weight.grad, msg="router grad of the global aux loss")


# ---------------------------------------------------------------------------------------------------------------
# 'flex' (mtdeepep) dispatcher against 'alltoall'
# ---------------------------------------------------------------------------------------------------------------

compare_case(
    "flex_shared_expert_overlap_top3",
    _cfg(
        moe_token_dispatcher_type="flex",
        moe_router_topk=3,
        moe_shared_expert_intermediate_size=24,
        moe_shared_expert_overlap=True,
    ),
)
compare_case(
    "flex_padded_batch_gemm_dropless",
    _cfg(moe_token_dispatcher_type="flex", moe_padded_batch_gemm=True, moe_padded_batch_gemm_alignment=4),
)
compare_case(
    "flex_loop_experts_pad_to_capacity",
    _cfg(
        moe_token_dispatcher_type="flex",
        moe_grouped_gemm=False,
        moe_expert_capacity_factor=1.0,
        moe_token_drop_policy="position",
        moe_pad_expert_input_to_capacity=True,
    ),
)


@case("flex_dispatcher_matches_alltoall_rows_and_grads")
def _flex_dispatcher_rows(rank, world, group):
    """Dispatcher level: the experts get the same rows in the same order; x and routing-weight grads agree.

    Top-6 of 8 experts: every token has several experts on most ranks (one row per (token, local expert) must come
    out of one received row); some slots and one whole token are dropped (-1).
    """
    from moe.layer.dispatcher.alltoall import AllToAllDispatcher
    from moe.layer.dispatcher.flex import FlexDispatcher

    T, K, H, E = 9 + 2 * rank, 6, 16, 8
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[1, 2:] = -1
    idx[3] = -1
    probs = torch.rand(T, K, generator=gen)
    scale_H = torch.linspace(0.5, 1.5, H)
    grad_out = torch.randn(T, H, generator=gen)

    results = []
    for disp in (
        AllToAllDispatcher(num_experts=E, ep_group=group),
        FlexDispatcher(num_experts=E, hidden_size=H, ep_group=group),
    ):
        x_leaf, p_leaf = x.clone().requires_grad_(), probs.clone().requires_grad_()
        res = disp.dispatch(x_leaf, p_leaf, idx)
        expert_in = res.expert_input_NH.detach().clone()
        y = torch.tanh(res.expert_input_NH * scale_H)  # a non-linear "expert", the same for every expert
        out = disp.combine(y, res.handle)
        (out * grad_out).sum().backward()
        results.append((expert_in, res.tokens_per_expert, out.detach(), x_leaf.grad, p_leaf.grad))

    (in_a, counts_a, out_a, gx_a, gp_a), (in_f, counts_f, out_f, gx_f, gp_f) = results
    assert counts_f == counts_a, f"tokens per expert {counts_f} != {counts_a}"
    assert torch.equal(in_f, in_a), "expert input rows differ"
    assert_close(out_f, out_a, msg="combined output")
    assert torch.count_nonzero(out_f[3]) == 0, "a fully dropped token must combine to zero"
    assert_close(gx_f, gx_a, msg="x grad")
    assert_close(gp_f, gp_a, msg="routing weight grad")
    assert torch.count_nonzero(gp_f[idx < 0]) == 0, "dropped slots get no weight gradient"


@case("flex_async_dispatch_under_no_grad")
def _flex_async(rank, world, group):
    """With or without autograd the dispatch runs asynchronously (an `EventOverlap` to wait on) and the shared
    expert runs while it is in flight; under autograd the received rows are differentiable. Results are the same
    either way, and as 'alltoall'."""
    import mtdeepep as deep_ep

    outs, events = {}, {}
    x = make_inputs(world, [7, 3, 11, 4], None, seed=5)[rank][0]
    for disp, overlap in (("alltoall", False), ("flex", False), ("flex", True)):
        cfg = _cfg(
            moe_token_dispatcher_type=disp,
            moe_router_topk=3,
            moe_shared_expert_intermediate_size=24,
            moe_shared_expert_overlap=overlap,
        )
        _, ep = build_pair(cfg, group, seed=4)
        with torch.no_grad():
            outs[disp, overlap, "no_grad"] = ep(x)
        outs[disp, overlap, "grad"] = ep(x.clone().requires_grad_()).detach()
        if disp == "flex":
            route = ep.router(x)
            for mode in ("no_grad", "grad"):
                with torch.set_grad_enabled(mode == "grad"):
                    x_in = x.clone().requires_grad_(mode == "grad")
                    pending = ep.dispatcher.dispatch_begin(x_in, route.probs_TK, route.topk_idx_TK)
                    events[overlap, mode] = (pending.event, pending.recv_x_UH.requires_grad)
                    ep.dispatcher.dispatch_end(pending)

    for overlap in (False, True):
        event, recv_requires_grad = events[overlap, "no_grad"]
        assert isinstance(event, deep_ep.EventOverlap), "a no-grad dispatch must be asynchronous"
        assert not recv_requires_grad, "a no-grad dispatch records nothing"
        event, recv_requires_grad = events[overlap, "grad"]
        assert isinstance(event, deep_ep.EventOverlap), "an autograd dispatch must be asynchronous too"
        assert recv_requires_grad, "an autograd dispatch goes through the differentiable deep_ep.dispatch"
    ref = outs["alltoall", False, "grad"]
    for key, out in outs.items():
        assert_close(out, ref, msg=f"output of {key}")
    assert torch.equal(outs["flex", True, "no_grad"], outs["flex", False, "no_grad"]), "overlap changed the output"


@case("flex_shared_overlap_under_autograd_equals_no_overlap_and_alltoall")
def _flex_overlap_autograd(rank, world, group):
    """Training with `moe_shared_expert_overlap`: the shared expert runs while the differentiable dispatch is in
    flight. Outputs, losses and every gradient are bitwise those without overlap, and match 'alltoall'."""
    results = {}
    chunks = make_inputs(world, [9, 4, 13, 6], None, seed=21)
    for disp, overlap in (("alltoall", False), ("flex", False), ("flex", True)):
        cfg = _cfg(
            moe_token_dispatcher_type=disp,
            moe_router_topk=3,
            moe_aux_loss_coeff=0.01,
            moe_shared_expert_intermediate_size=24,
            moe_shared_expert_overlap=overlap,
        )
        _, ep = build_pair(cfg, group, seed=6)
        out, x_grad, losses = forward_backward(ep, *chunks[rank])
        results[disp, overlap] = {
            "out": out,
            "x grad": x_grad,
            "aux loss": losses["aux_loss"],
            "w13 grad": ep.experts.w13.grad,
            "w2 grad": ep.experts.w2.grad,
            "router grad": ep.router.weight.grad,
            "shared w13 grad": ep.shared_experts.w13.grad,
            "shared w2 grad": ep.shared_experts.w2.grad,
        }
    on, off, a2a = results["flex", True], results["flex", False], results["alltoall", False]
    for name in a2a:
        assert on[name] is not None, f"{name} missing with overlap"
        assert torch.equal(on[name], off[name]), f"overlap changed {name}"
        assert_close(on[name], a2a[name], msg=f"{name} vs alltoall")


@case("flex_shared_expert_runs_while_autograd_dispatch_in_flight")
def _flex_overlap_is_real_under_autograd(rank, world, group):
    """Under autograd, the shared expert starts before the dispatch's rows have all arrived.

    Instrumented forward passes: `dispatch_begin` is wrapped to keep its pending dispatch, and a forward pre-hook on
    the shared expert records whether that dispatch's `EventOverlap` is still incomplete (`query()` False) and
    whether `dispatch_end` already ran. Every attempt must show the order begin -> shared expert -> end with an
    asynchronous, autograd-recorded dispatch. The "still in flight" observation is timing-dependent (the rows, 4 MB
    per rank, take milliseconds to move on the comm thread; the hook runs some 100 us after `dispatch_begin`
    returns), so it must hold in at least one of up to 10 attempts on every rank; the ranks agree on stopping, so
    they run the same collectives. A synchronous dispatch (the old autograd path) fails every attempt.
    """
    import mtdeepep as deep_ep

    T, H = 1024, 1024
    cfg = MoEConfig(
        hidden_size=H,
        num_moe_experts=8,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
        moe_token_dispatcher_type="flex",
        moe_shared_expert_intermediate_size=8,
        moe_shared_expert_overlap=True,
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg, ep_group=group)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)

    disp = layer.dispatcher
    log: list = []
    begin, end = disp.dispatch_begin, disp.dispatch_end

    def dispatch_begin(*args):
        pending = begin(*args)
        log.append(("begin", pending))
        return pending

    def dispatch_end(pending):
        log.append(("end", pending))
        return end(pending)

    def shared_pre_hook(module, inputs):
        pending = log[-1][1]
        event = pending.event
        in_flight = isinstance(event, deep_ep.EventOverlap) and not event.query()
        log.append(("shared", (isinstance(event, deep_ep.EventOverlap), in_flight, pending.recv_x_UH.requires_grad)))

    disp.dispatch_begin, disp.dispatch_end = dispatch_begin, dispatch_end
    layer.shared_experts.register_forward_pre_hook(shared_pre_hook)

    attempts, seen_in_flight = [], False
    try:
        for _ in range(10):
            log.clear()
            gc.collect()  # finalizers of earlier cases' buffers must not run inside the observed window
            out = layer(x)
            kinds = [kind for kind, _ in log]
            observed = log[1][1] if kinds == ["begin", "shared", "end"] else (False, False, False)
            attempts.append((kinds, observed, out.requires_grad))
            seen_in_flight |= observed[1]
            everyone = torch.tensor([int(seen_in_flight)])
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
            if everyone.item():
                break
    finally:
        del disp.dispatch_begin, disp.dispatch_end  # no reference cycle: the buffer goes with the layer

    for kinds, (is_async, _, recorded), out_requires_grad in attempts:
        assert kinds == ["begin", "shared", "end"], f"order of calls: {kinds}"
        assert is_async and recorded and out_requires_grad, "the dispatch must be asynchronous and autograd-recorded"
    assert seen_in_flight, f"the dispatch had always completed before the shared expert ({len(attempts)} attempts)"


@case("flex_layers_share_one_buffer")
def _flex_shared_buffer(rank, world, group):
    """Two layers on one passed-in Buffer, through `MoELayer(dispatcher=...)`, match 'alltoall'; a 'flex' layer
    built from the config takes its buffer from the group's default `EPBuffers` on first use, sized by
    `nvl_bytes_hint`, and the buffer is destroyed when the last layer using it goes."""
    import mtdeepep as deep_ep
    from moe.layer.dispatcher.buffers import default_ep_buffers
    from moe.layer.dispatcher.flex import FlexDispatcher, nvl_bytes_hint

    H, E = SMALL_LAYER["hidden_size"], SMALL_LAYER["num_moe_experts"]
    buffer = deep_ep.Buffer(group, num_nvl_bytes=nvl_bytes_hint(H, world), explicitly_destroy=True)
    cfg = _cfg(moe_router_topk=3, moe_token_dispatcher_type="alltoall")  # the 'flex' layers get their dispatcher
    x, g = make_inputs(world, None, None, seed=9)[rank]
    pairs = []
    for seed in (1, 2):
        ref, a2a = build_pair(cfg, group, seed=seed)
        flex = MoELayer(cfg, dispatcher=FlexDispatcher(num_experts=E, hidden_size=H, buffer=buffer))
        load_ep_from_ref(flex, ref)  # the same weights as `a2a`
        pairs.append((a2a, flex, forward_backward(a2a, x, g), forward_backward(flex, x, g)))
    gc.collect()  # the default EPBuffers of earlier cases' layers are gone
    lazy = MoELayer(_cfg(moe_token_dispatcher_type="flex"), ep_group=group)
    created_lazily = lazy.dispatcher.ep_buffers.buffers() == []
    from_default = lazy.dispatcher.ep_buffers is default_ep_buffers(group)
    lazy(x)
    owned = lazy.dispatcher.buffer
    del lazy  # the only layer on the default EPBuffers: they go, destroying the buffer
    buffer.destroy()  # the caller destroys the one it passed in

    for layer, (a2a, flex, (out_a, gx_a, _), (out_f, gx_f, _)) in enumerate(pairs):
        assert flex.dispatcher.ep_group is group and flex.dispatcher.buffer is buffer
        assert flex.dispatcher.ep_buffers is None, "a dispatcher given a buffer takes none from EPBuffers"
        assert_close(out_f, out_a, msg=f"layer {layer} output")
        assert_close(gx_f, gx_a, msg=f"layer {layer} x grad")
        assert_close(flex.experts.w13.grad, a2a.experts.w13.grad, msg=f"layer {layer} w13 grad")
    assert created_lazily and from_default, "the buffer comes from the group's default EPBuffers, on first use"
    assert owned is not buffer and owned.num_nvl_bytes == nvl_bytes_hint(H, world)
    with pytest.raises(deep_ep.CommError, match="destroyed"):
        owned.get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64), E)


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def run_case(ctx, name: str) -> None:
    """Runs the case `name` in a rank of a `RankPool` (see test_moe_distributed.py), on the pool's EP group."""
    CASES[name](ctx.rank, ctx.world_size, ep_group(ctx))
