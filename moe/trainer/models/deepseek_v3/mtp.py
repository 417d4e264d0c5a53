"""Multi-token prediction module (DeepSeek-V3 report, section 2.2), in the released checkpoint's layout.

Depth k (1-based) at position i combines the depth-(k-1) representation of token i with the embedding of token
i+k and predicts token i+k+1:

    h'_i = eh_proj([enorm(Emb(t_{i+k})) | hnorm(h_i^{k-1})])      embedding first, as the released eh_proj weights
    h_i^k = shared_head.norm(DecoderLayer(h'))                     (and transformers' / Megatron's MTP) expect
    logits = lm_head(h_i^k)                                        the output head is the main model's

`h^0` is the main model's output after its final norm (transformers' and Megatron's MTP take the same). The
embedding and the output head are shared with the main model; the released checkpoint nevertheless stores copies
under `model.layers.{61+k-1}.embed_tokens` and `.shared_head.head` (written on export, checked on import).

State-dict names (under `mtp.{k-1}.`): the decoder layer's (see block.py), `enorm.weight`, `hnorm.weight`,
`eh_proj.weight [H, 2H]`, `shared_head.norm.weight` -- the official names under `model.layers.{N + k - 1}.`.
"""

from __future__ import annotations

import torch
from torch import nn

from moe.layer.parallel.mappings import SequenceShards
from moe.trainer.models.deepseek_v3.block import DecoderLayer
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.norm import RMSNorm


class SharedHead(nn.Module):
    """The MTP module's own final norm (`shared_head.norm`); the head itself is the main model's `lm_head`."""

    def __init__(self, config: DeepseekV3Config, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class MTPModule(DecoderLayer):
    """One MTP depth: a decoder layer (MoE when layer `num_hidden_layers + depth` is, as the released one) with the
    input projection of the previous depth's state and the next token's embedding, and its own final norm."""

    def __init__(
        self,
        config: DeepseekV3Config,
        depth: int,
        *,
        moe_layer_kwargs: dict | None,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        super().__init__(
            config, config.num_hidden_layers + depth, moe_layer_kwargs=moe_layer_kwargs, dtype=dtype, device=device
        )
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device)
        self.eh_proj = nn.Linear(2 * H, H, bias=False, dtype=dtype, device=device)
        self.shared_head = SharedHead(config, dtype=dtype, device=device)

    def forward(
        self,
        h_prev_BSH: torch.Tensor,
        emb_BSH: torch.Tensor,
        cos_SP: torch.Tensor,
        sin_SP: torch.Tensor,
        shards: SequenceShards | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args:
            h_prev_BSH: `[B, S, H]` the previous depth's normalised states at positions i.
            emb_BSH: `[B, S, H]` embeddings of the tokens at positions i + depth.
            cos_SP, sin_SP: rotary tables `[S, Dr/2]` (or per row `[B, S, Dr/2]`) of the positions i + depth (those
                of the embedded tokens).
            shards: with sequence parallelism, the split of the S positions: `h_prev` and `emb` are this rank's
                `[B, S_r, H]`, and so is the result (the norms and `eh_proj` run on the local positions).
            mask: the attention's: None (causal) or the `[B, 1, S, S]` bias of the positions i (packed documents: the
                documents of the states h_prev, as Megatron's MTP keeps the main model's mask).
        Returns `[B, S, H]`, normalised by `shared_head.norm` (input of the output head and of the next depth).
        """
        x = self.eh_proj(torch.cat((self.enorm(emb_BSH), self.hnorm(h_prev_BSH)), dim=-1))
        return self.shared_head.norm(super().forward(x, cos_SP, sin_SP, shards, mask))
