"""Hot-expert replication: copies of the most loaded experts on every expert-parallel rank.

Early in training a few experts take most tokens. A replicated ("hot") expert's tokens are computed on the rank
that routed them, with a copy of the expert's weights, instead of crossing the expert-parallel group twice. Per
step, the copies cost one all-reduce of the hot experts' weights (only after the owners' weights changed) and one
of their gradients in backward; the tokens they keep home cost `2 * rows * hidden` elements each, so replication
pays off for an expert whose rows from other ranks outnumber about `3 * ffn_hidden / 2` per step.

Life cycle (every decision is taken from all-reduced counts, so every rank takes the same one):
- forward (`MoELayer`): routed slots per expert are counted (grad-enabled forwards outside backward only, as the
  expert bias counts); slots of hot experts are masked out of the dispatch and computed here with the copies;
  their weighted outputs are added to the combined output in FP32.
- backward: the copies' gradients are summed over the group and added to the owners' expert weights (an autograd
  function, so nothing extra is needed before the optimizer step); other ranks get no gradient from it.
- `update_hot_experts(model)` once per optimizer step (as `update_expert_bias`): an expert whose load passes
  `threshold` x the mean becomes hot (the `max_replicas` most loaded), a hot one whose load falls under `release`
  x the mean is dropped; when the set changes or an owner's weights changed (the optimizer step), the next forward
  refreshes the copies.

Legend: T tokens, K top-k slots, H hidden, F expert FFN hidden, E experts, L local experts, G hot experts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from moe.layer.balancing import _in_backward_pass, tokens_per_expert
from moe.layer.dispatcher.base import sort_slots_by_expert
from moe.layer.experts import SwiGLUExperts


class HotExpertReplicas(nn.Module):
    """The replication state of one MoE layer (see the module docstring).

    Args:
        num_experts: E. num_local_experts: L; this rank owns experts `[rank*L, (rank+1)*L)`.
        ep_group: the expert-parallel group (None: one process; replication then never activates).
        threshold: load / mean load from which an expert becomes hot (> 1).
        release: load / mean load under which a hot expert stops being hot (<= threshold).
        max_replicas: at most this many experts are hot at once.

    Buffer: `load [E] float32`, routed slots since the last `update()`. Attributes: `hot` (sorted global ids).
    A private process group (same ranks as `ep_group`) carries the copies and their gradients, so its collectives
    never interleave with the dispatcher's.
    """

    def __init__(self, num_experts: int, num_local_experts: int, ep_group: dist.ProcessGroup | None, *,
                 threshold: float, release: float, max_replicas: int) -> None:  # fmt: skip
        super().__init__()
        if not threshold > 1 or not 0 < release <= threshold or max_replicas < 1:
            raise ValueError(
                f"need threshold > 1, 0 < release <= threshold and max_replicas >= 1; got {threshold}, {release}, "
                f"{max_replicas}"
            )
        self.num_experts, self.num_local_experts = num_experts, num_local_experts
        self.threshold, self.release, self.max_replicas = threshold, release, max_replicas
        self.group = None
        self.rank = 0
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            ranks = dist.get_process_group_ranks(ep_group)
            self.group = dist.new_group(ranks, use_local_synchronization=len(ranks) != dist.get_world_size())
            self.rank = dist.get_rank(ep_group)
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.float32))
        self.hot: list[int] = []
        self._w13: torch.Tensor | None = None  # [G, H, 2F] copies (plain tensors: the gradient goes to the owners)
        self._w2: torch.Tensor | None = None  # [G, F, H]
        self._source: tuple | None = None  # this rank's expert weights (version, address) when copied

    @property
    def active(self) -> bool:
        return bool(self.hot)

    def record(self, topk_idx_TK: torch.Tensor) -> None:
        """Counts routed slots per expert in grad-enabled forwards that do not run inside backward."""
        if self.group is not None and torch.is_grad_enabled() and not _in_backward_pass():
            self.load += tokens_per_expert(topk_idx_TK.detach(), self.num_experts).to(self.load.device)

    @torch.no_grad()
    def update(self) -> list[int]:
        """Sums the recorded load over the group, chooses the hot experts, resets the load; returns `hot`."""
        if self.group is None:
            return self.hot
        load = self.load.clone()
        dist.all_reduce(load, group=self.group)
        self.load.zero_()
        mean = load.mean()
        if mean <= 0:
            return self.hot
        ratio = load / mean
        keep = {e for e in self.hot if ratio[e] >= self.release}
        candidates = keep | {int(e) for e in torch.nonzero(ratio >= self.threshold).flatten()}
        hot = sorted(sorted(candidates, key=lambda e: (-float(load[e]), e))[: self.max_replicas])
        if hot != self.hot:
            self.hot = hot
            self._w13 = self._w2 = None
            self._source = None
        return self.hot

    def hot_slots(self, topk_idx_TK: torch.Tensor) -> torch.Tensor:
        """`[T, K]` bool: the slots whose expert is hot (computed here, not dispatched)."""
        hot = torch.tensor(self.hot, dtype=topk_idx_TK.dtype, device=topk_idx_TK.device)
        return torch.isin(topk_idx_TK, hot)

    def forward(
        self,
        experts: SwiGLUExperts,
        x_TH: torch.Tensor,
        probs_TK: torch.Tensor,
        topk_idx_TK: torch.Tensor,
        hot_TK: torch.Tensor,
        recompute: str | None = None,
    ) -> torch.Tensor:
        """The hot slots' contribution: `out[t] = sum over hot slots k of probs[t, k] * expert(x[t])`, `[T, H]`
        float32, computed with the copies (refreshed first if stale: collective)."""
        w13, w2 = _CopiedWeights.apply(self, experts.w13, experts.w2)
        position = torch.full((self.num_experts,), -1, dtype=torch.long, device=topk_idx_TK.device)
        position[self.hot] = torch.arange(len(self.hot), device=topk_idx_TK.device)
        copy_TK = torch.where(hot_TK, position[topk_idx_TK.clamp(min=0)], -1)
        slots_M, copy_M = sort_slots_by_expert(copy_TK)
        token_M = slots_M // topk_idx_TK.size(1)
        counts = torch.bincount(copy_M, minlength=len(self.hot)).tolist()
        y_MH = experts.compute(x_TH.index_select(0, token_M), counts, w13, w2, recompute=recompute)
        weights_M = probs_TK.float().reshape(-1).index_select(0, slots_M)
        out = torch.zeros(x_TH.size(0), x_TH.size(1), dtype=torch.float32, device=x_TH.device)
        return out.index_add(0, token_M, y_MH.float() * weights_M.unsqueeze(1))

    def _owned(self) -> list[tuple[int, int]]:
        """`(position in hot, local expert index)` of the hot experts this rank owns."""
        first = self.rank * self.num_local_experts
        return [(j, e - first) for j, e in enumerate(self.hot) if first <= e < first + self.num_local_experts]

    @torch.no_grad()
    def refresh(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Makes the copies current if the hot set or any owner's weights changed since the last copy (one flag
        all-reduce, then, if needed, one all-reduce of the hot experts' weights)."""
        source = (w13._version, w2._version, w13.data_ptr(), w2.data_ptr())
        stale = torch.tensor([int(self._w13 is None or source != self._source)])
        dist.all_reduce(stale, op=dist.ReduceOp.MAX, group=self.group)
        if not stale.item():
            return
        H, F2 = w13.shape[1:]
        rows = torch.zeros(len(self.hot), H * F2 + w2[0].numel(), dtype=w13.dtype, device=w13.device)
        for j, local in self._owned():
            rows[j, : H * F2] = w13[local].reshape(-1)
            rows[j, H * F2 :] = w2[local].reshape(-1)
        dist.all_reduce(rows, group=self.group)  # one owner per row, zeros elsewhere: exact in any dtype
        self._w13 = rows[:, : H * F2].reshape(len(self.hot), H, F2)
        self._w2 = rows[:, H * F2 :].reshape(len(self.hot), *w2.shape[1:])
        self._source = source

    def reduce_gradients(self, grad_w13: torch.Tensor, grad_w2: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
        """Sums the copies' gradients over the group (FP32) and returns the owners' share for this rank's `w13` and
        `w2` (None where this rank owns no hot expert)."""
        G = len(self.hot)
        flat = torch.cat([grad_w13.reshape(G, -1), grad_w2.reshape(G, -1)], dim=1).float()
        dist.all_reduce(flat, group=self.group)
        owned = self._owned()
        if not owned:
            return None, None
        g13, g2 = torch.zeros_like(w13), torch.zeros_like(w2)
        split = grad_w13[0].numel()
        for j, local in owned:
            g13[local] = flat[j, :split].view_as(w13[local])
            g2[local] = flat[j, split:].view_as(w2[local])
        return g13, g2


class _CopiedWeights(torch.autograd.Function):
    """The hot experts' copies as a function of the owners' weights: forward returns the (refreshed) copies,
    backward sums their gradients over the group into the owners' weights."""

    @staticmethod
    def forward(ctx, replicas: HotExpertReplicas, w13: torch.Tensor, w2: torch.Tensor):
        replicas.refresh(w13, w2)
        ctx.replicas = replicas
        ctx.save_for_backward(w13, w2)
        return replicas._w13.view_as(replicas._w13), replicas._w2.view_as(replicas._w2)

    @staticmethod
    def backward(ctx, grad_w13: torch.Tensor, grad_w2: torch.Tensor):
        w13, w2 = ctx.saved_tensors
        g13, g2 = ctx.replicas.reduce_gradients(grad_w13, grad_w2, w13, w2)
        return None, g13, g2


@torch.no_grad()
def update_hot_experts(modules: nn.Module | Iterable[nn.Module]) -> dict[str, list[int]]:
    """`HotExpertReplicas.update()` for every MoE layer in `modules`, once per optimizer step (collective over each
    layer's expert-parallel group). Returns the hot experts per layer (module name -> ids)."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    hot = {}
    for root in roots:
        for name, module in root.named_modules():
            if isinstance(module, HotExpertReplicas):
                hot[name] = module.update()
    return hot
