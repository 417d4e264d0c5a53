"""Learning-rate schedule: linear warm-up, then cosine decay to `min_lr` (Megatron's 'cosine' decay style).

A pure function of the step, so a resumed run needs no scheduler state.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (1-based).

    Steps `1..warmup_steps` rise linearly to `lr` (step s gets `lr * s / warmup_steps`); the remaining steps follow
    half a cosine from `lr` down to `min_lr`, reached at `total_steps`.
    """
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0 or step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / decay_steps
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
