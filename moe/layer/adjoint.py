"""`adjoint_pair`: the two autograd functions of a pair of linear maps that are each other's adjoint.

A collective that moves or sums rows (all-gather, reduce-scatter) is a linear map whose gradient is its adjoint
(reduce-scatter, all-gather): the gradient of the one is computed by the other over the same non-tensor arguments
(sizes, shards, group). `moe.layer.dispatcher.comm` (per-rank sizes along dim 0) and `moe.layer.parallel.mappings`
(sequence shards) each build their pair here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LinearMap = Callable[..., torch.Tensor]  # (x, *args) -> tensor, args not differentiable


def adjoint_pair(
    op: LinearMap, adjoint: LinearMap, names: tuple[str, str]
) -> tuple[type[torch.autograd.Function], type[torch.autograd.Function]]:
    """Autograd functions `(Op, Adjoint)` over `(x, *args)`: `Op.apply(x, *args)` is `op(x, *args)` with gradient
    `adjoint(grad, *args)`; `Adjoint` the other way round. `names` are their class names (they name the `grad_fn`
    nodes, e.g. '<name>Backward', in graphs and profiles)."""
    return _function(op, adjoint, names[0]), _function(adjoint, op, names[1])


def _function(forward_map: LinearMap, backward_map: LinearMap, name: str) -> type[torch.autograd.Function]:
    def forward(ctx, x: torch.Tensor, *args) -> torch.Tensor:
        ctx.args = args
        return forward_map(x, *args)

    def backward(ctx, grad: torch.Tensor):
        return (backward_map(grad, *ctx.args), *(None for _ in ctx.args))

    namespace = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__qualname__": name}
    # Built by Function's metaclass, which names the backward node class after `name`.
    return type(torch.autograd.Function)(name, (torch.autograd.Function,), namespace)
