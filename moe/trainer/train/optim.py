"""AdamW on FP32 master weights, with the gradient reduction and global-norm clipping of an expert-parallel layout.

Gradients (see moe/trainer/train/parallel_state.py for the groups): every rank's loss is its share of the global-batch
loss (its token-loss sum divided by the global token count), so the gradient of the global loss is the *sum* of the
ranks' gradients, taken
- over the data-parallel group for the dense parameters (replicated on every rank), and
- over the expert-data-parallel group for the expert parameters: an expert's gradient on its EP rank already holds
  the contributions of every token its EP group dispatched to it (the dispatch's backward brings them back), and
  the other EP groups hold the same expert with other tokens.
Reductions run in FP32 (one flat buffer per group). The global norm counts every parameter once: the dense
gradients (identical on all ranks after the reduction) plus the expert gradients summed over the EP group (which
holds each expert once), accumulated in float64.

Parameters in bfloat16 get an FP32 master copy that AdamW updates and that is copied back after each step; FP32
parameters are their own master.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe.trainer.train.parallel_state import ParallelState, all_reduce_sum
from moe.trainer.train.training_config import OptimizerConfig


@dataclass
class StateTensor:
    """One optimizer tensor of this rank, for the sharded checkpoints (moe/trainer/train/checkpoint/train_state.py).

    key: `<param name>.<exp_avg | exp_avg_sq | master>` (its key in a checkpoint's "optimizer" section).
    tensor: the live tensor (a load writes into it): the parameter's local shape, or with `flat` 1-D.
    param: its parameter (local shape and tensor-parallel tags).
    expert: sharded over the EP group along dim 0.
    flat: ZeRO-1: `tensor` holds the elements `[lo, hi)` of the parameter's local tensor (row-major) only.
    """

    key: str
    tensor: torch.Tensor
    param: nn.Parameter
    expert: bool
    flat: tuple[int, int] | None = None


@dataclass
class _Param:
    name: str
    param: nn.Parameter
    master: torch.Tensor  # float32; `param` itself when it is float32
    expert: bool  # sharded over the EP group along dim 0 (local experts)


class MasterAdamW:
    """AdamW over the model's trainable parameters (decoupled weight decay on matrices only: parameters with 2 or
    more dimensions; norms and vectors get none), with the layout's gradient reduction and clipping.

    Args:
        model: the module whose `named_parameters()` are trained.
        expert_params: the parameters sharded over the EP group (dim 0 = local experts, in EP-rank order).
        config: [optimizer]: lr, betas, eps, weight_decay, clip_grad.
        parallel: the groups (dp, ep, expert_dp).
    """

    def __init__(
        self, model: nn.Module, expert_params: list[nn.Parameter], config: OptimizerConfig, parallel: ParallelState
    ) -> None:
        self.config = config
        self.parallel = parallel
        expert_ids = {id(p) for p in expert_params}
        self.params: list[_Param] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            master = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            self.params.append(_Param(name, p, master, id(p) in expert_ids))
        decay = [q.master for q in self.params if decays(q.param)]
        no_decay = [q.master for q in self.params if not decays(q.param)]
        self.adamw = build_adamw(decay, no_decay, config)

    def zero_grad(self) -> None:
        for q in self.params:
            q.param.grad = None
            q.master.grad = None

    def accumulation_context(self, micro_batch: int, num_micro_batches: int) -> contextlib.AbstractContextManager:
        """Nothing to do around a micro-batch's backward (the gradients accumulate in `param.grad` and are reduced
        by `reduce_gradients`); the ZeRO-1 optimizer's version defers its communication to the last one."""
        del micro_batch, num_micro_batches
        return contextlib.nullcontext()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum the gradients over the layout's groups into the FP32 master gradients (a missing gradient counts
        as zero: e.g. an expert that received no token on any rank)."""
        for q in self.params:
            g = q.param.grad
            g = torch.zeros_like(q.master) if g is None else g.float()
            q.master.grad = g if q.master is not q.param else g.contiguous()
        # Sequence parallel: a TP-replicated parameter's gradient is a partial sum over the TP ranks' positions.
        partial = [q.master.grad for q in self.params if getattr(q.param, "sequence_parallel_grad", False)]
        if partial and self.parallel.tp_group is not None:
            flat = torch.cat([g.reshape(-1) for g in partial])
            dist.all_reduce(flat, group=self.parallel.tp_group)
            for g, part in zip(partial, flat.split([g.numel() for g in partial])):
                g.copy_(part.view_as(g))
        for expert, group in ((False, self.parallel.dp_group), (True, self.parallel.expert_dp_group)):
            grads = [q.master.grad for q in self.params if q.expert == expert]
            if group is None or not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    @torch.no_grad()
    def global_grad_norm(self) -> float:
        """L2 norm of the reduced gradient of the whole model, every parameter counted once."""
        # [TP-replicated dense (the same on every TP rank), TP-sharded dense, experts]
        sq = torch.zeros(3, dtype=torch.float64)
        for q in self.params:
            kind = 2 if q.expert else int(getattr(q.param, "tensor_parallel_dim", None) is not None)
            sq[kind] += torch.linalg.vector_norm(q.master.grad, dtype=torch.float32).double() ** 2
        all_reduce_sum(sq[1:2], self.parallel.tp_group)
        all_reduce_sum(sq[2:], self.parallel.expert_model_group)  # one copy of every expert (its ETP shards too)
        all_reduce_sum(sq, self.parallel.pp_group)  # each pipeline rank holds other layers
        return math.sqrt(float(sq.sum()))

    @torch.no_grad()
    def clip(self, norm: float) -> float:
        """Scale the gradients by `clip_grad / norm` when the norm exceeds `clip_grad` (0 = never); returns the
        factor applied."""
        factor = clip_factor(norm, self.config.clip_grad)
        if factor == 1.0:
            return 1.0
        for q in self.params:
            q.master.grad.mul_(factor)
        return factor

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        for q in self.params:
            if q.master is not q.param:
                q.param.copy_(q.master)

    # -- state for sharded checkpoints: this rank's tensors as they are

    @property
    def steps(self) -> int:
        """Optimizer steps taken (AdamW's step count; every parameter steps together)."""
        for q in self.params:
            state = self.adamw.state.get(q.master)
            if state:
                return int(state["step"])
        return 0

    def state_tensors(self, *, create: bool = False) -> list[StateTensor]:
        """This rank's optimizer tensors, live: `<name>.exp_avg` and `.exp_avg_sq` (once stepped; with `create`,
        zero moments are made for a load to fill) and `.master` for the non-FP32 parameters."""
        out = []
        for q in self.params:
            state = self.adamw.state.get(q.master)
            if not state and create:
                state = self.adamw.state[q.master] = {
                    "step": torch.tensor(float(self.steps), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(q.master, memory_format=torch.contiguous_format),
                    "exp_avg_sq": torch.zeros_like(q.master, memory_format=torch.contiguous_format),
                }
            if state:
                for key in ("exp_avg", "exp_avg_sq"):
                    out.append(StateTensor(f"{q.name}.{key}", state[key], q.param, q.expert))
            if q.master is not q.param:
                out.append(StateTensor(f"{q.name}.master", q.master.detach(), q.param, q.expert))
        return out

    def set_steps(self, steps: int) -> None:
        """Set AdamW's step count of every parameter (after a load)."""
        for state in self.adamw.state.values():
            state["step"].fill_(float(steps))

    def state_bytes_per_rank(self) -> int:
        """Bytes of optimizer state this rank holds: exp_avg, exp_avg_sq and the FP32 master copies of the
        non-FP32 parameters (an FP32 parameter is its own master)."""
        return sum(q.master.numel() * 4 * (2 + (q.master is not q.param)) for q in self.params)


# -- pieces shared with the ZeRO-1 optimizer (moe/trainer/train/zero.py)


def decays(param: torch.Tensor) -> bool:
    """Decoupled weight decay applies to matrices (2 or more dimensions), not to norms and vectors."""
    return param.dim() >= 2


def build_adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], config: OptimizerConfig) -> torch.optim.AdamW:
    """torch's single-tensor AdamW (foreach=False: the element-wise maths does not depend on how the tensors are
    cut, so a sharded optimizer stepping slices of a parameter computes the same bits as one stepping all of it)."""
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        foreach=False,
    )


def clip_factor(norm: float, max_norm: float) -> float:
    """`max_norm / norm` when the norm exceeds `max_norm` (> 0), else 1 (also for a non-finite norm)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
