"""Rank cases of test_optim.py: MasterAdamW's reduction, norm, clipping and state on 4 ranks against one process
holding the summed gradients (the gradients of the global loss)."""

from __future__ import annotations

import torch
from torch import nn

from moe.trainer.train.optim import MasterAdamW
from moe.trainer.train.parallel_state import Layout, ParallelState
from moe.trainer.train.training_config import OptimizerConfig
from tests.train.optim_step import optimizer_step
from tests.train.state_io import gathered_state, load_state

E = 8  # experts
WORLD = 4


class Toy(nn.Module):
    """A dense matrix, a vector (no weight decay) and `num_local` experts' weights (sharded along dim 0)."""

    def __init__(self, num_local: int, dtype=torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.dense = nn.Parameter(torch.randn(3, 5, generator=gen).to(dtype))
        self.norm = nn.Parameter(torch.randn(5, generator=gen).to(dtype))
        self.full_experts = torch.randn(E, 2, 3, generator=gen).to(dtype)
        self.experts = nn.Parameter(self.full_experts[:num_local].clone())


def rank_grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """What rank `rank`'s backward leaves at `step`: dense gradients, and gradients of ITS local experts (in a
    layout with `ep` ranks per group, rank r holds experts of EP rank r % ep)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {"dense": torch.randn(3, 5, generator=gen), "norm": torch.randn(5, generator=gen),
            "experts_full": torch.randn(E, 2, 3, generator=gen)}  # fmt: skip


def _config(clip: float) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=clip)


def _run(model: Toy, opt: MasterAdamW, ranks: list[int], ep: int, ep_rank: int, steps: int) -> list[float]:
    """Steps with the gradients of `ranks` summed (one process: all ranks; a rank: only itself).

    An expert's gradient on EP rank s is the contribution of every token dispatched to it; in the fake, rank r's
    contribution to expert e is `experts_full[e]` for the experts of r's EP group... simplified to: each rank adds
    `experts_full[e]` for every expert of its local slice."""
    norms = []
    L = E // ep
    for step in range(1, steps + 1):
        opt.zero_grad()
        grads = [rank_grads(r, step) for r in ranks]
        model.dense.grad = sum(g["dense"] for g in grads).to(model.dense.dtype)
        model.norm.grad = sum(g["norm"] for g in grads).to(model.norm.dtype)
        model.experts.grad = sum(g["experts_full"][ep_rank * L : (ep_rank + 1) * L] for g in grads).to(
            model.experts.dtype
        )
        norms.append(optimizer_step(opt, step))
    return norms


def reference(steps: int, clip: float, ep: int, run_dir: str, dtype=torch.float32):
    """One process: the experts' gradient of expert e is the sum over the ranks r whose EP rank holds e. Returns
    the norms, the parameters and the optimizer state (checkpointed into `run_dir`, read back whole)."""
    model = Toy(E, dtype)
    opt = MasterAdamW(model, [model.experts], _config(clip), ParallelState.single())
    norms = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        grads = {r: rank_grads(r, step) for r in range(WORLD)}
        model.dense.grad = sum(g["dense"] for g in grads.values()).to(dtype)
        model.norm.grad = sum(g["norm"] for g in grads.values()).to(dtype)
        L = E // ep
        full = torch.zeros(E, 2, 3)
        for r, g in grads.items():
            s = r % ep  # the EP rank of r
            full[s * L : (s + 1) * L] += g["experts_full"][s * L : (s + 1) * L]
        model.experts.grad = full.to(dtype)
        norms.append(optimizer_step(opt, step))
    state = gathered_state(opt, ParallelState.single(), run_dir)
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, state


def sharded_case(ctx, steps: int, clip: float, ep: int, run_dir: str, dtype=torch.float32):
    state = ParallelState.from_process_group(Layout(world=ctx.world_size, ep=ep))
    model = Toy(E // ep, dtype)
    L = E // ep
    model.experts.data.copy_(model.full_experts[state.ep_rank * L : (state.ep_rank + 1) * L])
    opt = MasterAdamW(model, [model.experts], _config(clip), state)
    norms = _run(model, opt, [ctx.rank], ep, state.ep_rank, steps)
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, gathered_state(opt, state, run_dir)


def reload_case(ctx, checkpoint: str, steps: int, ep: int, run_dir: str):
    """Load an optimizer checkpoint (of any layout) into a layout with `ep`, then gather it back."""
    state = ParallelState.from_process_group(Layout(world=ctx.world_size, ep=ep))
    model = Toy(E // ep)
    opt = MasterAdamW(model, [model.experts], _config(1.0), state)
    load_state(opt, state, checkpoint, steps)
    local = opt.adamw.state[model.experts]["exp_avg"].clone()
    return local, gathered_state(opt, state, run_dir)
