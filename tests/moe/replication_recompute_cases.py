"""Hot-expert replication and recompute with expert parallelism: cases run in the rank processes of
a `RankPool` (see test_moe_replication_recompute.py).

Every case compares two layers with the same weights on the same inputs, one with the feature and one without.
Tolerances: replication computes a hot expert's rows in another batch and rank, so every sum (the GEMMs', the
weighted combine, a hot expert's weight gradient summed over ranks) runs in another order. In float32 each such
sum of n terms may move by about n * 2^-24 * sum |terms|; with n in the hundreds, 2e-5 of the tensor's largest
magnitude bounds it (elementwise relative error is meaningless where terms cancel). Recompute rebuilds saved tensors
with the same operations: results must be identical.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe import MoEConfig, MoELayer
from moe.layer.replication import update_hot_experts

H = 32


def _cfg(**overrides) -> MoEConfig:
    base = dict(hidden_size=H, num_moe_experts=8, moe_ffn_hidden_size=48, moe_router_topk=2, init_method_std=0.2,
                moe_shared_expert_intermediate_size=24, moe_aux_loss_coeff=0.01)  # fmt: skip
    return MoEConfig(**{**base, **overrides})


def _pair(ctx, seed: int, skew: bool, dispatcher: str = "alltoall", skewed_experts=(0, 5),
          **feature) -> tuple[MoELayer, MoELayer]:  # fmt: skip
    """`(plain, with_feature)`: same weights (seeded identically on every rank) and dispatcher. With `skew`, the
    two `skewed_experts` take most tokens of skewed inputs (see `_inputs`)."""
    layers = []
    for extra in ({}, feature):
        torch.manual_seed(seed)
        layer = MoELayer(_cfg(moe_token_dispatcher_type=dispatcher, **extra), ep_group=ctx.group)
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict(), strict=False)
    if skew:
        for layer in layers:
            with torch.no_grad():
                layer.router.weight[skewed_experts[0], :4] += 2.0
                layer.router.weight[skewed_experts[1], 4:8] += 2.0
    return layers[0], layers[1]


def _inputs(ctx, seed: int, tokens: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100 + ctx.rank)
    x = torch.randn(tokens, H, generator=gen)
    x[:, :8] = x[:, :8].abs() + 1.0 if skew else 0.0  # the router's skewed columns (see _pair): on or off
    return x, torch.randn(tokens, H, generator=gen)


def _step(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * grad).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _mismatch(actual: torch.Tensor, expected: torch.Tensor, what: str) -> list[str]:
    """[] if `actual` is within 2e-5 of `expected`'s largest magnitude everywhere (see the module docstring)."""
    bound = 2e-5 * float(expected.abs().max()) + 1e-12
    error = float((actual - expected).abs().max()) if actual.shape == expected.shape else float("inf")
    return [] if error <= bound else [f"{what}: max error {error:.3g} > {bound:.3g}"]


def replication_matches_plain_layer(ctx, dispatcher: str) -> dict:
    """Over several optimizer steps: the skewed experts become hot (same set on every rank), outputs and every
    gradient equal the plain layer's, replica copies follow the owners' updates; balanced load releases them."""
    plain, replicated = _pair(ctx, 11, skew=True, dispatcher=dispatcher, moe_hot_expert_replication=True,
                              moe_hot_expert_threshold=1.5, moe_hot_expert_release=1.4)  # fmt: skip
    optimizers = [torch.optim.SGD(layer.parameters(), lr=1e-3) for layer in (plain, replicated)]
    history, errors = [], []  # errors are raised after the last collective, so no rank is left waiting
    for step in range(5):
        skew = step < 3
        x, grad = _inputs(ctx, step, 48 + 8 * ctx.rank, skew)
        expected, got = _step(plain, x, grad), _step(replicated, x, grad)
        errors += _mismatch(got[0], expected[0], f"step {step} output")
        errors += _mismatch(got[1], expected[1], f"step {step} input grad")
        for name in expected[2]:
            errors += _mismatch(got[2][name], expected[2][name], f"step {step} grad of {name}")
        history.append((replicated.replicas.hot, replicated.metrics.num_replicated_slots))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        hot = update_hot_experts([replicated])["replicas"]
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, hot, group=ctx.group)
        errors += [] if all(h == hot for h in everyone) else [f"step {step}: hot sets differ: {everyone}"]
    assert not errors, errors
    # Step 0 runs before any update (nothing hot); steps 1-3 use copies of the two skewed experts (step 3's
    # batch is balanced but the set was chosen from step 2's load); step 3's load releases them for step 4.
    assert history[0] == ([], 0), history
    assert all(history[s][0] == [0, 5] and history[s][1] > 0 for s in (1, 2, 3)), history
    assert history[4] == ([], 0), history
    return {"hot": [h for h, _ in history], "replicated_slots": [n for _, n in history]}


def replication_in_eval_needs_no_backward(ctx) -> None:
    """Under no_grad (evaluation) the hot set is used and nothing is counted."""
    plain, replicated = _pair(ctx, 12, skew=True, moe_hot_expert_replication=True, moe_hot_expert_threshold=1.5)
    x, grad = _inputs(ctx, 0, 40, skew=True)
    _step(replicated, x, grad)
    update_hot_experts([replicated])
    assert replicated.replicas.hot, "nothing became hot"
    with torch.no_grad():
        x, _ = _inputs(ctx, 1, 40, skew=True)
        errors = _mismatch(replicated(x), plain(x), "eval output")
    assert not errors, errors
    assert float(replicated.replicas.load.sum()) == 0.0


def adaptive_recompute_per_rank(ctx) -> list:
    """The rank whose experts receive more rows than the threshold recomputes, the others keep; results are
    identical to the plain layer's on every rank."""
    plain, adaptive = _pair(ctx, 13, skew=True, skewed_experts=(0, 1), moe_adaptive_recompute_tokens=1)
    x, grad = _inputs(ctx, 0, 40, skew=True)
    with torch.no_grad():  # find the rows each rank receives, then put the threshold between them
        plain(x)
    counts = plain.metrics.tokens_per_expert.clone()
    dist.all_reduce(counts, group=ctx.group)
    per_rank = counts.view(ctx.world_size, -1).sum(dim=1)
    threshold = int(per_rank.min() + per_rank.max()) // 2
    assert per_rank.min() <= threshold < per_rank.max(), per_rank
    adaptive.config.moe_adaptive_recompute_tokens = threshold
    expected, got = _step(plain, x, grad), _step(adaptive, x, grad)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for name in expected[2]:
        assert torch.equal(got[2][name], expected[2][name]), name
    return [adaptive.metrics.expert_recompute, int(per_rank[ctx.rank]), threshold]


def recompute_levels_match(ctx, dispatcher: str) -> None:
    """Every level, 'full' included (its backward dispatches again), gives the plain layer's results."""
    for level in ("light", "medium", "full"):
        plain, recomputed = _pair(ctx, 14, skew=False, dispatcher=dispatcher, moe_recompute_level=level,
                                  moe_shared_expert_overlap=True)  # fmt: skip
        x, grad = _inputs(ctx, 2, 36 + 4 * ctx.rank, skew=False)
        expected, got = _step(plain, x, grad), _step(recomputed, x, grad)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), level
        for name in expected[2]:
            assert torch.equal(got[2][name], expected[2][name]), (level, name)
