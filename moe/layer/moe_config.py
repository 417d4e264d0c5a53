"""Configuration of one MoE layer.

Field names follow Megatron-core's `TransformerConfig` where the concept is the same, so users can carry their
settings over. Fields without a Megatron counterpart are marked "(ours)".
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.layer.fp8.recipe import FP8_FORMATS

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
ROUTER_DTYPES = (None, "fp32", "fp64")
TOKEN_DROP_POLICIES = ("probs", "position")
RECOMPUTE_LEVELS = (None, "light", "medium", "full")


@dataclass(kw_only=True)
class MoEConfig:
    """Settings of one MoE layer (router, balancing, capacity, dispatcher, experts).

    Required: `hidden_size`, `num_moe_experts`, `moe_ffn_hidden_size`. Everything else has a default that gives
    a dropless top-2 softmax MoE on the mtdeepep (`flex`) dispatcher and no auxiliary loss.
    """

    hidden_size: int
    num_moe_experts: int
    moe_ffn_hidden_size: int

    # Router.
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_group_score_topk: int | None = None  # (ours) a group's score is the sum of its top-n expert scores;
    # None = Megatron's n = moe_router_topk // moe_router_group_topk; transformers' DeepSeek-V3 router uses n = 2
    moe_router_norm_topk_prob: bool | None = None  # (ours) sigmoid routing: divide the k chosen scores by their sum;
    # None = when moe_router_topk > 1 (Megatron), True = always, False = never (transformers' norm_topk_prob)
    moe_router_dtype: str | None = None  # 'fp32' or 'fp64': gate GEMM and scores in that dtype; None = float32
    # (Megatron's None routes in the input dtype; this router never routes in bf16, see moe/layer/router.py)
    moe_input_jitter_eps: float | None = None  # training only: router input *= U(1 - eps, 1 + eps)
    init_method_std: float = 0.02

    # Load balancing. Several auxiliary losses at once: a list of types and a list of as many coefficients.
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    moe_aux_loss_coeff: float | list[float] = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3

    # Capacity (None = dropless).
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"

    # Dispatcher and experts.
    moe_token_dispatcher_type: str = "flex"  # mtdeepep normal mode (Megatron defaults to allgather); any name
    # registered with moe.layer.dispatcher.register_dispatcher ('alltoall', 'allgather', 'flex', 'flex_ll' built in),
    # checked where the dispatcher is built (`build_dispatcher`, i.e. `MoELayer`), before any communication
    moe_grouped_gemm: bool = True
    moe_padded_batch_gemm: bool = False  # (ours) one torch.bmm over experts padded/truncated to one length
    moe_padded_batch_gemm_factor: float | None = None  # (ours) length = mean rows per expert * factor; None = max
    moe_padded_batch_gemm_alignment: int = 16  # (ours) the padded length is a multiple of this
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    overlap_dispatch_backward_with_experts_wgrad: bool = True  # the experts' weight-gradient GEMMs run while the
    # dispatch's backward all-to-all is in flight (moe/layer/wgrad.py). Megatron's name (off there by default); on here:
    # gradients are bitwise those without it
    moe_flex_ll_num_max_dispatch_tokens_per_rank: int = 128  # (ours) 'flex_ll': the most tokens a rank may send
    moe_flex_ll_use_fp8: bool = False  # (ours) 'flex_ll': FP8 dispatch payloads (hidden_size a multiple of 128)
    moe_flex_use_fp8: bool = False  # (ours) 'flex': dispatch E4M3 tokens with 1x128 scales, combine in high
    # precision (DeepSeek-V3; hidden_size a multiple of 128)
    fp8: str | None = None  # None or 'e4m3' (DeepSeek-V3 block-wise recipe for the expert GEMMs). The FP8 switches
    # (this one for the expert GEMMs, moe_flex_use_fp8 / moe_flex_ll_use_fp8 for the dispatch wire format) are read
    # through moe.layer.fp8.fp8_switches

    # Recompute (see moe/layer/moe_recompute.py).
    moe_layer_recompute: bool = False  # checkpoint the whole MoE layer (the same as moe_recompute_level='full')
    moe_recompute_level: str | None = None  # (ours) None, 'light', 'medium' or 'full'
    moe_adaptive_recompute_tokens: int | None = None  # (ours) rows this rank's experts compute above which it
    # recomputes their activations (FC1 and SwiGLU) in backward; None = off

    # Hot-expert replication (ours; see moe/layer/replication.py).
    moe_hot_expert_replication: bool = False
    moe_hot_expert_threshold: float = 2.0  # load / mean load from which an expert is replicated
    moe_hot_expert_release: float = 1.5  # load / mean load under which a replicated expert stops being so
    moe_hot_expert_max_replicas: int = 2  # experts replicated at once

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk"):
            _require_positive_int(name, getattr(self, name))
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} exceeds num_moe_experts={self.num_moe_experts}")
        self._validate_router()
        self._validate_balancing()
        self._validate_capacity()
        self._validate_experts()
        self._validate_recompute_and_replication()

    @property
    def aux_loss_coeffs(self) -> dict[str, float]:
        """The enabled auxiliary balancing losses: type -> coefficient (> 0), in the configured order."""
        kinds, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if isinstance(kinds, str):
            kinds, coeffs = [kinds], [coeffs]
        return {k: float(c) for k, c in zip(kinds, coeffs) if k in AUX_LOSS_TYPES and c > 0}

    def _validate_router(self) -> None:
        _require_choice("moe_router_score_function", self.moe_router_score_function, SCORE_FUNCTIONS)
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ValueError("moe_router_pre_softmax=True requires moe_router_score_function='softmax'")
        softmax_after_topk = self.moe_router_score_function == "softmax" and not self.moe_router_pre_softmax
        if self.moe_router_topk == 1 and softmax_after_topk:
            # The softmax over the one chosen logit is the constant 1: the main loss would never reach the router.
            raise ValueError(
                "moe_router_topk=1 with the softmax score function needs moe_router_pre_softmax=True (a softmax "
                "over the single chosen logit is always 1, so the router would get no gradient from the main loss)"
            )
        _require_choice("moe_router_dtype", self.moe_router_dtype, ROUTER_DTYPES)
        eps = self.moe_input_jitter_eps
        if eps is not None and not 0 < eps < 1:
            raise ValueError(f"moe_input_jitter_eps must be in (0, 1) or None, got {eps}")
        if self.moe_router_topk_scaling_factor is not None and not self.moe_router_topk_scaling_factor > 0:
            raise ValueError(f"moe_router_topk_scaling_factor must be > 0, got {self.moe_router_topk_scaling_factor}")
        if not self.init_method_std > 0:
            raise ValueError(f"init_method_std must be > 0, got {self.init_method_std}")
        if self.moe_router_norm_topk_prob is not None:
            if not isinstance(self.moe_router_norm_topk_prob, bool):
                raise ValueError(
                    f"moe_router_norm_topk_prob must be None or a bool, got {self.moe_router_norm_topk_prob!r}"
                )
            if self.moe_router_score_function != "sigmoid":
                raise ValueError(
                    "moe_router_norm_topk_prob applies to the sigmoid score function (softmax weights are normalised "
                    "by the softmax itself)"
                )
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("moe_router_num_groups and moe_router_group_topk must be set together")
        score_topk = self.moe_router_group_score_topk
        if score_topk is not None and groups is None:
            raise ValueError("moe_router_group_score_topk needs moe_router_num_groups and moe_router_group_topk")
        if groups is None:
            return
        _require_positive_int("moe_router_num_groups", groups)
        _require_positive_int("moe_router_group_topk", group_topk)
        if self.num_moe_experts % groups:
            raise ValueError(
                f"num_moe_experts={self.num_moe_experts} is not divisible by moe_router_num_groups={groups}"
            )
        if group_topk > groups:
            raise ValueError(f"moe_router_group_topk={group_topk} exceeds moe_router_num_groups={groups}")
        experts_per_group = self.num_moe_experts // groups
        if score_topk is not None:
            _require_positive_int("moe_router_group_score_topk", score_topk)
            if score_topk > experts_per_group:
                raise ValueError(
                    f"moe_router_group_score_topk={score_topk} exceeds the {experts_per_group} experts of a group"
                )
        elif self.moe_router_topk < group_topk:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} must be >= moe_router_group_topk={group_topk} "
                "(a group's score is the sum of its top (topk // group_topk) experts)"
            )
        elif self.moe_router_topk // group_topk > experts_per_group:
            raise ValueError(
                f"topk // group_topk = {self.moe_router_topk // group_topk} exceeds the {experts_per_group} experts "
                "of a group"
            )
        if self.moe_router_topk > group_topk * experts_per_group:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} exceeds the {group_topk * experts_per_group} experts left "
                "after group-limited routing"
            )

    def _validate_balancing(self) -> None:
        kinds, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if isinstance(kinds, (list, tuple)):
            if not isinstance(coeffs, (list, tuple)) or len(coeffs) != len(kinds):
                raise ValueError(
                    "a list moe_router_load_balancing_type needs moe_aux_loss_coeff as a list of the same length, "
                    f"got {kinds!r} and {coeffs!r}"
                )
            if len(set(kinds)) != len(kinds):
                raise ValueError(f"moe_router_load_balancing_type lists a type twice: {kinds!r}")
        elif isinstance(coeffs, (list, tuple)):
            raise ValueError("a list moe_aux_loss_coeff needs moe_router_load_balancing_type as a list of types")
        else:
            kinds, coeffs = [kinds], [coeffs]
        for kind, coeff in zip(kinds, coeffs):
            _require_choice("moe_router_load_balancing_type", kind, LOAD_BALANCING_TYPES)
            if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not coeff >= 0:
                raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {coeff!r} (for {kind!r})")
            if kind == "none" and coeff > 0:
                raise ValueError("moe_aux_loss_coeff > 0 needs moe_router_load_balancing_type other than 'none'")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            raise ValueError(f"moe_z_loss_coeff must be >= 0, got {self.moe_z_loss_coeff}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError(
                "moe_router_enable_expert_bias (aux-loss-free balancing) requires the sigmoid score function"
            )
        if not self.moe_router_bias_update_rate >= 0:
            raise ValueError(f"moe_router_bias_update_rate must be >= 0, got {self.moe_router_bias_update_rate}")

    def _validate_capacity(self) -> None:
        _require_choice("moe_token_drop_policy", self.moe_token_drop_policy, TOKEN_DROP_POLICIES)
        factor = self.moe_expert_capacity_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"moe_expert_capacity_factor must be > 0 or None (dropless), got {factor}")
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity requires moe_expert_capacity_factor")

    def _validate_experts(self) -> None:
        if self.moe_padded_batch_gemm_factor is not None and not self.moe_padded_batch_gemm_factor > 0:
            raise ValueError(f"moe_padded_batch_gemm_factor must be > 0, got {self.moe_padded_batch_gemm_factor}")
        if self.moe_padded_batch_gemm_factor is not None and not self.moe_padded_batch_gemm:
            raise ValueError("moe_padded_batch_gemm_factor requires moe_padded_batch_gemm=True")
        _require_positive_int("moe_padded_batch_gemm_alignment", self.moe_padded_batch_gemm_alignment)
        if self.moe_shared_expert_intermediate_size is not None:
            _require_positive_int("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
        if self.moe_shared_expert_overlap and self.moe_shared_expert_intermediate_size is None:
            raise ValueError("moe_shared_expert_overlap requires moe_shared_expert_intermediate_size")
        _require_positive_int(
            "moe_flex_ll_num_max_dispatch_tokens_per_rank", self.moe_flex_ll_num_max_dispatch_tokens_per_rank
        )
        if self.moe_flex_ll_use_fp8 and self.hidden_size % 128:
            raise ValueError(f"moe_flex_ll_use_fp8 needs hidden_size a multiple of 128, got {self.hidden_size}")
        if self.moe_flex_use_fp8 and self.hidden_size % 128:
            raise ValueError(f"moe_flex_use_fp8 needs hidden_size a multiple of 128, got {self.hidden_size}")
        if self.moe_flex_use_fp8 and self.moe_token_dispatcher_type != "flex":
            raise ValueError(
                f"moe_flex_use_fp8 applies to the 'flex' dispatcher, got {self.moe_token_dispatcher_type!r} "
                "('flex_ll' has moe_flex_ll_use_fp8)"
            )
        _require_choice("fp8", self.fp8, FP8_FORMATS)
        if self.fp8 is not None and self.moe_padded_batch_gemm:
            raise ValueError("fp8 experts use grouped GEMMs; moe_padded_batch_gemm is not supported with fp8")

    def _validate_recompute_and_replication(self) -> None:
        _require_choice("moe_recompute_level", self.moe_recompute_level, RECOMPUTE_LEVELS)
        if self.moe_layer_recompute and self.moe_recompute_level not in (None, "full"):
            raise ValueError(
                f"moe_layer_recompute=True recomputes the whole layer; it contradicts "
                f"moe_recompute_level={self.moe_recompute_level!r}"
            )
        if self.moe_adaptive_recompute_tokens is not None:
            _require_positive_int("moe_adaptive_recompute_tokens", self.moe_adaptive_recompute_tokens)
        if not self.moe_hot_expert_replication:
            return
        if not self.moe_hot_expert_threshold > 1:
            raise ValueError(f"moe_hot_expert_threshold must be > 1, got {self.moe_hot_expert_threshold}")
        if not 0 < self.moe_hot_expert_release <= self.moe_hot_expert_threshold:
            raise ValueError(
                f"moe_hot_expert_release must be in (0, moe_hot_expert_threshold={self.moe_hot_expert_threshold}], "
                f"got {self.moe_hot_expert_release}"
            )
        _require_positive_int("moe_hot_expert_max_replicas", self.moe_hot_expert_max_replicas)
        if self.moe_pad_expert_input_to_capacity or self.moe_padded_batch_gemm_factor is not None:
            raise ValueError(
                "moe_hot_expert_replication computes hot experts' tokens where they are, outside the per-expert "
                "row limit of moe_pad_expert_input_to_capacity / moe_padded_batch_gemm_factor; use one or the other"
            )


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _require_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
