"""The MoE layer: router -> capacity -> dispatch -> experts -> combine (+ shared expert), with balancing losses.

Legend: B sequences, S tokens per sequence, T = B*S tokens on this rank, H hidden, K top-k slots, E experts,
L local experts, N rows received by this rank's experts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from moe.layer import balancing, wgrad
from moe.layer.balancing import AuxLossScale, GlobalAuxLossTracker, MoEMetrics, attach_aux_loss
from moe.layer.capacity import apply_capacity, expert_capacity, pad_rows, plan_padding, unpad_rows
from moe.layer.dispatcher import DispatchResult, EPBuffers, TokenDispatcher, build_dispatcher
from moe.layer.dispatcher.comm import group_rank, group_size
from moe.layer.dispatcher.etp import ExpertTensorParallelDispatcher
from moe.layer.experts import SwiGLUExperts, SwiGLUMLP
from moe.layer.fp8 import Fp8SwiGLUExperts, fp8_switches
from moe.layer.moe_config import MoEConfig
from moe.layer.moe_recompute import checkpointed
from moe.layer.parallel.sharding import TPShard, tag_sharded
from moe.layer.phase_timer import PhaseTimer, mark_backward, phase
from moe.layer.replication import HotExpertReplicas
from moe.layer.router import RouterOutput, TopKRouter
from moe.layer.trace_regions import COMBINE, DISPATCH, EXPERT_GEMM, ROUTER, SHARED_EXPERTS, region
from mtdeepep.in_flight import in_flight


class MoELayer(nn.Module):
    """Mixture-of-Experts feed-forward layer with expert parallelism over `ep_group`, and optionally expert tensor
    parallelism over `etp_group`.

    With R ranks in `ep_group` (and no ETP), this rank holds the experts `[rank*L, (rank+1)*L)`, L = E / R; the
    router and the shared expert are replicated (their gradients must be summed over the ranks that see different
    tokens, as for any data-parallel parameter). `ep_group=None` runs everything in this process.

    With `etp_group` of P > 1 ranks, `ep_group` is the folded EP x ETP group (ETP fastest: `etp_group` is P
    consecutive ranks of it): R / P EP ranks, rank `i*P + j` holding shard j of the experts `[i*L, (i+1)*L)`,
    L = E * P / R: the gate and up projections' j-th FFN columns, the down projection's j-th rows
    (`w13 [L, H, 2F/P]` = `[gate_j | up_j]`, `w2 [L, F/P, H]`, tagged with their `TPShard` for the checkpoints).
    Tokens go to every shard of their experts and the combine sums the partial outputs
    (`moe/layer/dispatcher/etp.py`).

    Args:
        config: the layer's settings.
        ep_group: the process group the tokens are dispatched over: expert parallel, or with `etp_group` the
            folded EP x ETP group (None = single process).
        etp_group: expert tensor-parallel group, P consecutive ranks of `ep_group` (None or one rank: whole
            experts).
        aux_loss_scale: shared `AuxLossScale` (see `balancing.attach_aux_loss`); a private one if None.
        aux_loss_group: group over which 'global_aux_loss' sums the routed counts: every rank whose router sees
            different tokens of the global batch (data, tensor and context parallel; Megatron's tp_dp_cp group).
            None = this rank only.
        tp_cp_group: the ranks that split the tokens of the same sequences (tensor parallel with sequence
            parallelism, and context parallel; Megatron's tp_cp group). 'aux_loss' and 'seq_aux_loss' sum their
            counts over it, and the z-loss coefficient is divided by its size, so the ranks' losses add up to the
            loss of the whole batch as in Megatron. None = this rank only.
        dtype: dtype of the expert and shared-expert weights (the router weight is always float32).
        ep_buffers: the `EPBuffers` (owned by the model or trainer) whose mtdeepep buffers the 'flex' / 'flex_ll'
            dispatchers of its layers share; None: the group's default, shared by every layer given none.
        dispatcher: a ready `TokenDispatcher` over `ep_group` (e.g. a `FlexDispatcher` on a given
            `mtdeepep.Buffer`); it replaces the one `config.moe_token_dispatcher_type` would build.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        ep_group: dist.ProcessGroup | None = None,
        aux_loss_scale: AuxLossScale | None = None,
        aux_loss_group: dist.ProcessGroup | None = None,
        tp_cp_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        ep_buffers: EPBuffers | None = None,
        dispatcher: TokenDispatcher | None = None,
        etp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.etp_size = etp = group_size(etp_group)
        if etp > 1:
            _check_expert_tensor_parallel(config, etp, ep_group)
        self.aux_loss_group = aux_loss_group
        self.tp_cp_group = tp_cp_group
        # Counts of 'global_aux_loss' over the micro-batches of the global batch (reset per optimizer step).
        self.global_aux_loss_tracker = (
            GlobalAuxLossTracker(config.num_moe_experts).to(device)
            if "global_aux_loss" in config.aux_loss_coeffs
            else None
        )
        self.aux_loss_scale = aux_loss_scale if aux_loss_scale is not None else AuxLossScale()
        self.router = TopKRouter(config).to(device)
        if dispatcher is None and etp > 1:
            # The inner dispatcher routes over the folded group's virtual experts (E * etp of them).
            inner = build_dispatcher(
                dataclasses.replace(config, num_moe_experts=config.num_moe_experts * etp), ep_group, ep_buffers
            )
            dispatcher = ExpertTensorParallelDispatcher(inner, num_experts=config.num_moe_experts, etp=etp)
            if dispatcher.etp_rank != group_rank(etp_group):
                raise ValueError(
                    f"etp_group must be consecutive ranks of ep_group (ETP fastest): rank {group_rank(ep_group)} of "
                    f"ep_group is rank {group_rank(etp_group)} of etp_group, expected {dispatcher.etp_rank}"
                )
        elif dispatcher is None:
            dispatcher = build_dispatcher(config, ep_group, ep_buffers)
        elif getattr(dispatcher, "etp_size", 1) != etp:
            raise ValueError(f"the ready dispatcher splits experts over {getattr(dispatcher, 'etp_size', 1)} ranks, "
                             f"etp_group over {etp}")  # fmt: skip
        elif ep_buffers is not None:
            raise ValueError("give MoELayer ep_buffers or a ready dispatcher, not both (the dispatcher has its buffer)")
        elif dispatcher.num_experts != config.num_moe_experts or (
            ep_group is not None and dispatcher.ep_group is not ep_group
        ):
            raise ValueError("the dispatcher must serve config.num_moe_experts experts over ep_group")
        self.dispatcher = dispatcher
        self.ep_size = self.dispatcher.ep_size  # ranks the experts are divided over (without their ETP shards)
        self.etp_rank = getattr(self.dispatcher, "etp_rank", 0)
        self.dispatch_group_size = group_size(self.dispatcher.ep_group)  # ep * etp: the ranks tokens travel between
        self.num_local_experts = self.dispatcher.num_local_experts
        self.local_expert_start = self.dispatcher.local_expert_start
        if config.moe_padded_batch_gemm:
            impl = "padded"
        else:
            impl = "grouped" if config.moe_grouped_gemm else "loop"
        experts_args = (self.num_local_experts, config.hidden_size, config.moe_ffn_hidden_size // etp)
        experts_kwargs = dict(
            impl=impl,
            padded_factor=config.moe_padded_batch_gemm_factor,
            padded_alignment=config.moe_padded_batch_gemm_alignment,
            init_std=config.init_method_std,
            dtype=dtype,
            device=device,
        )
        fp8_recipe = fp8_switches(config).experts
        if fp8_recipe is None:
            self.experts = SwiGLUExperts(*experts_args, **experts_kwargs)
        else:
            self.experts = Fp8SwiGLUExperts(*experts_args, recipe=fp8_recipe, **experts_kwargs)
        if etp > 1:  # [gate_j | up_j] columns of w13, rows j of w2 (the dense SwiGLU's TP geometry, per expert)
            tag_sharded(self.experts.w13, TPShard(dim=2, chunks=2, rank=self.etp_rank, size=etp))
            tag_sharded(self.experts.w2, TPShard(dim=1, chunks=1, rank=self.etp_rank, size=etp))
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SwiGLUMLP(
                config.hidden_size,
                config.moe_shared_expert_intermediate_size,
                init_std=config.init_method_std,
                dtype=dtype,
                device=device,
            )
        self.replicas = None
        if config.moe_hot_expert_replication:
            self.replicas = HotExpertReplicas(
                config.num_moe_experts, self.num_local_experts, self.dispatcher.ep_group,
                threshold=config.moe_hot_expert_threshold, release=config.moe_hot_expert_release,
                max_replicas=config.moe_hot_expert_max_replicas,
            )  # fmt: skip
        self.recompute_level = "full" if config.moe_layer_recompute else config.moe_recompute_level
        self.metrics: MoEMetrics | None = None
        self.phase_timer: PhaseTimer | None = None

    def set_phase_timer(self, timer: PhaseTimer | None) -> None:
        """Time this layer's dispatch and combine (forward and backward) on `timer` (see moe/layer/phase_timer.py); the
        dispatcher gets it too, for the communication inside its backward. None stops timing."""
        self.phase_timer = timer
        self.dispatcher.phase_timer = timer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Args:
            hidden: `[B, S, H]` (sequences, for 'seq_aux_loss') or `[T, H]` (one sequence).
        Returns the same shape and dtype. In training mode with autograd recording, the auxiliary losses are
        attached to the output (see `attach_aux_loss`); their values, with load statistics, are stored in
        `self.metrics`. With recompute level 'full' the whole layer runs under `torch.utils.checkpoint` (its
        backward runs the forward again, communication included).
        """
        return checkpointed(self.recompute_level == "full", self._forward, hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        x_TH = hidden.reshape(-1, cfg.hidden_size)
        num_tokens = x_TH.size(0)
        light = self.recompute_level in ("light", "medium")

        # Step 1: route (float32), then enforce the capacity limit.
        with region(ROUTER):
            route = checkpointed(light, self.router, x_TH)
        probs_TK, topk_idx_TK, num_dropped = route.probs_TK, route.topk_idx_TK, 0
        capacity = None
        if cfg.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(
                num_tokens, cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_expert_capacity_factor
            )
            kept = apply_capacity(probs_TK, topk_idx_TK, cfg.num_moe_experts, capacity, cfg.moe_token_drop_policy)
            probs_TK, topk_idx_TK, num_dropped = kept.probs_TK, kept.topk_idx_TK, kept.num_dropped

        # Step 2: dispatch, except the slots of hot experts (computed here with copies); the shared expert runs
        # while the tokens are in flight (if the dispatcher allows it), and so does another micro-batch when an
        # overlapped pipeline chunk interleaves two (`in_flight`: mtdeepep/in_flight.py, moe/layer/interleave.py).
        hot_TK = None
        if self.replicas is not None:
            self.replicas.record(topk_idx_TK)
            if self.replicas.active:
                hot_TK = self.replicas.hot_slots(topk_idx_TK)
        dispatch_idx_TK = topk_idx_TK if hot_TK is None else topk_idx_TK.masked_fill(hot_TK, -1)
        wgrad_store = self._wgrad_store()
        x_dispatch_TH = x_TH if wgrad_store is None else wgrad_store.anchor(x_TH)
        timer = self.phase_timer  # the overlapped shared expert is compute: timed outside the dispatch
        with phase(timer, "dispatch"), region(DISPATCH):
            pending = self.dispatcher.dispatch_begin(x_dispatch_TH, probs_TK, dispatch_idx_TK)
        shared_TH = None
        if self.shared_experts is not None and cfg.moe_shared_expert_overlap and self.dispatcher.supports_async:
            shared_TH = self._shared(x_TH)
        communicates = self.dispatch_group_size > 1
        overlapped = self.dispatcher.supports_async and communicates
        with phase(timer, "dispatch"), region(DISPATCH), in_flight("dispatch", overlapped):
            dispatched = self.dispatcher.dispatch_end(pending)

        # Step 3: local experts (recomputing their activations in backward if the level or the row count says so;
        # their weight gradients queued in the store, to run during the dispatch's backward), then combine (weights
        # applied in float32); the hot slots run on the copies while the combine is in flight.
        num_replicated = 0 if hot_TK is None else int(hot_TK.sum())
        expert_recompute = self._expert_recompute(sum(dispatched.tokens_per_expert) + num_replicated)
        with wgrad.deferring(wgrad_store), region(EXPERT_GEMM):
            expert_out_NH = self._run_experts(dispatched, capacity, num_tokens, expert_recompute)
        num_dropped += self.experts.last_num_dropped
        # The combine's backward (a dispatch of the gradients) is bracketed by two marks (moe/layer/phase_timer.py).
        marked = timer is not None and torch.is_grad_enabled() and expert_out_NH.requires_grad
        if marked:
            expert_out_NH = mark_backward(expert_out_NH, timer, "combine", enter=False)
        with phase(timer, "combine"), region(COMBINE):
            combining = self.dispatcher.combine_begin(expert_out_NH, dispatched.handle)
        hot_out_TH = None
        if hot_TK is not None:
            hot_out_TH = self.replicas(self.experts, x_TH, probs_TK, topk_idx_TK, hot_TK, expert_recompute)
        overlapped = self.dispatcher.supports_async_combine and communicates
        with phase(timer, "combine"), region(COMBINE), in_flight("combine", overlapped):
            out_TH = self.dispatcher.combine_end(combining)
        if marked:
            out_TH = mark_backward(out_TH, timer, "combine", enter=True)
        if hot_out_TH is not None:
            out_TH = (out_TH.float() + hot_out_TH).to(out_TH.dtype)
        if self.shared_experts is not None:
            if shared_TH is None:
                shared_TH = self._shared(x_TH)
            out_TH = out_TH + shared_TH.to(out_TH.dtype)

        # Step 4: balancing losses reach the gradient through the output.
        losses = self._aux_losses(route, hidden)
        if losses:
            out_TH = attach_aux_loss(out_TH, sum(losses.values()), self.aux_loss_scale)
        self.metrics = MoEMetrics(
            tokens_per_expert=balancing.tokens_per_expert(route.topk_idx_TK, cfg.num_moe_experts),
            num_dropped_tokens=num_dropped,
            losses={name: loss.detach() for name, loss in losses.items()},
            num_replicated_slots=num_replicated,
            expert_recompute=expert_recompute,
        )
        return out_TH.view(hidden.shape)

    def _wgrad_store(self) -> wgrad.WeightGradStore | None:
        """A fresh store for this call's delayed expert weight gradients (config
        `overlap_dispatch_backward_with_experts_wgrad`), or None (off, no autograd recording, frozen experts). One per
        call: micro-batches in flight never share one."""
        params = (self.experts.w13, self.experts.w2)
        if not (self.config.overlap_dispatch_backward_with_experts_wgrad and torch.is_grad_enabled()):
            return None
        if not any(p.requires_grad for p in params):
            return None
        return wgrad.WeightGradStore(params, self.phase_timer)

    def _expert_recompute(self, num_rows: int) -> str | None:
        """What the experts rebuild in backward: 'fc1' at level 'medium' or when this rank computes more than
        `moe_adaptive_recompute_tokens` rows, 'act' at level 'light', else nothing."""
        threshold = self.config.moe_adaptive_recompute_tokens
        if self.recompute_level == "medium" or (threshold is not None and num_rows > threshold):
            return "fc1"
        return "act" if self.recompute_level == "light" else None

    def _shared(self, x_TH: torch.Tensor) -> torch.Tensor:
        with region(SHARED_EXPERTS):
            return checkpointed(self.recompute_level == "medium", self.shared_experts, x_TH)

    def _run_experts(
        self, dispatched: DispatchResult, capacity: int | None, num_tokens: int, recompute: str | None
    ) -> torch.Tensor:
        counts = dispatched.tokens_per_expert
        if not self.config.moe_pad_expert_input_to_capacity:
            return self.experts(dispatched.expert_input_NH, counts, recompute=recompute)
        # Every local expert gets exactly min(capacity, tokens) rows from each source rank (zero rows as padding):
        # an expert never keeps more than the tokens a rank has, so padding beyond them would only add zero rows
        # (Megatron pads its routing map to the same count).
        length = min(capacity, num_tokens) * self.dispatch_group_size
        if max(counts, default=0) > length:
            raise RuntimeError(
                f"an expert received {max(counts)} rows > min(capacity, tokens) * source ranks = {length}; padding to "
                "capacity needs the same number of tokens on every expert-parallel rank"
            )
        plan = plan_padding(counts, length, device=dispatched.expert_input_NH.device)
        y_padded = self.experts(pad_rows(dispatched.expert_input_NH, plan), [length] * len(counts), recompute=recompute)
        return unpad_rows(y_padded, plan)

    def _aux_losses(self, route: RouterOutput, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """The enabled balancing losses and the z-loss, coefficients applied; none outside training or without
        autograd (evaluation, the no-grad first pass of a reentrant checkpoint), as in Megatron."""
        cfg = self.config
        if not (self.training and torch.is_grad_enabled()):
            return {}
        E, K = cfg.num_moe_experts, cfg.moe_router_topk
        losses: dict[str, torch.Tensor] = {}
        coeffs = cfg.aux_loss_coeffs
        if coeffs:
            scores_TE = route.aux_scores_TE
            aux_idx_TK = balancing.aux_loss_topk(scores_TE, K)
        for kind, coeff in coeffs.items():
            if kind == "aux_loss":
                loss = balancing.switch_aux_loss(scores_TE, aux_idx_TK, E, self.tp_cp_group)
            elif kind == "seq_aux_loss":
                B = hidden.size(0) if hidden.dim() == 3 else 1
                loss = balancing.seq_aux_loss(scores_TE.view(B, -1, E), aux_idx_TK.view(B, -1, K), E, self.tp_cp_group)
            else:
                loss = balancing.global_aux_loss(
                    scores_TE, aux_idx_TK, E, self.aux_loss_group, self.global_aux_loss_tracker
                )
            losses[kind] = coeff * loss
        if cfg.moe_z_loss_coeff:
            # Every tensor/context-parallel rank adds the z-loss of its own tokens: Megatron divides the coefficient
            # by their number so that the sum is the mean over the whole batch.
            tp_cp_size = balancing.group_size(self.tp_cp_group)
            losses["z_loss"] = cfg.moe_z_loss_coeff / tp_cp_size * balancing.z_loss(route.logits_TE)
        return losses


def _check_expert_tensor_parallel(config: MoEConfig, etp: int, ep_group: dist.ProcessGroup | None) -> None:
    """What splitting every expert over `etp` ranks asks of the layer (ValueError naming each broken rule)."""
    broken = []
    if config.moe_ffn_hidden_size % etp:
        broken.append(f"moe_ffn_hidden_size={config.moe_ffn_hidden_size} is not divisible by etp {etp}")
    if group_size(ep_group) % etp:
        broken.append(f"the dispatch group ({group_size(ep_group)} ranks) does not fold into ep x etp {etp}")
    if config.moe_hot_expert_replication:
        broken.append("moe_hot_expert_replication copies whole experts (not their ETP shards)")
    if broken:
        raise ValueError(f"expert tensor parallelism over {etp} ranks: " + "; ".join(broken))
