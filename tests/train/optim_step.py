"""The optimizer's part of a training step as the optimizer tests run it (the trainer's order: reduce the
gradients, their global norm, clip, step at the test schedule's learning rate 1e-2 * step)."""

from __future__ import annotations


def optimizer_step(opt, step: int) -> float:
    """Run the update of step `step` (1-based) on `opt` (a `MasterAdamW` or `DistributedAdamW`); returns the global
    gradient norm before clipping."""
    opt.reduce_gradients()
    norm = opt.global_grad_norm()
    opt.clip(norm)
    opt.step(lr=1e-2 * step)
    return norm
