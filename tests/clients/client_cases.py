"""Cases run inside the rank processes of `ranks.RankPool`: real DeepEP clients (Megatron-core 0.19.2's `fused_a2a`
and 'flex' dispatcher, torchtitan 0.3.0's DeepEP V2 backend) and mtdeepep's `ElasticBuffer`, each checked against
an independent plain-PyTorch reference.

The reference MoE layer is computed locally in float64 from this rank's own inputs: token t's output is
`sum over its valid slots k of p[t, k] * (x[t] @ W[e[t, k]])`, with every expert's weights `W [E, H, H]` the same on
all ranks (fixed seed). Whatever the ranks exchange, a correct dispatch/combine must reproduce exactly this layer,
its output and the gradients with respect to `x` and the routing probabilities. Dispatch itself (rows, ids,
weights, counts) is compared with `mtdeepep.utils.refs.ref_dispatch` over every rank's gathered inputs, exactly.

Tolerances. Every result is compared elementwise with `a * u * M_round + (b * u + (H + R + K) * 2^-23) * M_acc`:
- `u` is the unit roundoff of the activation dtype (bf16: 2^-8; fp32: 2^-24); `a` counts the roundings to that
  dtype that happen after the expert matmul (of the expert rows, of sums over slots and ranks), each at most
  `u` times the magnitude of what it rounds, hence bounded with `M_round`, the sum of the magnitudes of the terms
  (e.g. `sum_k |p| |x @ W_e|`); `b` counts the roundings before a matmul (e.g. of a gradient that a backward
  matmul then sums over H), bounded through the absolute-value computation `M_acc` (e.g. `sum_k |p| (|x| @ |W_e|)`);
  both are counted per client below;
- the last term bounds FP32 accumulation (dot products of length H, sums over ranks and slots) with `M_acc`.
A wrong route, a lost or duplicated slot, or a wrong weight changes results by the order of `M_round` itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import mtdeepep
from mtdeepep.elastic import ElasticBuffer
from mtdeepep.utils import check_nvlink_connections, refs
from mtdeepep.utils import fp8 as fp8_utils

from ..conformance.placement import CPU, Placement
from . import clients_env

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers


def gather(ctx, value):
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value, group=ctx.group)
    return out


def expert_weights(num_experts: int, hidden: int, seed: int = 1234) -> torch.Tensor:
    """`[E, H, H]` float32, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, hidden, hidden, generator=generator) / hidden**0.5


def make_routing(ctx, num_tokens: int, num_experts: int, num_topk: int, seed: int, masked: float = 0.15):
    """Distinct experts per token (top-k of random scores), some slots masked to -1 (probability 0 there), and
    positive probabilities elsewhere: `(topk_idx [T, K] int64, probs [T, K] float32)`."""
    generator = torch.Generator().manual_seed(seed * 100 + ctx.rank)
    topk_idx = torch.rand(num_tokens, num_experts, generator=generator).topk(num_topk, dim=1).indices
    drop = torch.rand(num_tokens, num_topk, generator=generator) < masked
    topk_idx = topk_idx.masked_fill(drop, -1)
    probs = (torch.rand(num_tokens, num_topk, generator=generator) + 0.1).masked_fill(drop, 0.0)
    return topk_idx, probs


def random_like_dtype(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values exactly representable in `dtype`, returned as float32 (so autograd's casts are exact)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).float()


class Reference:
    """The float64 MoE layer (see the module docstring) with its gradients and the magnitudes for the bounds.

    Arguments: `x [T, H]`, `topk_idx [T, K]` (-1: no expert), `probs [T, K]`, `weights [E, H, H]`,
    `grad_out [T, H]` (the gradient of the loss with respect to the output).
    """

    def __init__(self, x, topk_idx, probs, weights, grad_out) -> None:
        valid = topk_idx >= 0
        safe = topk_idx.clamp(min=0)
        tokens = torch.arange(x.size(0)).unsqueeze(1)
        w = weights.double()
        xr = x.detach().double().requires_grad_()
        pr = probs.detach().double().requires_grad_()
        proj = torch.matmul(xr.unsqueeze(0), w)[safe, tokens]  # [T, K, H]: x[t] @ W[e[t, k]]
        coeff = pr * valid
        self.out = (coeff.unsqueeze(-1) * proj).sum(dim=1)
        g = grad_out.double()
        (self.out * g).sum().backward()
        self.grad_x, self.grad_probs = xr.grad, pr.grad
        with torch.no_grad():
            abs_coeff = coeff.abs().unsqueeze(-1)
            abs_proj = torch.matmul(x.double().abs().unsqueeze(0), w.abs())[safe, tokens]
            back = torch.matmul(g.unsqueeze(0), w.transpose(1, 2))[safe, tokens]  # g[t] @ W[e]^T
            abs_back = torch.matmul(g.abs().unsqueeze(0), w.abs().transpose(1, 2))[safe, tokens]
            self.mag_out = (abs_coeff * proj.abs()).sum(dim=1), (abs_coeff * abs_proj).sum(dim=1)
            self.mag_grad_x = (abs_coeff * back.abs()).sum(dim=1), (abs_coeff * abs_back).sum(dim=1)
            self.mag_grad_probs = (
                (g.abs().unsqueeze(1) * proj.abs()).sum(-1) * valid,
                (g.abs().unsqueeze(1) * abs_proj).sum(-1) * valid,
            )


def assert_bounded(name: str, actual, expected, magnitudes, dtype: torch.dtype, after: int, extra: int, before=0):
    """`|actual - expected| <= after * u(dtype) * M_round + (before * u(dtype) + extra * 2^-23) * M_acc`,
    elementwise (see the module docstring)."""
    assert actual is not None, f"{name}: missing"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    mag_round, mag_acc = magnitudes
    u = UNIT_ROUNDOFF[dtype]
    bound = after * u * mag_round + (before * u + extra * 2.0**-23) * mag_acc + 1e-30
    diff = (actual.double() - expected).abs()
    excess = diff - bound
    assert bool((excess <= 0).all()), (
        f"{name}: max |diff| {diff.max().item():.3e}, worst excess over the bound {excess.max().item():.3e} "
        f"(max |expected| {expected.abs().max().item():.3e})"
    )


def assert_layer_bounded(
    ctx,
    inputs,
    results,
    dtype: torch.dtype,
    after: tuple[int, int, int],
    before_x: int = 0,
    names: tuple[str, str, str] = ("output", "x.grad", "probs.grad"),
) -> None:
    """A client's MoE layer against `Reference(*inputs)`, `inputs = (x [T, H], topk_idx [T, K], probs [T, K],
    weights [E, H, H], grad_out [T, H])`: `results = (output, grad x, grad probs)`, each within `assert_bounded` with
    its count of roundings after (`after`) and, for grad x, before (`before_x`) the matmuls, and the accumulation
    term `H + R + K`."""
    ref = Reference(*inputs)
    x, topk_idx = inputs[:2]
    extra = x.size(1) + ctx.world_size + topk_idx.size(1)
    expected = (ref.out, ref.grad_x, ref.grad_probs)
    magnitudes = (ref.mag_out, ref.mag_grad_x, ref.mag_grad_probs)
    checks = zip(names, results, expected, magnitudes, after, (0, before_x, 0), strict=True)
    for name, actual, exp, mags, rounded, before in checks:
        assert_bounded(name, actual, exp, mags, dtype, rounded, extra, before)


def apply_experts(recv_x, recv_idx, recv_probs, weights, first_expert: int, num_local: int) -> torch.Tensor:
    """The receiving side of the reference layer, in FP32: `y[n] = sum_k p[n, k] * (x[n] @ W[first + id])` over the
    local ids, rounded once to `recv_x`'s dtype."""
    y = torch.zeros(recv_x.size(0), recv_x.size(1), dtype=torch.float32)
    x32 = recv_x.float()  # one cast: its backward rounds the FP32 gradient to recv_x's dtype once
    for local in range(num_local):
        coeff = (recv_probs * (recv_idx == local)).sum(dim=1, keepdim=True)
        y = y + coeff * (x32 @ weights[first_expert + local])
    return y.to(recv_x.dtype)


def apply_grouped_experts(tokens, tokens_per_expert, weights, first_expert: int) -> torch.Tensor:
    """Expert-major rows (`tokens_per_expert[e]` rows of local expert e, one after the other; rows past their sum
    are padding): `rows @ W[first + e]` in FP32, rounded to the tokens' dtype; padding rows give 0."""
    outputs, start = [], 0
    for local, count in enumerate(tokens_per_expert.tolist()):
        block = tokens[start : start + count]
        outputs.append((block.float() @ weights[first_expert + local]).to(tokens.dtype))
        start += count
    padding = tokens.new_zeros(tokens.size(0) - start, tokens.size(1))
    return torch.cat([*outputs, padding])


def reference_dispatch(ctx, everyone, num_experts: int, expert_alignment: int = 1) -> refs.RefDispatchResult:
    """`refs.ref_dispatch` seen from this rank, over every rank's `(x, topk_idx, weights)` (from `gather`)."""
    return refs.ref_dispatch(*[[e[i] for e in everyone] for i in range(3)], num_experts, ctx.rank, expert_alignment)


def check_dispatch_rows(ctx, recv_x, recv_idx, recv_probs, x, topk_idx, probs, num_experts):
    """V1 dispatch results equal `refs.ref_dispatch` over every rank's inputs (bit for bit)."""
    ref = reference_dispatch(ctx, gather(ctx, (x.detach(), topk_idx, probs.detach())), num_experts)
    assert torch.equal(recv_x.detach(), ref.recv_x), "recv_x differs from the reference dispatch"
    assert torch.equal(recv_idx, ref.recv_topk_idx), "recv_topk_idx differs from the reference dispatch"
    assert torch.equal(recv_probs.detach(), ref.recv_topk_weights), "recv probabilities differ from the reference"
    return ref


# ---------------------------------------------------------------------------------------------------------------
# Megatron-core: fused_dispatch / fused_combine (megatron/core/transformer/moe/fused_a2a.py)
#
# Roundings to the activation dtype (bf16): output = expert rows rounded once, combine's FP32 sum rounded once (2);
# grad x = expert backward rounded to recv_x's dtype, dispatch-backward combine rounded once (2); grad probs stays
# FP32 (0).


def _megatron_layer(fa, ctx, x, topk_idx, probs, weights, num_experts, async_finish, allocate_on_comm_stream):
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fa.fused_dispatch(
        x, topk_idx, probs, num_experts, ctx.group, async_finish=async_finish,
        allocate_on_comm_stream=allocate_on_comm_stream,
    )  # fmt: skip
    num_local = num_experts // ctx.world_size
    y = apply_experts(recv_x, recv_idx, recv_probs, weights, ctx.rank * num_local, num_local)
    combined, _ = fa.fused_combine(
        y, ctx.group, handle, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream
    )
    return combined, (recv_x, recv_idx, recv_probs, tokens_per_expert)


def megatron_fused_dispatch_combine(ctx, dtype_name: str, async_finish: bool, allocate_on_comm_stream: bool):
    """Megatron's fused_dispatch + fused_combine, forward and backward, against the reference layer."""
    m = clients_env.prepare_megatron()
    dtype = DTYPES[dtype_name]
    num_tokens, hidden, num_experts, num_topk = 96 - 7 * ctx.rank, 64, 8, 3
    weights = expert_weights(num_experts, hidden)
    topk_idx, probs = make_routing(ctx, num_tokens, num_experts, num_topk, seed=11)
    x = random_like_dtype((num_tokens, hidden), dtype, seed=20 + ctx.rank).to(dtype).requires_grad_()
    probs.requires_grad_()
    grad_out = random_like_dtype((num_tokens, hidden), dtype, seed=30 + ctx.rank)

    combined, (recv_x, recv_idx, recv_probs, tokens_per_expert) = _megatron_layer(
        m.fused_a2a, ctx, x, topk_idx, probs, weights, num_experts, async_finish, allocate_on_comm_stream
    )
    ref_dispatch = check_dispatch_rows(ctx, recv_x, recv_idx, recv_probs, x, topk_idx, probs, num_experts)
    assert tokens_per_expert.tolist() == ref_dispatch.num_recv_tokens_per_expert
    (combined.float() * grad_out).sum().backward()

    assert combined.dtype == dtype
    assert x.grad.dtype == dtype
    assert_layer_bounded(
        ctx, (x, topk_idx, probs, weights, grad_out), (combined, x.grad, probs.grad), dtype, (2, 2, 0),
        names=("combined", "x.grad", "probs.grad"),
    )  # fmt: skip


def megatron_backward_after_buffer_replaced(ctx):
    """Two MoE layers; the second needs a larger buffer, so Megatron's `get_buffer` replaces its global buffer.
    The backward of the first layer then runs with its old handle on the new buffer (DeepEP accepts any handle of
    the group); results must match the reference layers."""
    m = clients_env.prepare_megatron()
    fa = m.fused_a2a
    dtype, num_experts, num_topk = torch.bfloat16, 8, 2
    hidden_small, hidden_large = 64, 1024  # larger than any other case's hidden size: a replacement is certain
    layers = []
    buffers = []
    for i, hidden in enumerate((hidden_small, hidden_large)):
        num_tokens = 40 + 3 * ctx.rank
        weights = expert_weights(num_experts, hidden, seed=77 + i)
        topk_idx, probs = make_routing(ctx, num_tokens, num_experts, num_topk, seed=40 + i)
        x = random_like_dtype((num_tokens, hidden), dtype, seed=50 + 10 * i + ctx.rank).to(dtype).requires_grad_()
        probs.requires_grad_()
        combined, _ = _megatron_layer(fa, ctx, x, topk_idx, probs, weights, num_experts, True, True)
        buffers.append(fa._buffer)
        grad_out = random_like_dtype((num_tokens, hidden), dtype, seed=60 + 10 * i + ctx.rank)
        layers.append((x, topk_idx, probs, weights, grad_out, combined))
    assert buffers[0] is not buffers[1], "the second layer did not replace Megatron's buffer (test premise)"
    loss = sum((combined.float() * grad_out).sum() for *_, grad_out, combined in layers)
    loss.backward()
    for x, topk_idx, probs, weights, grad_out, combined in layers:
        assert_layer_bounded(
            ctx, (x, topk_idx, probs, weights, grad_out), (combined, x.grad, probs.grad), dtype, (2, 2, 0),
            names=("combined", "x.grad", "probs.grad"),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Megatron-core: MoEFlexTokenDispatcher with the 'deepep' backend (megatron/core/transformer/moe/token_dispatcher.py)
#
# Process groups: the dispatcher takes a `ProcessGroupCollection`; it is given the test's group as the expert-parallel
# and tensor+expert-parallel groups and a one-rank group per rank as the expert tensor-parallel group (EP = 2,
# expert TP = 1), without initialising Megatron's global parallel state.
#
# Roundings (bf16): forward = expert rows after the matmul (1) and after the weighting (1), unpermute's bf16 sum of
# up to K rows per token (K - 1), combine (1): K + 2 after; grad x = the weighted gradient rounded before the
# expert's backward matmul (1 before), that matmul's result rounded (1), permute backward's bf16 sum over a token's
# rows (K - 1), dispatch-backward combine (1): K + 1 after; grad probs = from the rounded expert rows (1).


def _megatron_groups(ctx, m):
    if "megatron_pgs" not in ctx.cache:
        own = None
        for r in range(ctx.world_size):  # new_group is collective: every rank creates every one-rank group
            group = dist.new_group([r], backend="gloo")
            if r == ctx.rank:
                own = group
        ctx.cache["megatron_pgs"] = m.ProcessGroupCollection(ep=ctx.group, expt_tp=own, tp_ep=ctx.group)
    return ctx.cache["megatron_pgs"]


def megatron_flex_dispatcher_round_trip(ctx, dtype_name: str):
    """MoEFlexTokenDispatcher ('flex', backend 'deepep'): dispatch_preprocess / token_dispatch / dispatch_postprocess,
    grouped experts, combine_preprocess / token_combine / combine_postprocess, then backward; against the reference."""
    m = clients_env.prepare_megatron()
    dtype = DTYPES[dtype_name]
    seq, batch, hidden, num_experts, num_topk = 24 + 2 * ctx.rank, 2, 64, 8, 2
    num_local = num_experts // ctx.world_size
    config = m.TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=1, num_moe_experts=num_experts,
        moe_router_topk=num_topk, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
        moe_router_dtype="fp32", expert_model_parallel_size=ctx.world_size, moe_permute_fusion=False,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
    )  # fmt: skip
    dispatcher = m.token_dispatcher.MoEFlexTokenDispatcher(
        num_local, list(range(ctx.rank * num_local, (ctx.rank + 1) * num_local)), config, _megatron_groups(ctx, m)
    )
    num_tokens = seq * batch
    weights = expert_weights(num_experts, hidden, seed=91)
    # Every token routes to exactly K experts with positive probabilities (the dispatcher re-derives the top-k).
    topk_idx, topk_probs = make_routing(ctx, num_tokens, num_experts, num_topk, seed=93, masked=0.0)
    probs = torch.zeros(num_tokens, num_experts).scatter(1, topk_idx, topk_probs).requires_grad_()
    routing_map = probs.detach() > 0
    hidden_states = random_like_dtype((seq, batch, hidden), dtype, seed=95 + ctx.rank).to(dtype).requires_grad_()

    tokens, dispatch_probs = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
    tokens, dispatch_probs = dispatcher.token_dispatch(tokens, dispatch_probs)
    expert_in, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(tokens, dispatch_probs)
    expert_out = apply_grouped_experts(expert_in, tokens_per_expert, weights, ctx.rank * num_local)
    expert_out = (expert_out.float() * permuted_probs.unsqueeze(-1)).to(dtype)
    output = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(expert_out)))
    grad_out = random_like_dtype((seq, batch, hidden), dtype, seed=97 + ctx.rank)
    (output.float() * grad_out).sum().backward()

    assert output.shape == hidden_states.shape and output.dtype == dtype
    assert bool((probs.grad.scatter(1, topk_idx, 0.0) == 0).all()), "gradient on probabilities of unrouted experts"
    assert_layer_bounded(
        ctx,
        (hidden_states.view(num_tokens, hidden), topk_idx, topk_probs, weights, grad_out.view(-1, hidden)),
        (output.view(num_tokens, hidden), hidden_states.grad.view(num_tokens, hidden), probs.grad.gather(1, topk_idx)),
        dtype, (num_topk + 2, num_topk + 1, 1), before_x=1, names=("output", "hidden_states.grad", "probs.grad"),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# torchtitan 0.3.0: torchtitan/distributed/deepep/deepep.py on mtdeepep's ElasticBuffer
#
# Roundings (bf16), per torchtitan's compact path: forward = expert rows (1), score rounded to bf16 (1), the
# weighting product (1), `_unpermute_tokens`' bf16 scatter-add over up to K rows (K - 1), combine (1): K + 3 after;
# grad x = score and product rounded before the expert's backward matmul (2 before), that matmul's result (1),
# permute backward's sum over a token's rows (K - 1), combine (1): K + 1 after; grad scores = bf16 reduction in the
# product's backward (1), expert rows (1), cast of the combined gradient to the input dtype (1): 3 after.


def _titan_inputs(ctx, dtype, num_tokens, hidden, num_experts, num_topk, seed):
    weights = expert_weights(num_experts, hidden, seed=seed)
    topk_idx, scores = make_routing(ctx, num_tokens, num_experts, num_topk, seed=seed + 1)
    # torchtitan marks a slot unused by a zero score (it masks those ids to -1 itself): give it real ids there.
    unused = topk_idx < 0
    ids = torch.where(unused, _spare_experts(topk_idx, num_experts), topk_idx)
    x = random_like_dtype((num_tokens, hidden), dtype, seed=seed + 2 + ctx.rank).to(dtype)
    grad_out = random_like_dtype((num_tokens, hidden), dtype, seed=seed + 3 + ctx.rank)
    return weights, topk_idx, ids, scores, x, grad_out


def _titan_layer(titan, ctx, x, ids, scores, weights, num_experts: int, capacity: int, **dispatch_kwargs):
    """torchtitan's MoE communication around the reference experts: `dispatch_tokens`, grouped experts,
    `combine_tokens`, `sync_combine`. Returns `(output, routed rows, tokens per expert, dispatch state)`."""
    num_local = num_experts // ctx.world_size
    routed, tokens_per_expert, state = titan.dispatch_tokens(
        x, ids, scores, num_local, num_experts, num_tokens_per_rank=capacity, **dispatch_kwargs
    )
    expert_out = apply_grouped_experts(routed, tokens_per_expert, weights, ctx.rank * num_local)
    output = titan.combine_tokens(expert_out, state)
    titan.sync_combine()
    return output, routed, tokens_per_expert, state


def _spare_experts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each masked slot, an expert id the token does not use otherwise (torchtitan's input has no -1 ids)."""
    spare = topk_idx.clone()
    for t in range(topk_idx.size(0)):
        free = [e for e in range(num_experts) if e not in topk_idx[t].tolist()]
        for k in range(topk_idx.size(1)):
            if topk_idx[t, k] < 0:
                spare[t, k] = free.pop()
    return spare


def _titan_with_buffer(ctx, placement: Placement, hidden: int, capacity: int, num_topk: int):
    """torchtitan's DeepEP V2 module and its buffer for the layer (`get_buffer`), on the placement's executor."""
    placement.make_current()
    titan = clients_env.prepare_torchtitan()
    buffer = titan.get_buffer(ctx.group, hidden=hidden, num_max_tokens_per_rank=capacity, num_topk=num_topk)
    return titan, placement.check_buffer(buffer)


def torchtitan_training_round_trip(ctx, dtype_name: str, placement: Placement = CPU):
    """get_buffer / dispatch_tokens (compact layout, autograd) / grouped experts / combine_tokens / sync_combine,
    forward and backward, against the reference layer; the routed rows against the reference dispatch. The layer's
    tensors on `placement` (the GPU tests run it on GPU 0, where torchtitan's custom ops run under the CUDA key)."""
    dtype = DTYPES[dtype_name]
    capacity, hidden, num_experts, num_topk = 64, 128, 8, 3
    num_tokens = capacity - 5 * ctx.rank
    weights, topk_idx, ids, scores, x, grad_out = _titan_inputs(
        ctx, dtype, num_tokens, hidden, num_experts, num_topk, 300
    )
    titan, _ = _titan_with_buffer(ctx, placement, hidden, capacity, num_topk)
    x_d, scores_d = placement.to(x).requires_grad_(), placement.to(scores).requires_grad_()
    output, routed, tokens_per_expert, _ = _titan_layer(
        titan, ctx, x_d, placement.to(ids), scores_d, placement.to(weights), num_experts, capacity
    )
    placement.assert_on_device(output, routed)
    # Routed rows: the reference dispatch's rows, repeated once per local expert, in expert-major order.
    ref_dispatch = reference_dispatch(ctx, gather(ctx, (x.detach(), topk_idx, scores.detach())), num_experts)
    rows, slots = (ref_dispatch.recv_topk_idx >= 0).nonzero(as_tuple=True)
    order = torch.argsort(ref_dispatch.recv_topk_idx[rows, slots], stable=True)
    routed_h = placement.host(routed.detach())
    assert torch.equal(routed_h, ref_dispatch.recv_x[rows[order]]), "routed rows differ from the reference"
    assert tokens_per_expert.tolist() == ref_dispatch.num_recv_tokens_per_expert
    (output.float() * placement.to(grad_out)).sum().backward()

    assert output.dtype == dtype and output.shape == x.shape
    results = placement.host((output.detach(), x_d.grad, scores_d.grad))
    assert_layer_bounded(
        ctx, (x.detach(), topk_idx, scores.detach(), weights, grad_out), results, dtype,
        (num_topk + 3, num_topk + 1, 3), before_x=2, names=("output", "x.grad", "scores.grad"),
    )  # fmt: skip
    assert not titan._handle_cache, "torchtitan's handle cache should be empty after the backward"


def torchtitan_inference_expanded_layout(ctx, placement: Placement = CPU):
    """Inference (`cudagraphable=True` under no_grad): the expanded layout with no host synchronisation, per-expert
    counts from the device-side prefix sums (`psum_num_recv_tokens_per_expert`); the output against the reference
    layer. The layer's tensors on `placement`."""
    dtype = torch.bfloat16
    capacity, hidden, num_experts, num_topk = 48, 128, 8, 3
    num_local = num_experts // ctx.world_size
    num_tokens = capacity - 4 * ctx.rank
    weights, topk_idx, ids, scores, x, grad_out = _titan_inputs(
        ctx, dtype, num_tokens, hidden, num_experts, num_topk, 400
    )
    titan, buffer = _titan_with_buffer(ctx, placement, hidden, capacity, num_topk)
    with torch.no_grad():
        output, routed, tokens_per_expert, state = _titan_layer(
            titan, ctx, *placement.to(x, ids, scores, weights), num_experts, capacity, cudagraphable=True
        )
        assert state.cudagraphable, "the expanded (inference) path was not taken"
        worst = ctx.world_size * capacity * min(num_topk, num_local)
        assert routed.size(0) == worst, (routed.size(0), worst)
        ref_dispatch = reference_dispatch(ctx, gather(ctx, (x, topk_idx, scores)), num_experts)
        assert tokens_per_expert.tolist() == ref_dispatch.num_recv_tokens_per_expert
    assert buffer is titan._buffer
    ref = Reference(x, topk_idx, scores, weights, grad_out)
    # Expert rows (1), score product (2: score and product), the expert-rank reduction of a row's slots (1),
    # combine (1).
    output = placement.host(output)
    assert_bounded("output", output, ref.out, ref.mag_out, dtype, 5, hidden + ctx.world_size + num_topk)


def torchtitan_backward_after_buffer_replaced(ctx):
    """Two MoE layers; the second needs a larger buffer, so torchtitan's `get_buffer` replaces its global one and the
    first layer's backward runs with its old handle on the new buffer (as DeepEP allows)."""
    titan = clients_env.prepare_torchtitan()
    dtype, num_experts, num_topk = torch.float32, 8, 2
    layers, buffers = [], []
    # The second layer needs more than the first buffer (2 MiB): R * 640 rows of 1024 values.
    for i, (capacity, hidden) in enumerate(((32, 64), (640, 1024))):
        num_tokens = capacity - 3 * ctx.rank
        weights, topk_idx, ids, scores, x, grad_out = _titan_inputs(
            ctx, dtype, num_tokens, hidden, num_experts, num_topk, 500 + 10 * i
        )
        x.requires_grad_()
        scores.requires_grad_()
        buffers.append(titan.get_buffer(ctx.group, hidden=hidden, num_max_tokens_per_rank=capacity, num_topk=num_topk))
        output = _titan_layer(titan, ctx, x, ids, scores, weights, num_experts, capacity)[0]
        layers.append((x, topk_idx, scores, weights, grad_out, output))
    assert buffers[0] is not buffers[1], "the second layer did not replace torchtitan's buffer (test premise)"
    sum((output * grad_out).sum() for *_, grad_out, output in layers).backward()
    for x, topk_idx, scores, weights, grad_out, output in layers:
        assert_layer_bounded(
            ctx, (x, topk_idx, scores, weights, grad_out), (output, x.grad, scores.grad), dtype, (0, 0, 0),
            names=("output", "x.grad", "scores.grad"),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# mtdeepep.ElasticBuffer directly: DeepEP V2 semantics beyond what torchtitan uses


def _elastic(ctx, capacity: int = 64, hidden: int = 128, **kwargs) -> ElasticBuffer:
    key = f"elastic-{capacity}-{hidden}-{sorted(kwargs.items())}"
    if key not in ctx.cache:
        ctx.cache[key] = ElasticBuffer(ctx.group, num_max_tokens_per_rank=capacity, hidden=hidden, num_topk=4, **kwargs)
    return ctx.cache[key]


def _elastic_inputs(ctx, num_tokens, hidden, num_experts, num_topk, seed, dtype=torch.bfloat16):
    topk_idx, weights = make_routing(ctx, num_tokens, num_experts, num_topk, seed=seed, masked=0.2)
    x = random_like_dtype((num_tokens, hidden), dtype, seed=seed * 7 + ctx.rank).to(dtype)
    everyone = gather(ctx, (x, topk_idx, weights))
    return x, topk_idx, weights, everyone


def elastic_dispatch_matches_reference(ctx, num_ranks_per_node: int | None = None):
    """Non-expanded dispatch with CPU sync, cached dispatch and the handle's V2 fields, against the reference; with
    `num_ranks_per_node=1` every rank is its own node (V1's two-stage internode mode underneath)."""
    capacity, hidden, num_experts, num_topk = 64, 96, 8, 4
    buffer = _elastic(ctx, capacity, hidden, num_ranks_per_node=num_ranks_per_node)
    nodes = ctx.world_size // (num_ranks_per_node or ctx.world_size)
    assert buffer.get_logical_domain_size() == (nodes, ctx.world_size // nodes)
    num_local = num_experts // ctx.world_size
    for seed, (alignment, dtype) in enumerate(((1, torch.bfloat16), (4, torch.float32))):
        num_tokens = capacity - 9 * ctx.rank - seed
        x, topk_idx, weights, everyone = _elastic_inputs(
            ctx, num_tokens, hidden, num_experts, num_topk, 600 + seed, dtype
        )
        stats = torch.full((num_local,), 5, dtype=torch.int32)
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts, expert_alignment=alignment,
            cumulative_local_expert_recv_stats=stats,
        )  # fmt: skip
        assert event.query()
        ref = reference_dispatch(ctx, everyone, num_experts, alignment)
        assert torch.equal(recv_x, ref.recv_x) and torch.equal(recv_idx, ref.recv_topk_idx)
        assert torch.equal(recv_w, ref.recv_topk_weights)
        counts = torch.tensor([int((ref.recv_topk_idx == e).any(dim=1).sum()) for e in range(num_local)])
        assert handle.num_recv_tokens_per_expert_list == ref.num_recv_tokens_per_expert
        assert torch.equal(handle.num_unaligned_recv_tokens_per_expert, counts.int())
        assert torch.equal(stats, counts.int() + 5)
        assert torch.equal(handle.psum_num_recv_tokens_per_expert,
                           torch.tensor(ref.num_recv_tokens_per_expert).cumsum(0).int())  # fmt: skip
        assert handle.num_recv_tokens == ref.recv_x.size(0) == int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        per_source = torch.bincount(ref.recv_src_rank, minlength=ctx.world_size)
        per_peer = per_source.view(nodes, -1).sum(dim=0)  # rows from rank r count for scale-up peer r % ranks/node
        assert torch.equal(handle.psum_num_recv_tokens_per_scaleup_rank, per_peer.cumsum(0).int())
        meta = handle.recv_src_metadata
        assert meta.shape == (ref.recv_x.size(0), num_topk + 2) and meta.dtype == torch.int32
        assert torch.equal(meta[:, 0].long(), ref.recv_src_rank * capacity + ref.recv_src_idx)
        first_local = (ref.recv_topk_idx >= 0).int().argmax(dim=1)
        assert torch.equal(meta[:, 1].long(), ref.recv_src_rank * num_topk + first_local)
        assert bool((meta[:, 2:] == -1).all())
        assert torch.equal(handle.topk_idx, topk_idx) and handle.topk_idx.data_ptr() != topk_idx.data_ptr()
        for t in range(num_tokens):  # dst_buffer_slot_idx: position among the tokens sent to the slot's rank
            for k in range(num_topk):
                e = int(topk_idx[t, k])
                expected = -1 if e < 0 else int(((topk_idx[:t] // num_local) == e // num_local).any(dim=1).sum())
                assert int(handle.dst_buffer_slot_idx[t, k]) == expected
        # Cached: same rows; with weights given, the weights too.
        cached_x, cached_idx, cached_w, cached_handle, _ = buffer.dispatch(x, handle=handle, topk_weights=weights)
        assert cached_handle is handle
        assert torch.equal(cached_x, recv_x) and torch.equal(cached_idx, recv_idx) and torch.equal(cached_w, recv_w)


def elastic_expanded_layout_matches_reference(ctx):
    """Expanded dispatch (with and without CPU sync, with alignment): every expert's rows in place, padding zero,
    1-D weights, V2's prefix-sum convention and slot metadata; cached expanded dispatch; expanded combine."""
    capacity, hidden, num_experts, num_topk, alignment = 64, 64, 8, 4, 8
    buffer = _elastic(ctx, capacity, hidden)
    num_local = num_experts // ctx.world_size
    num_tokens = capacity - 11 * ctx.rank
    x, topk_idx, weights, everyone = _elastic_inputs(ctx, num_tokens, hidden, num_experts, num_topk, 700)
    ref = reference_dispatch(ctx, everyone, num_experts)
    counts = [int((ref.recv_topk_idx == e).any(dim=1).sum()) for e in range(num_local)]
    starts = [sum(-(-c // alignment) * alignment for c in counts[:e]) for e in range(num_local)]
    for do_cpu_sync in (True, False):
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts, expert_alignment=alignment,
            do_expand=True, do_cpu_sync=do_cpu_sync,
        )  # fmt: skip
        assert recv_idx is None and recv_w.dim() == 1
        if do_cpu_sync:
            expected_rows = sum(-(-c // alignment) * alignment for c in counts)
        else:
            expected_rows = -(-(ctx.world_size * capacity * min(num_topk, num_local)
                                + (alignment - 1) * num_local) // alignment) * alignment  # fmt: skip
        assert recv_x.size(0) == recv_w.size(0) == handle.num_expanded_tokens == expected_rows
        assert handle.psum_num_recv_tokens_per_expert.tolist() == [s + c for s, c in zip(starts, counts)]
        filled = torch.zeros(recv_x.size(0), dtype=torch.bool)
        slots = handle.expanded_slots
        for e in range(num_local):
            rows, ks = (ref.recv_topk_idx == e).nonzero(as_tuple=True)
            block = slice(starts[e], starts[e] + counts[e])
            assert torch.equal(recv_x[block], ref.recv_x[rows]), f"expert {e}: rows differ"
            assert torch.equal(recv_w[block], ref.recv_topk_weights[rows, ks])
            assert torch.equal(slots[rows, ks], torch.arange(block.start, block.stop))
            filled[block] = True
        assert bool((recv_x[~filled] == 0).all()) and bool((recv_w[~filled] == 0).all()), "padding is not zero"
        assert bool((slots[ref.recv_topk_idx < 0] == -1).all())
        cached_x, _, cached_w, _, _ = buffer.dispatch(
            x, handle=handle, topk_weights=weights, do_expand=True, do_zero_padding=True
        )
        assert torch.equal(cached_x, recv_x) and torch.equal(cached_w, recv_w)

        # Expanded combine: each token gets the sum of its slot rows; combining the expanded weights gives back the
        # original weights (0 where masked).
        expert_out = (recv_x.float() * (1.0 + torch.arange(recv_x.size(0)).unsqueeze(1) % 3)).to(recv_x.dtype)
        combined, combined_w, event = buffer.combine(
            expert_out, handle, topk_weights=recv_w, async_with_compute_stream=True
        )
        event.current_stream_wait()
        expected = _expanded_combine_reference(ctx, handle, expert_out, ref, num_tokens)
        # Per token: the expert rank's FP32 sum of its slots rounded to bf16 (1), the final rounding (1).
        magnitude = _expanded_combine_reference(ctx, handle, expert_out.abs(), ref, num_tokens)
        assert_bounded("expanded combine", combined, expected, (magnitude, magnitude), torch.bfloat16, 2, num_topk + 2)
        assert torch.equal(combined_w, weights)


def _expanded_combine_reference(ctx, handle, expert_out, ref, num_tokens):
    """float64: token t of rank r sums `expert_out[slot]` over every slot that any rank made for it."""
    slots = handle.recv_src_metadata[: ref.recv_x.size(0), 2:].long()
    per_row = torch.zeros(slots.size(0), expert_out.size(1), dtype=torch.float64)
    valid_rows, ks = (slots >= 0).nonzero(as_tuple=True)
    per_row.index_add_(0, valid_rows, expert_out[slots[valid_rows, ks]].double())
    everyone = gather(ctx, (per_row, ref.recv_src_rank, ref.recv_src_idx))
    out = torch.zeros(num_tokens, expert_out.size(1), dtype=torch.float64)
    for rows, src_rank, src_idx in everyone:
        mine = src_rank == ctx.rank
        out.index_add_(0, src_idx[mine], rows[mine])
    return out


def elastic_combine_matches_reference(ctx):
    """Non-expanded combine with weights and a pair of biases (and without CPU sync) against `refs.ref_combine`."""
    capacity, hidden, num_experts, num_topk = 64, 80, 8, 4
    buffer = _elastic(ctx, capacity, hidden)
    num_tokens = capacity - 6 * ctx.rank
    x, topk_idx, weights, everyone = _elastic_inputs(ctx, num_tokens, hidden, num_experts, num_topk, 800)
    ref = reference_dispatch(ctx, everyone, num_experts)
    generator = torch.Generator().manual_seed(810 + ctx.rank)
    bias = tuple(torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16) for _ in range(2))
    for do_cpu_sync in (True, False):
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts, do_cpu_sync=do_cpu_sync
        )
        valid = handle.num_valid_recv_tokens
        assert valid == ref.recv_x.size(0)
        if not do_cpu_sync:
            assert recv_x.size(0) == handle.num_recv_tokens == ctx.world_size * capacity
            assert handle.num_recv_tokens_per_expert_list == []
            assert torch.equal(recv_x[:valid], ref.recv_x) and bool((recv_idx[valid:] == -1).all())
        expert_out = (recv_x.float() * 1.5).to(torch.bfloat16)
        # Give the -1 slots garbage weights: combine must take each slot from the rank owning its expert only.
        noisy_w = torch.where(recv_idx >= 0, recv_w, torch.full_like(recv_w, 9.0))
        combined, combined_w, _ = buffer.combine(expert_out, handle, topk_weights=noisy_w, bias=bias)
        everyone_out = gather(ctx, (expert_out[:valid], ref.recv_src_rank, ref.recv_src_idx))
        exact = _ref_combine_f64(everyone_out, ctx.rank, num_tokens, bias)
        magnitude = _ref_combine_f64([(o.abs(), r, i) for o, r, i in everyone_out], ctx.rank, num_tokens,
                                     tuple(b.abs() for b in bias))  # fmt: skip
        # FP32 sum of the rows and biases, rounded once to bf16.
        assert combined.dtype == torch.bfloat16
        assert_bounded("combine", combined, exact, (magnitude, magnitude), torch.bfloat16, 1, ctx.world_size + 2)
        assert torch.equal(combined_w, weights)


def _ref_combine_f64(everyone_out, rank, num_tokens, bias) -> torch.Tensor:
    """float64: the sum of the rows every rank received from this rank's tokens, plus the biases."""
    out = torch.zeros(num_tokens, everyone_out[0][0].size(1), dtype=torch.float64)
    for rows, src_rank, src_idx in everyone_out:
        mine = src_rank == rank
        out.index_add_(0, src_idx[mine], rows[mine].double())
    for b in bias:
        out += b.double()
    return out


def elastic_fp8_dispatch(ctx):
    """FP8 pair dispatch (row-major and TMA-aligned column-major scales), non-expanded and expanded."""
    capacity, hidden, num_experts, num_topk = 32, 256, 8, 2
    buffer = _elastic(ctx, capacity, hidden, use_fp8_dispatch=True)
    num_tokens = capacity - 3 * ctx.rank
    x, topk_idx, weights, _ = _elastic_inputs(ctx, num_tokens, hidden, num_experts, num_topk, 900)
    fp8 = fp8_utils.per_token_cast_to_fp8(x)
    everyone = gather(ctx, (fp8[0].view(torch.uint8), fp8[1], topk_idx, weights))
    ref_data = refs.ref_dispatch([e[0] for e in everyone], [e[2] for e in everyone], None, num_experts, ctx.rank)
    ref_scales = refs.ref_dispatch([e[1] for e in everyone], [e[2] for e in everyone], None, num_experts, ctx.rank)
    for col_major in (False, True):
        (recv_data, recv_scales), recv_idx, _, handle, _ = buffer.dispatch(
            fp8, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts,
            use_tma_aligned_col_major_sf=col_major,
        )  # fmt: skip
        assert recv_data.dtype == torch.float8_e4m3fn
        assert torch.equal(recv_data.view(torch.uint8), ref_data.recv_x) and torch.equal(recv_scales, ref_scales.recv_x)
        if col_major:
            assert recv_scales.stride() == (1, -(-recv_scales.size(0) // 4) * 4)
        assert torch.equal(recv_idx, ref_data.recv_topk_idx)
    (exp_data, exp_scales), _, _, exp_handle, _ = buffer.dispatch(
        fp8, topk_idx=topk_idx, num_experts=num_experts, do_expand=True
    )
    slots = exp_handle.expanded_slots
    rows, ks = (slots >= 0).nonzero(as_tuple=True)
    assert torch.equal(exp_data.view(torch.uint8)[slots[rows, ks]], ref_data.recv_x[rows])
    assert torch.equal(exp_scales[slots[rows, ks]], ref_scales.recv_x[rows])


def elastic_bad_inputs_raise_value_error(ctx):
    """Bad arguments raise ValueError before any communication (every rank gets the same bad input)."""
    capacity, hidden, num_experts = 16, 32, 8
    buffer = _elastic(ctx, capacity, hidden)
    x = torch.randn(8, hidden, dtype=torch.bfloat16)
    topk_idx = torch.tensor([[0, num_experts - 1]] * 8)  # experts of the first and the last rank
    _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)

    def expect_value_error(what, call):
        try:
            call()
        except ValueError as error:
            assert "mtdeepep" in str(error), error
        else:
            raise AssertionError(f"{what}: expected ValueError")

    expect_value_error("twice the same expert", lambda: buffer.dispatch(
        x, topk_idx=torch.tensor([[3, 3]] * 8), num_experts=num_experts))  # fmt: skip
    expect_value_error("more tokens than num_max_tokens_per_rank", lambda: buffer.dispatch(
        torch.randn(capacity + 1, hidden), topk_idx=torch.zeros(capacity + 1, 1, dtype=torch.int64),
        num_experts=num_experts))  # fmt: skip
    expect_value_error("no num_experts", lambda: buffer.dispatch(x, topk_idx=topk_idx))
    expect_value_error("expert id out of range", lambda: buffer.dispatch(
        x, topk_idx=torch.tensor([[0, num_experts]] * 8), num_experts=num_experts))  # fmt: skip
    expect_value_error("int32 topk_idx", lambda: buffer.dispatch(x, topk_idx=topk_idx.int(), num_experts=num_experts))
    expect_value_error("zero padding without expand", lambda: buffer.dispatch(
        x, topk_idx=topk_idx, num_experts=num_experts, do_zero_padding=True))  # fmt: skip
    expect_value_error("cached with topk_idx", lambda: buffer.dispatch(x, topk_idx=topk_idx, handle=handle))
    expect_value_error("cached with CPU sync", lambda: buffer.dispatch(x, handle=handle, do_cpu_sync=True))
    expect_value_error("cached with other num_experts", lambda: buffer.dispatch(x, handle=handle, num_experts=16))
    expect_value_error("odd num_sms", lambda: buffer.dispatch(x, topk_idx=topk_idx, num_experts=8, num_sms=3))
    expect_value_error("combine rows", lambda: buffer.combine(torch.randn(handle.num_recv_tokens + 1, hidden), handle))
    expect_value_error("combine int x", lambda: buffer.combine(
        torch.zeros(handle.num_recv_tokens, hidden, dtype=torch.int32), handle))  # fmt: skip
    expect_value_error("bias shape", lambda: buffer.combine(
        torch.randn(handle.num_recv_tokens, hidden), handle, bias=torch.randn(3, hidden)))  # fmt: skip
    expect_value_error("not a handle", lambda: buffer.combine(torch.randn(4, hidden), (1, 2)))
    expect_value_error("Engram bytes beyond num_bytes",
                       lambda: ElasticBuffer(ctx.group, num_bytes=1 << 20, num_cpu_bytes=(1 << 20) + 1))  # fmt: skip
    expect_value_error(
        "Engram bytes without num_bytes",
        lambda: ElasticBuffer(ctx.group, num_max_tokens_per_rank=8, hidden=8, num_cpu_bytes=1),
    )
    expect_value_error("no size", lambda: ElasticBuffer(ctx.group))
    no_multi = _elastic(ctx, capacity, hidden, allow_multiple_reduction=False)
    recv_x, _, recv_w, expanded, _ = no_multi.dispatch(
        x, topk_idx=topk_idx, topk_weights=torch.ones(8, 2), num_experts=num_experts, do_expand=True
    )
    expect_value_error("expanded combine with weights and allow_multiple_reduction=False",
                       lambda: no_multi.combine(recv_x, expanded, topk_weights=recv_w))  # fmt: skip
    # Without weights it combines, the partial sums travelling in FP32 (x is 1 per row and slot: the output counts
    # each token's valid slots, exactly).
    combined, _, _ = no_multi.combine(torch.ones_like(recv_x), expanded)
    assert torch.equal(combined, (topk_idx >= 0).sum(dim=1, keepdim=True).expand(-1, hidden).to(torch.bfloat16))
    # The buffer still works after all of that.
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined, (x.float() * 2).to(torch.bfloat16))  # each token went to two ranks


def elastic_domains_and_lifetime(ctx):
    """Sizes and domains of one node, the SM/QP helpers, capture/barrier, explicit destroy."""
    hint = ElasticBuffer.get_buffer_size_hint(ctx.group, 64, 128, num_topk=4)
    assert hint % (2 << 20) == 0 and hint >= ctx.world_size * 64 * (2 * 128 + 4 * 12 + 4)
    fp8_hint = ElasticBuffer.get_buffer_size_hint(ctx.group, 4096, 7168, num_topk=8, use_fp8_dispatch=True)
    assert fp8_hint < ElasticBuffer.get_buffer_size_hint(ctx.group, 4096, 7168, num_topk=8)
    check_nvlink_connections(ctx.group)  # the ranks of the (one) node share this host
    buffer = ElasticBuffer(ctx.group, num_max_tokens_per_rank=64, hidden=128, explicitly_destroy=True)
    assert buffer.num_bytes == ElasticBuffer.get_buffer_size_hint(ctx.group, 64, 128)
    assert buffer.get_logical_domain_size() == (1, ctx.world_size) == buffer.get_physical_domain_size()
    assert (buffer.scaleout_rank_idx, buffer.scaleup_rank_idx) == (0, ctx.rank)
    assert buffer.get_theoretical_num_sms(8, 2) == mtdeepep.Buffer.num_sms
    assert buffer.get_theoretical_num_qps(20) <= buffer.num_allocated_qps
    assert buffer.capture().query()
    buffer.barrier()
    x = torch.randn(10, 128)
    recv_x, _, _, handle, event = buffer.dispatch(
        x, topk_idx=torch.full((10, 1), ctx.rank, dtype=torch.int64), num_experts=ctx.world_size,
        previous_event=buffer.capture(),
    )  # fmt: skip
    assert torch.equal(recv_x, x)  # each rank sends to itself only
    buffer.destroy()
    try:
        buffer.dispatch(x, handle=handle)
    except RuntimeError as error:
        assert "destroyed" in str(error)
    else:
        raise AssertionError("a destroyed ElasticBuffer must refuse work")
