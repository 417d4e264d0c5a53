"""The FP8 linear: forward, input-gradient and weight-gradient GEMMs in E4M3 under either recipe.

    forward      y  = x @ W^T       x [M, K], W [N, K] (nn.Linear's layout), y [M, N]
    input grad   dx = g @ W         g [M, N] (the output gradient)
    weight grad  dW = g^T @ x

Operands per recipe:
    delayed      every operand per-tensor, scales from the site's amax histories (`DelayedState`); the forward's
                 casts of x and W are kept for the backward (as Transformer Engine keeps its FP8 copies), g is cast
                 once and used by both backward GEMMs.
    blockwise    forward: x in 1x128 tiles along K, W in 128x128 blocks; input grad: g in 1x128 tiles along N, the
                 same W blocks (a 128x128 grid reads the same whichever way it is multiplied); weight grad: g^T in
                 1x128 tiles and x in 128x1 tiles, both along the tokens (M), re-cast from the high-precision x.
The bias is added in FP32; the output is in x's dtype, the weight gradient in the weight's (FP32 master weights).

`Fp8LinearFn(recipe, tp_group)` is the `linear_fn` a Linear module calls as `linear_fn(x, weight, bias)`: one per
module, since the delayed recipe's histories belong to one GEMM site. An `Fp8Caster` casts the operands of one GEMM
site; the grouped expert GEMMs (grouped.py) use it too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.layer import wgrad
from moe.layer.fp8 import gemm
from moe.layer.fp8.amax_history import DelayedState
from moe.layer.fp8.cast import Fp8Operand, cast_blockwise, cast_per_tensor
from moe.layer.fp8.recipe import COL_TILE, BlockwiseScaling, DelayedScaling, Fp8Recipe


class Fp8Caster:
    """Casts of one GEMM site's operands under `recipe` (and, for the delayed recipe, its amax histories)."""

    def __init__(self, recipe: Fp8Recipe, tp_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(recipe, (DelayedScaling, BlockwiseScaling)):
            raise ValueError(f"recipe must be DelayedScaling or BlockwiseScaling, got {type(recipe).__name__}")
        self.recipe = recipe
        self.delayed = DelayedState(recipe, tp_group) if isinstance(recipe, DelayedScaling) else None

    @property
    def pow2(self) -> bool:
        return isinstance(self.recipe, BlockwiseScaling) and self.recipe.power_of_two_scales

    def input(self, x_MK: torch.Tensor) -> Fp8Operand:
        """The forward's activation operand (delayed: per-tensor; blockwise: 1x128 along K)."""
        if self.delayed is not None:
            return cast_per_tensor(x_MK, self.delayed.input.scale_for(x_MK))
        return cast_blockwise(x_MK, self.recipe.act_tile, self.pow2)

    def weight(self, w_NK: torch.Tensor) -> Fp8Operand:
        """The weight operand (delayed: per-tensor; blockwise: 128x128 blocks)."""
        if self.delayed is not None:
            return cast_per_tensor(w_NK, self.delayed.weight.scale_for(w_NK))
        return cast_blockwise(w_NK, self.recipe.weight_tile, self.pow2)

    def grad_output(self, g_MN: torch.Tensor) -> Fp8Operand:
        """The output gradient as the input-gradient GEMM's left operand (blockwise: 1x128 along N)."""
        if self.delayed is not None:
            return cast_per_tensor(g_MN, self.delayed.grad_output.scale_for(g_MN))
        return cast_blockwise(g_MN, self.recipe.act_tile, self.pow2)

    def wgrad_operands(
        self, g_MN: torch.Tensor, g8: Fp8Operand, x_MK: torch.Tensor | None, x8: Fp8Operand
    ) -> tuple[Fp8Operand, Fp8Operand]:
        """`(g^T [N, M], x [M, K])` for `dW = g^T @ x`: the delayed recipe reuses the per-tensor casts, the
        block-wise one tiles both along the tokens (g^T 1x128, x 128x1)."""
        if self.delayed is not None:
            return g8.t(), x8
        return (
            cast_blockwise(g_MN.t(), self.recipe.act_tile, self.pow2),
            cast_blockwise(x_MK, COL_TILE, self.pow2),
        )


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None, caster: Fp8Caster, split):
        x8 = caster.input(x_MK)
        w8 = caster.weight(w_NK)
        y_MN = gemm.scaled_matmul(x8, w8.t())
        if bias_N is not None:
            y_MN = y_MN + bias_N.float()
        ctx.caster, ctx.x8, ctx.w8, ctx.split = caster, x8, w8, split
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x_MK.dtype, w_NK.dtype, bias_N is not None
        # The block-wise weight gradient re-tiles x along the tokens: keep the high-precision x for it.
        ctx.save_for_backward(x_MK if caster.delayed is None else None)
        return y_MN.to(x_MK.dtype)

    @staticmethod
    def backward(ctx, g_MN: torch.Tensor):
        (x_MK,) = ctx.saved_tensors
        caster, x8, w8 = ctx.caster, ctx.x8, ctx.w8
        g_MN = g_MN.contiguous()
        g8 = caster.grad_output(g_MN)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = gemm.scaled_matmul(g8, w8).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gt8, xw8 = caster.wgrad_operands(g_MN, g8, x_MK, x8)
            w_dtype = ctx.w_dtype
            # A pipeline W action's GEMM when split (moe.layer.wgrad.split_weight_of), else now.
            grad_w = wgrad.wgrad_or_defer(None, lambda: gemm.scaled_matmul(gt8, xw8).to(w_dtype), ctx.split)
        ctx.split = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g_MN.float().sum(0).to(ctx.w_dtype)
        # ctx.x8 / ctx.w8 stay with the graph (freed with it): torch's split pipeline backward (I, then W) runs this
        # node twice.
        return grad_x, grad_w, grad_b, None, None


def fp8_linear(
    x: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None, caster: Fp8Caster | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with its three GEMMs in FP8. `x [..., K]`; returns `[..., N]` in x's dtype.

    `caster`: the GEMM site's casts (None: DeepSeek-V3's block-wise recipe, which keeps no state)."""
    if weight_NK.dim() != 2 or x.size(-1) != weight_NK.size(1):
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not match weight {tuple(weight_NK.shape)}")
    if caster is None:
        caster = Fp8Caster(BlockwiseScaling())
    x_MK = x.reshape(-1, x.size(-1))
    y_MN = _Fp8Linear.apply(x_MK, weight_NK, bias_N, caster, wgrad.split_weight_of(weight_NK))
    return y_MN.view(*x.shape[:-1], weight_NK.size(0))


class Fp8LinearFn:
    """The `linear_fn` of one Linear module: `fn(x, weight, bias=None)` = `F.linear` in FP8 under `recipe`.

    Args:
        recipe: `DelayedScaling` or `BlockwiseScaling`.
        tp_group: delayed recipe: the group over which amaxes are max-reduced (all TP ranks of a sharded or
            sequence-parallel Linear then cast with one scale). Ignored by the block-wise recipe, whose scales are
            local to each tile.
    """

    def __init__(self, recipe: Fp8Recipe, tp_group: dist.ProcessGroup | None = None) -> None:
        self.recipe = recipe
        self.caster = Fp8Caster(recipe, tp_group)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, weight, bias, self.caster)

    def __repr__(self) -> str:
        return f"Fp8LinearFn({self.recipe})"
