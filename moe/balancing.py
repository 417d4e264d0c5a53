"""Load balancing: auxiliary losses, the aux-loss-free expert bias, and per-layer load metrics.

Legend: T tokens, B sequences, S tokens per sequence, K top-k slots, E experts.

All losses are computed in float32 and returned *without* their coefficient unless the function says so.
`attach_aux_loss` makes a loss reach the gradient without changing the forward value of the activations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

# ---------------------------------------------------------------------------------------------------------------
# Auxiliary losses
# ---------------------------------------------------------------------------------------------------------------


def tokens_per_expert(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed slots per expert: `[E] float32`. Slots with id -1 (dropped) are ignored."""
    idx = topk_idx_TK.reshape(-1)
    idx = idx[idx >= 0]
    counts = torch.zeros(num_experts, dtype=torch.float32, device=topk_idx_TK.device)
    return counts.index_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))


def switch_aux_loss(scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer balancing loss `E * sum_i f_i * P_i` (0-d float32).

    Args:
        scores_TE: `[T, E]` per-expert probabilities of every token (differentiable).
        topk_idx_TK: `[T, K] int64` chosen experts.

    `f_i` is the fraction of the `T*K` routed slots that went to expert `i` (no gradient), `P_i` the mean
    probability of expert `i` over the tokens. Equals 1 when routing is perfectly uniform.
    """
    num_slots = topk_idx_TK.numel()
    f_E = tokens_per_expert(topk_idx_TK, num_experts) / max(num_slots, 1)
    P_E = scores_TE.float().mean(dim=0)
    return num_experts * torch.sum(f_E * P_E)


def seq_aux_loss(scores_BSE: torch.Tensor, topk_idx_BSK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Sequence-wise balancing loss (DeepSeek-V2/V3): the Switch loss of each sequence, averaged over sequences.

    Args:
        scores_BSE: `[B, S, E]` per-expert probabilities.
        topk_idx_BSK: `[B, S, K] int64` chosen experts.
    """
    B, S, K = topk_idx_BSK.shape
    counts_BE = torch.zeros(B, num_experts, dtype=torch.float32, device=scores_BSE.device)
    flat_BN = topk_idx_BSK.reshape(B, S * K)
    valid_BN = flat_BN >= 0
    counts_BE.scatter_add_(1, flat_BN.clamp(min=0), valid_BN.float())
    f_BE = counts_BE / (S * K)
    P_BE = scores_BSE.float().mean(dim=1)
    return num_experts * (f_BE * P_BE).sum(dim=1).mean()


def global_aux_loss(
    scores_TE: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Switch loss with `f` taken over every rank of `group` (e.g. the data-parallel group), `P` local.

    The slot counts and the number of slots are summed over `group` (no gradient flows through them), so
    the balance target is the global batch rather than this rank's micro-batch. `group=None` or a
    single-process run gives `switch_aux_loss`.
    """
    counts_E = tokens_per_expert(topk_idx_TK, num_experts)
    num_slots = torch.tensor([float(topk_idx_TK.numel())], device=counts_E.device)
    if _group_size(group) > 1:
        packed = torch.cat([counts_E, num_slots])
        dist.all_reduce(packed, group=group)
        counts_E, num_slots = packed[:-1], packed[-1:]
    f_E = counts_E / num_slots.clamp(min=1)
    P_E = scores_TE.float().mean(dim=0)
    return num_experts * torch.sum(f_E * P_E)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss `mean_t(logsumexp_i(logits[t, i])^2)` (ST-MoE), float32, without its coefficient."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


# ---------------------------------------------------------------------------------------------------------------
# Attaching an auxiliary loss to the activations
# ---------------------------------------------------------------------------------------------------------------


class AuxLossScale:
    """A mutable loss scale read by `attach_aux_loss` at *backward* time.

    Set it to what the main loss is multiplied by before `backward()` (e.g. `1 / num_microbatches` under gradient
    accumulation, times a loss-scaler's factor under fp16). One instance can be shared by every MoE layer of a
    model; `set_aux_loss_scale(model, value)` sets every instance found in a module tree.
    """

    def __init__(self, value: float = 1.0) -> None:
        self.value = float(value)

    def __repr__(self) -> str:
        return f"AuxLossScale({self.value})"


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `activation`; in backward, hands `aux_loss` the gradient `scale.value` (a scalar loss)."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_activation: torch.Tensor):
        grad_aux = torch.full(ctx.aux_shape, ctx.scale.value, dtype=ctx.aux_dtype, device=grad_activation.device)
        return grad_activation, grad_aux, None


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
    """Return `activation` unchanged, such that `backward()` of any loss depending on it also back-propagates
    `scale.value * aux_loss`.

    Args:
        activation: any tensor on the path to the main loss (the MoE output).
        aux_loss: 0-d tensor, already multiplied by its coefficient.
        scale: read when backward runs, so it may be set after the forward pass.
    """
    if not (activation.requires_grad and aux_loss.requires_grad):
        return activation
    return _AttachAuxLoss.apply(activation, aux_loss, scale)


def set_aux_loss_scale(module: nn.Module, value: float) -> None:
    """Set every `AuxLossScale` held (as attribute `aux_loss_scale`) by a module of `module`'s tree."""
    for m in module.modules():
        scale = getattr(m, "aux_loss_scale", None)
        if isinstance(scale, AuxLossScale):
            scale.value = float(value)


# ---------------------------------------------------------------------------------------------------------------
# Aux-loss-free balancing (DeepSeek-V3 expert bias)
# ---------------------------------------------------------------------------------------------------------------


def _in_backward_pass() -> bool:
    """True while the autograd engine runs (e.g. activation-checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


class ExpertBias(nn.Module):
    """Per-expert selection bias of aux-loss-free balancing, with the token counts that drive its update.

    Buffers (float32): `bias [E]` (added to the scores for expert *selection* only) and `counts [E]` (routed
    slots since the last update). `record` counts only in forward passes that build a graph
    (`torch.is_grad_enabled()`) and that do not run inside backward, so evaluation under `no_grad` and
    activation recomputation (non-reentrant `torch.utils.checkpoint`) are not counted twice. A reentrant
    checkpoint runs its first forward under `no_grad` and therefore records nothing.
    """

    def __init__(self, num_experts: int, update_rate: float = 1e-3) -> None:
        super().__init__()
        self.update_rate = float(update_rate)
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer("counts", torch.zeros(num_experts, dtype=torch.float32))

    def record(self, topk_idx_TK: torch.Tensor) -> None:
        if torch.is_grad_enabled() and not _in_backward_pass():
            self.counts += tokens_per_expert(topk_idx_TK.detach(), self.counts.numel())

    @torch.no_grad()
    def apply_update(self, counts_E: torch.Tensor) -> None:
        """`bias += rate * sign(mean(counts) - counts)`, then reset the recorded counts."""
        counts_E = counts_E.float()
        self.bias += self.update_rate * torch.sign(counts_E.mean() - counts_E)
        self.counts.zero_()


@torch.no_grad()
def update_expert_bias(modules: nn.Module | Iterable[nn.Module], dp_group: dist.ProcessGroup | None = None) -> int:
    """Update every `ExpertBias` in `modules` once per optimizer step; returns how many were updated.

    With `dp_group`, the counts of all layers are summed over that group in one all-reduce first (pass the group
    over which the router is replicated and the tokens differ, i.e. data parallel including expert-parallel
    ranks), so all replicas apply the same update.
    """
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    biases = [m for root in roots for m in root.modules() if isinstance(m, ExpertBias)]
    if not biases:
        return 0
    counts = torch.cat([b.counts for b in biases])
    if _group_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    for b, c in zip(biases, counts.split([b.counts.numel() for b in biases])):
        b.apply_update(c)
    return len(biases)


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class MoEMetrics:
    """Detached per-layer statistics of the last forward pass (tensors, so reading them is the only host sync).

    tokens_per_expert: `[E] float32` slots routed by this rank's router (before capacity dropping).
    num_dropped_tokens: slots dropped by the capacity limit and by padded-GEMM truncation on this rank.
    losses: name -> 0-d float32 value of each auxiliary loss, coefficient included.
    num_replicated_slots: slots computed on this rank with hot-expert copies (not dispatched).
    expert_recompute: what the local experts rebuild in backward (None, 'act' or 'fc1'; see moe/recompute.py).
    """

    tokens_per_expert: torch.Tensor
    num_dropped_tokens: int
    losses: dict[str, torch.Tensor]
    num_replicated_slots: int = 0  # slots computed here on hot-expert copies instead of being dispatched
    expert_recompute: str | None = None  # what the experts recompute in backward this step (None, 'act', 'fc1')

    @property
    def imbalance(self) -> float:
        """max/mean of `tokens_per_expert` (1.0 = perfectly balanced)."""
        return load_imbalance(self.tokens_per_expert)


def load_imbalance(counts_E: torch.Tensor) -> float:
    """max/mean of per-expert counts; 1.0 when balanced (and for an empty batch)."""
    mean = counts_E.float().mean()
    return 1.0 if mean <= 0 else float(counts_E.float().max() / mean)


def _group_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)
