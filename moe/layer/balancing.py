"""Load balancing: auxiliary losses, the aux-loss-free expert bias, and per-layer load metrics.

Legend: T tokens, B sequences, S tokens per sequence, K top-k slots, E experts.

All losses are computed in float32 (float64 for float64 inputs) and returned *without* their coefficient unless
the function says so. `attach_aux_loss` makes a loss reach the gradient without changing the forward value of the
activations.

The balancing losses follow Megatron-core's conventions, so a `moe_aux_loss_coeff` tuned there carries over:
- `f_i` counts a plain top-k of the unbiased per-expert probabilities (`aux_loss_topk`), not the selection the
  dispatcher uses: group limits and the expert bias of aux-loss-free balancing stay out of the loss, as in
  DeepSeek-V3's definition (f over TopK of the scores, eq. 18 of its report).
- With a reduction `group` whose ranks hold different tokens of one batch, `f` takes the counts summed over the
  group and `P_i` is this rank's probability sum over the group's token count: the ranks' losses add up to the
  loss of the whole batch (Megatron reduces over the tensor/context-parallel ranks for 'aux_loss' and
  'seq_aux_loss', and over every data/tensor/context-parallel rank for 'global_aux_loss').
- 'global_aux_loss' (Global Load Balancing, arXiv 2501.11873) uses the counts averaged over the micro-batches of
  the global batch so far (`GlobalAuxLossTracker`; reset it once per optimizer step).
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


def aux_loss_topk(scores_TE: torch.Tensor, topk: int) -> torch.Tensor:
    """The selection the balancing losses count: `[T, K] int64`, a plain top-k of `scores_TE` (the unbiased
    per-expert probabilities, `RouterOutput.aux_scores_TE`), with no group limit and no expert bias."""
    return scores_TE.detach().topk(topk, dim=-1).indices


def _loss_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sum_over_group(counts: torch.Tensor, num_tokens: int, group: dist.ProcessGroup | None):
    """`(counts, num_tokens)` summed over `group` in one all-reduce; `num_tokens` comes back as a 0-d tensor."""
    packed = torch.cat([counts.reshape(-1).float(), counts.new_tensor([float(num_tokens)], dtype=torch.float32)])
    if group_size(group) > 1:
        dist.all_reduce(packed, group=group)
    return packed[:-1].view_as(counts), packed[-1]


def _switch_loss(prob_sum_E, counts_E, num_tokens, topk: int, num_experts: int) -> torch.Tensor:
    """`E * sum_i f_i * P_i` with `f_i = counts_i / (K * num_tokens)` and `P_i = prob_sum_i / num_tokens`."""
    num_tokens = num_tokens.to(prob_sum_E.dtype).clamp(min=1)
    return num_experts * torch.sum(prob_sum_E * counts_E.to(prob_sum_E.dtype)) / (topk * num_tokens * num_tokens)


def switch_aux_loss(
    scores_TE: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Switch-Transformer balancing loss `E * sum_i f_i * P_i` (0-d float32).

    Args:
        scores_TE: `[T, E]` per-expert probabilities of every token (differentiable).
        topk_idx_TK: `[T, K] int64` the selection to count (`aux_loss_topk`); -1 = not counted.
        group: ranks that hold different tokens of one batch (tensor/context parallel); None = this rank only.

    `f_i` is the fraction of the `T*K` slots that went to expert `i` (no gradient), `P_i` the mean probability of
    expert `i` over the tokens. Equals 1 when routing is perfectly uniform. With `group`, `T` and the counts are
    summed over its ranks and this rank's `P_i` sums its own tokens only (see the module docstring).
    """
    T, K = topk_idx_TK.shape
    counts_E, num_tokens = _sum_over_group(tokens_per_expert(topk_idx_TK, num_experts), T, group)
    prob_sum_E = scores_TE.to(_loss_dtype(scores_TE)).sum(dim=0)
    return _switch_loss(prob_sum_E, counts_E, num_tokens, K, num_experts)


def seq_aux_loss(
    scores_BSE: torch.Tensor, topk_idx_BSK: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sequence-wise balancing loss (DeepSeek-V2/V3): the Switch loss of each sequence, averaged over sequences.

    Args:
        scores_BSE: `[B, S, E]` per-expert probabilities.
        topk_idx_BSK: `[B, S, K] int64` the selection to count (`aux_loss_topk`).
        group: ranks that hold different tokens of the same B sequences (context parallel, or tensor parallel
            with sequence parallelism); each sequence's counts and length are summed over it.
    """
    B, S, K = topk_idx_BSK.shape
    counts_BE = torch.zeros(B, num_experts, dtype=torch.float32, device=scores_BSE.device)
    flat_BN = topk_idx_BSK.reshape(B, S * K)
    valid_BN = flat_BN >= 0
    counts_BE.scatter_add_(1, flat_BN.clamp(min=0), valid_BN.float())
    counts_BE, seq_len = _sum_over_group(counts_BE, S, group)
    prob_sum_BE = scores_BSE.to(_loss_dtype(scores_BSE)).sum(dim=1)
    seq_len = seq_len.to(prob_sum_BE.dtype).clamp(min=1)
    per_seq_B = num_experts * (prob_sum_BE * counts_BE.to(prob_sum_BE.dtype)).sum(dim=1) / (K * seq_len * seq_len)
    return per_seq_B.mean()


class GlobalAuxLossTracker(nn.Module):
    """Routed-slot counts of the current global batch, for 'global_aux_loss' (one per MoE layer).

    Buffers (float32, not saved in the state dict): `tokens_per_expert [E]`, the counts (already summed over the
    reduction group) of the micro-batches since the last `reset`, and `steps`, their number. Call `reset` (or
    `reset_global_aux_loss_tracker(model)`) once per optimizer step, after the backward of the global batch's last
    micro-batch and before the next global batch's first forward (Megatron resets in `finalize_model_grads`).
    """

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.float32), persistent=False)

    def accumulate(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Adds one micro-batch's counts and returns the mean counts per micro-batch so far `[E] float32`.

        A forward that activation recompute runs inside backward adds nothing (the micro-batch was counted by its
        first forward) and sees the same mean as that forward did, as long as no other micro-batch ran between.
        """
        if not _in_backward_pass():
            self.tokens_per_expert += counts_E.detach().float()
            self.steps += 1
        # No host sync: with nothing recorded (a recompute after a reset) fall back to this micro-batch's counts.
        mean_E = self.tokens_per_expert / self.steps.clamp(min=1)
        return torch.where(self.steps > 0, mean_E, counts_E.detach().float())

    @torch.no_grad()
    def reset(self) -> None:
        self.tokens_per_expert.zero_()
        self.steps.zero_()


def global_aux_loss(
    scores_TE: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    tracker: GlobalAuxLossTracker | None = None,
) -> torch.Tensor:
    """Global-batch balancing loss: the Switch loss with `f` from the counts of every rank of `group`.

    Args:
        scores_TE: `[T, E]` per-expert probabilities of this rank's tokens (differentiable).
        topk_idx_TK: `[T, K] int64` the selection to count (`aux_loss_topk`).
        group: every rank whose router sees different tokens of the global batch (data, tensor and context
            parallel; Megatron's tp_dp_cp group). None = this rank only.
        tracker: averages the counts over the micro-batches of the global batch (the counts of this micro-batch
            are added to it); None = this micro-batch's counts.

    `P_i` is this rank's probability sum over the group's token count of this micro-batch, so with N ranks of
    equal token counts the value is `1/N` of a Switch loss computed with this rank's mean probabilities (the
    ranks' losses add up to the loss of the whole micro-batch).
    """
    T, K = topk_idx_TK.shape
    counts_E, num_tokens = _sum_over_group(tokens_per_expert(topk_idx_TK, num_experts), T, group)
    if tracker is not None:
        counts_E = tracker.accumulate(counts_E)
    prob_sum_E = scores_TE.to(_loss_dtype(scores_TE)).sum(dim=0)
    return _switch_loss(prob_sum_E, counts_E, num_tokens, K, num_experts)


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss `mean_t(logsumexp_i(logits[t, i])^2)` (ST-MoE), float32 (float64 for float64 logits),
    without its coefficient."""
    return torch.logsumexp(logits_TE.to(_loss_dtype(logits_TE)), dim=-1).square().mean()


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
    if group_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    for b, c in zip(biases, counts.split([b.counts.numel() for b in biases])):
        b.apply_update(c)
    return len(biases)


def reset_global_aux_loss_tracker(modules: nn.Module | Iterable[nn.Module]) -> int:
    """Reset every `GlobalAuxLossTracker` in `modules` (start of a new global batch); returns how many.

    Call it once per optimizer step, after the backward of the global batch's last micro-batch (e.g. next to
    `update_expert_bias` and `optimizer.step()`), so that 'global_aux_loss' averages the counts of one global
    batch at a time, as Megatron does.
    """
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    trackers = [m for root in roots for m in root.modules() if isinstance(m, GlobalAuxLossTracker)]
    for tracker in trackers:
        tracker.reset()
    return len(trackers)


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class MoEMetrics:
    """Detached per-layer statistics of the last forward pass (tensors, so reading them is the only host sync).

    tokens_per_expert: `[E] float32` slots routed by this rank's router (before capacity dropping).
    num_dropped_tokens: slots dropped by the capacity limit and by padded-GEMM truncation on this rank.
    losses: name -> 0-d float32 value of each auxiliary loss, coefficient included (empty outside training).
    num_replicated_slots: slots computed on this rank with hot-expert copies (not dispatched).
    expert_recompute: what the local experts rebuild in backward (None, 'act' or 'fc1'; see moe/layer/moe_recompute.py).
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


def load_spread(counts_E: torch.Tensor) -> dict[str, float]:
    """How evenly a layer's tokens spread over its experts, from its per-expert counts `[E]`: `max_over_mean` (1.0 =
    balanced; `load_imbalance`), `min_over_mean` (0.0: an idle expert) and `cv`, the coefficient of variation
    (population standard deviation over the mean; 0.0 = balanced). An empty batch reads as balanced."""
    counts = counts_E.double()
    mean = counts.mean()
    if mean <= 0:
        return {"max_over_mean": 1.0, "min_over_mean": 1.0, "cv": 0.0}
    return {
        "max_over_mean": float(counts.max() / mean),
        "min_over_mean": float(counts.min() / mean),
        "cv": float(counts.std(correction=0) / mean),
    }


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks of `group`; 1 for None or without an initialised process group."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)
