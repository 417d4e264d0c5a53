"""One decoder layer: pre-norm MLA and a pre-norm feed-forward (dense SwiGLU, or DeepSeekMoE on `moe.MoELayer`).

State-dict names (under `layers.{i}.`): `input_layernorm`, `self_attn.*` (see attention.py),
`post_attention_layernorm`, and `mlp.*`: dense layers `mlp.w13 [H, 2F]` (gate columns, then up) and
`mlp.w2 [F, H]` (`moe.SwiGLUMLP`); MoE layers `mlp.router.weight [E, H]` (float32),
`mlp.router.expert_bias.bias [E]` (float32, transformers' `e_score_correction_bias`), `mlp.experts.w13 [E, H, 2F]`,
`mlp.experts.w2 [E, F, H]` (this rank's slice in the module, every expert in `full_state_dict`),
`mlp.shared_experts.w13`, `mlp.shared_experts.w2`.
"""

from __future__ import annotations

import torch
from torch import nn

from moe.layer.experts import SwiGLUMLP
from moe.layer.moe_layer import MoELayer
from moe.layer.parallel.layers import ParallelSwiGLUMLP
from moe.layer.parallel.mappings import SequenceShards
from moe.trainer.models.deepseek_v3.attention import MultiHeadLatentAttention
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.model_recompute import RecomputeScope, discard_outputs, recompute_region
from moe.trainer.models.deepseek_v3.norm import RMSNorm


class DecoderLayer(nn.Module):
    """`x + attn(norm(x))`, then `+ mlp(norm(.))`. `moe_layer_kwargs` builds the MoE layer (None = dense)."""

    def __init__(
        self,
        config: DeepseekV3Config,
        layer_idx: int,
        *,
        moe_layer_kwargs: dict | None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.recompute_modules: frozenset[str] = frozenset()  # Megatron's recompute_modules, set by the model
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = MultiHeadLatentAttention(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        if moe_layer_kwargs is not None:
            self.mlp: nn.Module = MoELayer(**moe_layer_kwargs, **kw)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, init_std=config.initializer_range, **kw)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SP: torch.Tensor,
        sin_SP: torch.Tensor,
        shards: SequenceShards | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`[B, S, H] -> [B, S, H]`; rotary tables `[S, Dr/2]` (or per row `[B, S, Dr/2]`) for the positions of the
        S tokens; `mask` the attention's (None: causal; the `[B, 1, S, S]` bias of packed documents). With sequence
        parallelism (`shards`) `x` and the result are this rank's positions `[B, S_r, H]` (norms, residuals and the
        MoE layer see those only; attention and the dense MLP gather the sequence inside).

        Selective recompute (`recompute_modules`, set by the model; see recompute.py): the regions run under one
        `RecomputeScope` for the layer, so the operations after an output-discarding region save recipes."""
        modules = self.recompute_modules
        if not modules or not torch.is_grad_enabled():
            return self._forward(x_BSH, cos_SP, sin_SP, shards, mask, frozenset(), None)
        with RecomputeScope() as scope:
            return self._forward(x_BSH, cos_SP, sin_SP, shards, mask, modules, scope)

    def _forward(self, x_BSH, cos_SP, sin_SP, shards, mask, modules: frozenset[str], scope: RecomputeScope | None):
        a_BSH = self._norm(self.input_layernorm, x_BSH, modules, scope)
        attn = self.self_attn(a_BSH, cos_SP, sin_SP, shards, recompute=modules, scope=scope, mask=mask)
        x_BSH = x_BSH + attn
        h_BSH = self._norm(self.post_attention_layernorm, x_BSH, modules, scope)
        if "mlp" in modules and not isinstance(self.mlp, MoELayer):
            return x_BSH + recompute_region(self._mlp, h_BSH, shards)
        return x_BSH + self._mlp(h_BSH, shards)

    @staticmethod
    def _norm(norm: RMSNorm, x_BSH, modules: frozenset[str], scope: RecomputeScope | None) -> torch.Tensor:
        if "layernorm" in modules:
            return discard_outputs(norm, x_BSH, scope=scope, checkpoint_inside=True)
        return norm(x_BSH)

    def _mlp(self, h_BSH: torch.Tensor, shards: SequenceShards | None) -> torch.Tensor:
        if shards is not None and isinstance(self.mlp, ParallelSwiGLUMLP):
            return self.mlp(h_BSH, shards)
        return self.mlp(h_BSH)
