"""The inference cache of MLA as DeepSeek's inference runs it: per layer the compressed KV latent and the decoupled
rope key, not per-head keys and values.

Legend: L decoder layers, B sequences, T cache capacity (positions), C `kv_lora_rank`, Dr `qk_rope_head_dim`.

Per layer and position the cache holds `C + Dr` numbers (576 in DeepSeek-V3) where a per-head cache would hold
`N * (Dn + Dr + Dv)` (128 heads * 320 = 40960): the up projections are absorbed into the query and the output at
decode time (decode.py).

Padding is on the right: sequence b's tokens sit at positions `0 .. lengths[b] - 1`, its next token goes to
position `lengths[b]`, so every token keeps the position it has when its prompt runs alone. What lies at positions
`>= lengths[b]` (a shorter prompt's padding) is never attended to and is overwritten as the sequence grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config


@dataclass
class MLACache:
    """The decode cache of a `DeepseekV3ForCausalLM` (decode.py fills and reads it).

    latents: L tensors `[B, T, C]` in the model dtype: `kv_a_layernorm(kv_a_proj_with_mqa(x)[..., :C])`, the
        normed compressed KV.
    rope_keys: L tensors `[B, T, Dr]` in the model dtype: the rope part of `kv_a_proj_with_mqa(x)`, rotated at its
        position (in apply_rope's half layout, as the queries are rotated).
    lengths: `[B] int64`, the positions filled per sequence (the next token's position).
    """

    latents: list[torch.Tensor]
    rope_keys: list[torch.Tensor]
    lengths: torch.Tensor

    @classmethod
    def empty(
        cls,
        config: DeepseekV3Config,
        batch: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> MLACache:
        """A zeroed cache of `batch` sequences and `capacity` positions each (ValueError past
        `max_position_embeddings`: the rope tables and YaRN's scaling are defined up to there)."""
        if batch < 1 or capacity < 1:
            raise ValueError(f"cache batch and capacity must be positive, got {batch} and {capacity}")
        if capacity > config.max_position_embeddings:
            raise ValueError(
                f"cache capacity {capacity} exceeds max_position_embeddings={config.max_position_embeddings}"
            )
        kw = dict(dtype=dtype, device=device)
        L, C, Dr = config.num_hidden_layers, config.kv_lora_rank, config.qk_rope_head_dim
        return cls(
            latents=[torch.zeros(batch, capacity, C, **kw) for _ in range(L)],
            rope_keys=[torch.zeros(batch, capacity, Dr, **kw) for _ in range(L)],
            lengths=torch.zeros(batch, dtype=torch.int64, device=device),
        )

    @property
    def batch(self) -> int:
        return self.lengths.size(0)

    @property
    def capacity(self) -> int:
        return self.latents[0].size(1)

    def rows(self, start: int, end: int) -> MLACache:
        """Sequences `start .. end-1` as a cache of their own that shares this one's storage (views along the batch
        dimension: writes through it land here). Its `lengths` is a copy, advanced on its own: the two-micro-batch
        decode (generation.py) runs each half of a batch on such a view."""
        if not 0 <= start < end <= self.batch:
            raise ValueError(f"rows {start}..{end} are not a non-empty range of the {self.batch} cached sequences")
        return MLACache(
            latents=[t[start:end] for t in self.latents],
            rope_keys=[t[start:end] for t in self.rope_keys],
            lengths=self.lengths[start:end].clone(),
        )

    def write(self, layer: int, positions_BS: torch.Tensor, latent_BSC: torch.Tensor, rope_BSR: torch.Tensor) -> None:
        """Store layer `layer`'s normed latents `[B, S, C]` and rotated rope keys `[B, S, Dr]` at `positions_BS`
        (`[B, S] int64`, each below `capacity`)."""
        rows = torch.arange(self.batch, device=positions_BS.device)[:, None]
        self.latents[layer][rows, positions_BS] = latent_BSC
        self.rope_keys[layer][rows, positions_BS] = rope_BSR
