"""The grouped FP8 GEMM of the routed experts, and the experts that use it, under either recipe.

`fp8_grouped_linear` runs each group's three GEMMs in FP8 with FP32 accumulation:

    forward      y_l  = x_l @ w_l        delayed: x per-tensor (all rows), w per-tensor (all L experts' stacked
                                         weight); blockwise: x 1x128 along K, each w_l in 128x128 blocks
    input grad   dx_l = g_l @ w_l^T      g per-tensor / 1x128 along M
    weight grad  dw_l = x_l^T @ g_l      delayed: the same per-tensor casts; blockwise: x_l^T 1x128 and g_l 128x1
                                         along the tokens

`Fp8SwiGLUExperts` is `moe.layer.experts.SwiGLUExperts` (same parameters, same grouped-GEMM layout `w [L, K, M]`) whose
`linear` is `fp8_grouped_linear`. The MoE layer builds it for `MoEConfig.fp8` (the block-wise recipe); the
converter (convert.py) builds one from a layer's `SwiGLUExperts` for a trainer recipe (`from_experts`, holding the
same Parameter objects). The two GEMM sites (FC1 on `w13 [L, H, 2F]`, FC2 on `w2 [L, F, H]`) keep separate casters
(delayed-scaling histories); the shape of the weight tells them apart (FC1 is `[H, 2F]`, FC2 `[F, H]`: equal only if
F = 0).

Legend: N rows sorted by expert, L experts, K reduction, M columns, H hidden, F expert FFN hidden.
"""

from __future__ import annotations

import torch

from moe.layer import wgrad
from moe.layer.experts import SwiGLUExperts, counts_to_list
from moe.layer.fp8 import gemm
from moe.layer.fp8.cast import Fp8Operand, cast_blockwise
from moe.layer.fp8.linear import Fp8Caster
from moe.layer.fp8.recipe import COL_TILE, BlockwiseScaling, Fp8Recipe


def _rows(op: Fp8Operand, start: int, end: int) -> Fp8Operand:
    """Rows `[start, end)` of an operand cast per tensor or in 1-row tiles."""
    if op.tile is None:
        return Fp8Operand(op.q[start:end], op.scale, None)
    if op.tile[0] != 1:
        raise ValueError(f"cannot slice rows of an operand in {op.tile} tiles")
    return Fp8Operand(op.q[start:end], op.scale[start:end], op.tile)


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: tuple[int, ...], caster: Fp8Caster, slot, split):
        L, K, M = w_LKM.shape
        x8 = caster.input(x_NK)
        if caster.delayed is not None:  # one per-tensor scale for all experts' weights
            w8_all = caster.weight(w_LKM.reshape(L * K, M))
            w8 = [Fp8Operand(w8_all.q.view(L, K, M)[e], w8_all.scale, None) for e in range(L)]
        else:
            w8 = [cast_blockwise(w_LKM[e], caster.recipe.weight_tile, caster.pow2) for e in range(L)]
        bounds = torch.tensor((0, *counts)).cumsum(0).tolist()
        y_NM = x_NK.new_empty(x_NK.size(0), M, dtype=torch.float32)
        for e in range(L):
            a, b = bounds[e], bounds[e + 1]
            if b > a:
                y_NM[a:b] = gemm.scaled_matmul(_rows(x8, a, b), w8[e])
        ctx.caster, ctx.x8, ctx.w8, ctx.bounds, ctx.slot, ctx.split = caster, x8, w8, bounds, slot, split
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x_NK.dtype, w_LKM.dtype, w_LKM.shape
        ctx.save_for_backward(x_NK if caster.delayed is None else None)
        return y_NM.to(x_NK.dtype)

    @staticmethod
    def backward(ctx, g_NM: torch.Tensor):
        (x_NK,) = ctx.saved_tensors
        caster, x8, w8, bounds = ctx.caster, ctx.x8, ctx.w8, ctx.bounds
        L, K, M = ctx.w_shape
        g_NM = g_NM.contiguous()
        g8 = caster.grad_output(g_NM)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = g_NM.new_zeros(g_NM.size(0), K, dtype=torch.float32)
            for e in range(L):
                a, b = bounds[e], bounds[e + 1]
                if b > a:  # no rows: zero input gradients
                    grad_x[a:b] = gemm.scaled_matmul(_rows(g8, a, b), w8[e].t())
            grad_x = grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            w_dtype = ctx.w_dtype

            def weight_grad() -> torch.Tensor:
                grad_w = g_NM.new_zeros(L, K, M, dtype=torch.float32)
                for e in range(L):
                    a, b = bounds[e], bounds[e + 1]
                    if b == a:
                        continue  # no rows: a zero weight gradient
                    if caster.delayed is not None:
                        xt8, gw8 = _rows(x8, a, b).t(), _rows(g8, a, b)
                    else:
                        xt8 = cast_blockwise(x_NK[a:b].t(), caster.recipe.act_tile, caster.pow2)
                        gw8 = cast_blockwise(g_NM[a:b], COL_TILE, caster.pow2)
                    grad_w[e] = gemm.scaled_matmul(xt8, gw8)
                return grad_w.to(w_dtype)

            # Queued while the dispatch's backward communicates, inside `moe.layer.wgrad.deferring` (see
            # moe/layer/wgrad.py).
            grad_w = wgrad.wgrad_or_defer(ctx.slot, weight_grad, ctx.split)
        # The casts stay with the graph (freed with it): torch's split pipeline backward runs this node twice.
        ctx.slot = ctx.split = None
        return grad_x, grad_w, None, None, None, None


def fp8_grouped_linear(
    x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: list[int] | torch.Tensor, caster: Fp8Caster | None = None
) -> torch.Tensor:
    """`y[rows of group l] = x[rows of group l] @ w[l]` in FP8: `x [N, K]` sorted by group, `w [L, K, M]`, `counts`
    `[L]` (ints or an int tensor) summing to N. Returns `[N, M]` in x's dtype.

    `caster`: the GEMM site's casts (None: DeepSeek-V3's block-wise recipe, which keeps no state)."""
    counts = counts_to_list(counts)
    if caster is None:
        caster = Fp8Caster(BlockwiseScaling())
    if w_LKM.dim() != 3 or x_NK.size(1) != w_LKM.size(1) or len(counts) != w_LKM.size(0):
        raise ValueError(
            f"fp8_grouped_linear: x {tuple(x_NK.shape)}, w {tuple(w_LKM.shape)}, {len(counts)} counts do not match"
        )
    if sum(counts) != x_NK.size(0):
        raise ValueError(f"fp8_grouped_linear: counts sum to {sum(counts)}, x has {x_NK.size(0)} rows")
    return _Fp8GroupedLinear.apply(x_NK, w_LKM, tuple(counts), caster, wgrad.slot_for(w_LKM),
                                   wgrad.split_weight_of(w_LKM))  # fmt: skip


class Fp8SwiGLUExperts(SwiGLUExperts):
    """`SwiGLUExperts` whose two grouped GEMMs run in FP8 under `recipe` (the weights stay in their dtype as master
    weights and are cast per use). Supports impl 'grouped' and 'loop' (both compute the same).

    Args:
        *args, **kwargs: those of `SwiGLUExperts`.
        recipe: `BlockwiseScaling` (default: DeepSeek-V3's, `MoEConfig.fp8='e4m3'`) or `DelayedScaling`. Expert
            weights are not tensor parallel, so their amaxes are not reduced over any group.
    """

    def __init__(self, *args, recipe: Fp8Recipe | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.impl == "padded":
            raise ValueError("FP8 experts use grouped GEMMs; impl='padded' (moe_padded_batch_gemm) is not supported")
        recipe = BlockwiseScaling() if recipe is None else recipe
        self.fp8_casters = {"fc1": Fp8Caster(recipe), "fc2": Fp8Caster(recipe)}

    def linear(self, x_NK: torch.Tensor, w_LKM: torch.Tensor, counts: list[int]) -> torch.Tensor:
        site = "fc1" if tuple(w_LKM.shape[1:]) == (self.hidden_size, 2 * self.ffn_hidden_size) else "fc2"
        return fp8_grouped_linear(x_NK, w_LKM, counts, self.fp8_casters[site])

    @classmethod
    def from_experts(cls, experts: SwiGLUExperts, recipe: Fp8Recipe | None = None) -> Fp8SwiGLUExperts:
        """FP8 experts holding `experts`' Parameter objects (an optimizer built before still owns them; state-dict
        keys are unchanged) and settings; `experts` itself is left as it was."""
        if not isinstance(experts, SwiGLUExperts):
            raise ValueError(f"Fp8SwiGLUExperts.from_experts needs SwiGLUExperts, got {type(experts).__name__}")
        new = cls(
            experts.num_local_experts,
            experts.hidden_size,
            experts.ffn_hidden_size,
            impl=experts.impl,
            padded_factor=experts.padded_factor,
            padded_alignment=experts.padded_alignment,
            row_alignment=experts.row_alignment,
            init_std=experts.init_std,
            dtype=experts.w13.dtype,
            device="meta",  # no storage and no random draws: the weights are `experts`' own
            recipe=recipe,
        )
        new.w13, new.w2 = experts.w13, experts.w2
        return new.train(experts.training)
