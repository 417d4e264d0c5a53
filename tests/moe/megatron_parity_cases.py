"""Two-rank cases of test_megatron_parity.py, run in the rank processes of `mtdeepep.utils.testing.RankPool`.

Each rank builds our MoELayer and megatron-core's TopKRouter with the same router weight, runs both on the same
tokens, back-propagates only the attached losses (`(out * 0).sum()`) and compares, on this rank: every loss value
with what Megatron's router recorded (coefficients applied as it applies them), and the router-weight gradient
(this rank's, before any data-parallel reduction) with Megatron's. Both are float32 with the same formulas and
different summation orders, so they agree to float32 rounding: losses to rtol 1e-5 (about 80 ulp), gradients to
1e-5 of the gradient's largest magnitude. Every collective of a case runs before its assertions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe import MoEConfig, MoELayer, reset_global_aux_loss_tracker

from . import megatron_ref as mr
from .moe_testlib import assert_close, moe_config

H, E, K = 32, 16, 4
LOSS_RTOL = 1e-5
# The layer of the parity tests (test_megatron_parity.py's too). No expert parallelism: only the router matters.
ROUTER_PARITY_LAYER = dict(
    hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=16, init_method_std=0.2, moe_token_dispatcher_type="alltoall"
)


def _cfg(**overrides) -> MoEConfig:
    return moe_config(ROUTER_PARITY_LAYER, **{"moe_router_topk": K, **overrides})


def _own_groups(ctx) -> dist.ProcessGroup:
    """This rank's one-rank group (every rank creates every group, as new_group requires)."""
    return [dist.new_group([r]) for r in range(ctx.world_size)][ctx.rank]


def backward_attached_losses(layer: MoELayer, megatron, x_BSH: torch.Tensor) -> None:
    """One micro-batch through both, back-propagating only their attached losses (router grads set to None first)."""
    layer.router.weight.grad = None
    megatron.weight.grad = None
    (layer(x_BSH) * 0).sum().backward()
    probs, _ = mr.run_router(megatron, x_BSH.transpose(0, 1).contiguous())
    (probs * 0).sum().backward()


def compare_step(layer: MoELayer, megatron, x_BSH: torch.Tensor, tp_cp_size: int = 1) -> dict[str, float]:
    """One micro-batch through both; asserts that the losses (there are some) and the router gradients agree,
    returns the largest differences (absolute for the losses, relative to the largest gradient for the gradient)."""
    backward_attached_losses(layer, megatron, x_BSH)
    cfg = layer.config
    expected = mr.recorded_losses(cfg.aux_loss_coeffs, cfg.moe_z_loss_coeff, tp_cp_size)
    assert set(layer.metrics.losses) == set(expected) and expected, (layer.metrics.losses, expected)
    diffs = {}
    for name, value in expected.items():
        got = layer.metrics.losses[name]
        assert_close(got, value, rtol=LOSS_RTOL, atol=0.0, msg=name)
        diffs[name] = float((got.double() - value.double()).abs())
    ours, theirs = layer.router.weight.grad, megatron.weight.grad
    scale = float(theirs.abs().max())
    assert scale > 0
    assert_close(ours, theirs, rtol=0.0, atol=1e-5 * scale, msg="router grad")
    diffs["router_grad"] = float((ours - theirs).abs().max()) / scale
    return diffs


def dp2_global_aux_loss(ctx) -> list[dict[str, float]]:
    """Data parallel 2: each rank routes its own tokens; 'global_aux_loss' counts over both ranks and over the
    micro-batches of the global batch, then starts again after the reset (Megatron's global_tokens_per_expert)."""
    coeff = 0.1
    cfg = _cfg(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=coeff)
    torch.manual_seed(0)
    layer = MoELayer(cfg, aux_loss_group=ctx.group)
    megatron = mr.megatron_router(
        cfg, layer.router.weight.detach(), tp_cp_group=_own_groups(ctx), tp_dp_cp_group=ctx.group
    )
    gen = torch.Generator().manual_seed(100 + ctx.rank)  # different tokens on each rank
    B, S = 2, 12
    diffs, values = [], []
    for step in range(4):
        if step == 3:  # a new global batch: both forget the counts of the first three micro-batches
            assert reset_global_aux_loss_tracker(layer) == 1
            megatron.reset_global_aux_loss_tracker()
        x = torch.randn(B, S, H, generator=gen) + 0.3 * step  # shifted, so the micro-batches route differently
        diffs.append(compare_step(layer, megatron, x))
        values.append(layer.metrics.losses["global_aux_loss"])

    # Megatron's convention, written out for the last micro-batch (right after the reset): f from the counts of
    # both ranks, P = this rank's probability sum over the tokens of both ranks (not this rank's mean).
    route = layer.router(x.view(-1, H))
    counts = torch.bincount(route.aux_scores_TE.topk(K, dim=1).indices.flatten(), minlength=E).float()
    dist.all_reduce(counts, group=ctx.group)
    total_tokens = B * S * ctx.world_size
    f = counts / (K * total_tokens)
    by_hand = coeff * E * (f * route.aux_scores_TE.detach().sum(0) / total_tokens).sum()
    assert_close(values[-1], by_hand, rtol=LOSS_RTOL, atol=0.0, msg="written-out convention")
    return diffs


def tp2_sequence_split_losses(ctx) -> list[dict[str, float]]:
    """Tensor parallel 2 with sequence parallelism: the two ranks hold halves of the same sequences. 'aux_loss'
    and 'seq_aux_loss' count over both halves, the z-loss coefficient is halved; the ranks' losses and router
    gradients add up to those of one rank holding the whole sequences."""
    cfg = _cfg(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.01, 0.05],
        moe_z_loss_coeff=1e-3,
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg, tp_cp_group=ctx.group)
    whole = MoELayer(cfg)
    whole.load_state_dict(layer.state_dict())
    megatron = mr.megatron_router(cfg, layer.router.weight.detach(), tp_cp_group=ctx.group, tp_dp_cp_group=ctx.group)
    B, S = 3, 16
    x_full = torch.randn(B, S, H, generator=torch.Generator().manual_seed(7))  # the same on both ranks
    half = S // ctx.world_size
    x = x_full[:, ctx.rank * half : (ctx.rank + 1) * half].contiguous()
    diffs = [compare_step(layer, megatron, x, tp_cp_size=ctx.world_size)]

    losses = torch.stack([layer.metrics.losses[name] for name in ("aux_loss", "seq_aux_loss", "z_loss")])
    summed_losses = losses.clone()
    summed_grad = layer.router.weight.grad.clone()
    dist.all_reduce(summed_losses, group=ctx.group)
    dist.all_reduce(summed_grad, group=ctx.group)
    (whole(x_full) * 0).sum().backward()
    single = torch.stack([whole.metrics.losses[name] for name in ("aux_loss", "seq_aux_loss", "z_loss")])
    assert_close(summed_losses, single, rtol=LOSS_RTOL, atol=0.0, msg="losses summed over the two halves")
    scale = float(whole.router.weight.grad.abs().max())
    assert_close(summed_grad, whole.router.weight.grad, rtol=0.0, atol=1e-5 * scale, msg="router grad summed")
    return diffs
