"""Multi-head Latent Attention (DeepSeek-V2/V3), causal; its core through `F.scaled_dot_product_attention` or as
explicit GEMMs and softmax (`attention_backend`, see "The attention core" below).

Legend: B batch, S positions, H hidden, N heads, Dn / Dr / Dv the per-head no-rope key, rope key and value dims,
Dq = Dn + Dr, Q `q_lora_rank`, C `kv_lora_rank`.

    a        = x @ W_a                                  one GEMM for the query input and the kv latent (see below)
    q        = q_b_proj(RMSNorm(a_q))  [B, S, N, Dq]    or a_q itself when q_lora_rank is None (a plain q_proj)
    c, k_r   = a_kv                    [B, S, C], [B, S, Dr]   (k_r is one rope key shared by all heads)
    k_n, v   = kv_b_proj(RMSNorm(c))   [B, S, N, Dn], [B, S, N, Dv]
    q_r, k_r = RoPE(q_r), RoPE(k_r);   k = [k_n | k_r broadcast over heads]
    out      = o_proj(softmax(q k^T * scale + causal) v)

Parameters (state-dict names under `self_attn.`): `qkv_a_proj` fuses transformers' `q_a_proj` (or `q_proj`) and
`kv_a_proj_with_mqa` row-wise (`[Q + C + Dr, H]`, or `[N*Dq + C + Dr, H]`): both read the same input, so one GEMM
does both. Only when `q_lora_rank` is None and `attention_bias` is set (transformers' `q_proj` has no bias while
`kv_a_proj_with_mqa` has one) are they kept apart as `q_proj` and `kv_a_proj_with_mqa`. The other names are
transformers': `q_a_layernorm`, `q_b_proj`, `kv_a_layernorm`, `kv_b_proj` (rows per head: Dn key rows then Dv value
rows), `o_proj`.

The attention core (`attention_backend`, Megatron's `--attention-backend` names; `[training] attention_backend`):
- 'sdpa' (default): `F.scaled_dot_product_attention`. MLA's value heads are narrower than its query/key heads
  (Dv < Dq: 128 vs 192 in DeepSeek-V3) and SDPA's fused kernels (the CPU flash kernel among them) want one head dim,
  so v is zero-padded to Dq (the padded output columns are sliced off and get zero gradients): 2 * Dq / (Dq + Dv)
  times the value work, plus the padding, the slicing and the kernel's zero-filled gradient buffers.
- 'unfused': `softmax(q k^T * scale + causal mask) v` as two batched GEMMs over the unpadded v. It keeps the
  probabilities `[B, N, S, S]` for backward (flash keeps only q, k, v, the output and the row maxima).
- 'auto': 'unfused' where it is cheaper and small, 'sdpa' elsewhere (`unfused_core`): on CPU, in float32, for
  S <= 3 * Dq, i.e. where the kept probabilities (N * S floats per token) are no larger than the q, k and padded v
  the flash path keeps (3 * N * Dq). Measured (one thread, forward + backward of the core, 1024 tokens, N = 4,
  Dq = 128, Dv = 64): unfused 0.7-1.0x flash's time from S = 128 to 1024 (the noisy 2-core machine of this project).
  Not on GPUs (SDPA's fused kernels) nor in BF16 (the explicit scores would be rounded to BF16 before the softmax,
  which the flash kernel keeps in float32).
The two are the same function up to float32 rounding (~1e-7 relative), but the rounding moves MoE routing
decisions that sit on a tie, so a training run's losses leave the 'sdpa' run's after a few steps (tiny: within
2e-4 relative for 7 steps, then up to 5e-3 as the routes part); hence 'sdpa' stays the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe.layer.parallel.mappings import SequenceShards, gather_from_sequence_parallel
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.model_recompute import RecomputeScope, discard_outputs, recompute_region
from moe.trainer.models.deepseek_v3.norm import RMSNorm
from moe.trainer.models.deepseek_v3.rope import apply_rope, softmax_scale

ATTENTION_BACKENDS = ("sdpa", "unfused", "auto")


def unfused_core(backend: str, seq_len: int, qk_head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the attention core of `seq_len` positions runs as explicit GEMMs + softmax under `backend` (see the
    module docstring: 'auto' on CPU, in float32, with the kept probabilities no larger than flash's q, k, v)."""
    if backend == "auto":
        return device.type == "cpu" and dtype == torch.float32 and seq_len <= 3 * qk_head_dim
    return backend == "unfused"


def causal_bias(seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[S, S]` additive causal mask: 0 on and below the diagonal, -inf above (S * S elements, built per call: a few
    microseconds next to the `[B * N, S, S]` scores)."""
    return torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device).triu(1)


def fuses_input_projections(config: DeepseekV3Config) -> bool:
    """Whether the query input and kv latent projections are one `qkv_a_proj` (see the module docstring)."""
    return config.q_lora_rank is not None or not config.attention_bias


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: DeepseekV3Config, *, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        c = config
        self.attention_backend = "sdpa"  # one of ATTENTION_BACKENDS (`DeepseekV3ForCausalLM.set_attention_backend`)
        self.num_heads = c.num_attention_heads  # this rank's heads: `head_start` on (tensor_parallel.py)
        self.head_start = 0
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.rope_interleave = c.rope_interleave
        self.scale = softmax_scale(c.rope_parameters, c.qk_head_dim)
        q_heads_dim = self.num_heads * c.qk_head_dim
        self.q_in_dim = c.q_lora_rank if c.q_lora_rank is not None else q_heads_dim
        kv_a_dim = c.kv_lora_rank + c.qk_rope_head_dim
        kw = dict(dtype=dtype, device=device)
        self.fused = fuses_input_projections(c)
        if self.fused:
            self.qkv_a_proj = nn.Linear(c.hidden_size, self.q_in_dim + kv_a_dim, bias=c.attention_bias, **kw)
        else:
            self.q_proj = nn.Linear(c.hidden_size, q_heads_dim, bias=False, **kw)
            self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, kv_a_dim, bias=c.attention_bias, **kw)
        if c.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, **kw)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_heads_dim, bias=False, **kw)
        else:
            self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps, **kw)
        kv_b_dim = self.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, kv_b_dim, bias=False, **kw)
        self.o_proj = nn.Linear(self.num_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias, **kw)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SP: torch.Tensor,
        sin_SP: torch.Tensor,
        shards: SequenceShards | None = None,
        *,
        recompute: frozenset[str] = frozenset(),
        scope: RecomputeScope | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal self-attention over `x [B, S, H]` with rotary tables `[S, Dr/2]` (or per row `[B, S, Dr/2]`);
        returns `[B, S, H]`.

        `mask`: None (causal over the whole row) or the additive `[B, 1, S, S]` bias in the activations' dtype, 0
        where query s may attend key t and -inf elsewhere (documents.attention_bias: causal within each packed
        document).

        Tensor + sequence parallel (`shards`, see tensor_parallel.py): `x` is this rank's positions `[B, S_r, H]`
        and the result too; `cos_SP`/`sin_SP` cover the whole sequence. The replicated down projection and its
        norms run on the local positions; their outputs (the latents, narrower than H) are all-gathered once;
        the up projections (column parallel) and the attention core see this rank's `num_heads` heads over the
        whole sequence, and `o_proj` (row parallel) reduce-scatters back to the local positions.

        Recompute (recompute.py): with "mla_up_proj" in `recompute` (and the layer's `scope`) the up projections,
        RoPE and the q / k / v assembly are rebuilt in backward from the normed latents, their outputs not kept;
        with "core_attn" only q, k and v are kept for the attention core.
        """
        Dr = self.rope_dim
        q_in, c_BSC, k_rope = self.down_proj(x_BSH)
        if shards is not None:
            latent = gather_from_sequence_parallel(torch.cat((q_in, c_BSC, k_rope), dim=-1), shards)
            q_in, c_BSC, k_rope = latent.split([self.q_in_dim, self.kv_lora_rank, Dr], dim=-1)
            if self.q_b_proj is None:  # a plain q_proj, replicated: keep this rank's heads
                q_in = q_in.narrow(-1, self.head_start * (self.nope_dim + Dr), self.num_heads * (self.nope_dim + Dr))
        if "mla_up_proj" in recompute and scope is not None:
            # The rebuild keeps its inputs. Without TP the rope key is a slice of the down projection's output, which
            # nothing else keeps: keep a copy of the slice only (with TP the gathered latent is kept by q_b_proj).
            k_rope = k_rope if shards is not None else k_rope.contiguous()
            up = discard_outputs(self._up_proj, q_in, c_BSC, k_rope, cos_SP, sin_SP, scope=scope)
            q_BSNQ, k_BSNQ, v_BSNQ = up
        else:
            q_BSNQ, k_BSNQ, v_BSNQ = self._up_proj(q_in, c_BSC, k_rope, cos_SP, sin_SP)
        if "core_attn" in recompute:
            out_BSD = recompute_region(self._core_attention, q_BSNQ, k_BSNQ, v_BSNQ, mask)
        else:
            out_BSD = self._core_attention(q_BSNQ, k_BSNQ, v_BSNQ, mask)
        return self.o_proj(out_BSD) if shards is None else self.o_proj(out_BSD, shards)

    def down_proj(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The replicated down projections of `x [B, S, H]` and their norms: `(query input [B, S, Q]` (normed
        when `q_b_proj` follows; else the plain q_proj output `[B, S, N*Dq]`), `latent c [B, S, C]` (normed),
        `rope key [B, S, Dr]` (not rotated)). The training forward and the cached decode (decode.py) share it."""
        Dr = self.rope_dim
        if self.fused:
            q_in, c_BSC, k_rope = self.qkv_a_proj(x_BSH).split([self.q_in_dim, self.kv_lora_rank, Dr], dim=-1)
        else:
            q_in = self.q_proj(x_BSH)
            c_BSC, k_rope = self.kv_a_proj_with_mqa(x_BSH).split([self.kv_lora_rank, Dr], dim=-1)
        q_in = self.q_a_layernorm(q_in) if self.q_b_proj is not None else q_in
        return q_in, self.kv_a_layernorm(c_BSC), k_rope

    def _unfused(self, seq_len: int, x: torch.Tensor) -> bool:
        return unfused_core(self.attention_backend, seq_len, self.nope_dim + self.rope_dim, x.dtype, x.device)

    def _up_proj(self, q_in, c_BSC, k_rope, cos_SP, sin_SP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(q, k, v)` `[B, N, S, D]` each from the normed latents (the query input `[B, S, Q]`, or the plain q_proj
        output `[B, S, N*Dq]`; `c [B, S, C]`; the rope key `[B, S, Dr]`): q and k with D = Dq; v with Dv (unfused
        core), or zero-padded to Dq (SDPA). Unfused: contiguous, heads before positions (the layout of its batched
        GEMMs). SDPA: transposed views of positions-first tensors (SDPA reads the strides)."""
        B = q_in.size(0)
        N, Dn, Dr, Dv = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim
        S = q_in.size(1)
        q = self.q_b_proj(q_in) if self.q_b_proj is not None else q_in
        q_nope, q_rope = q.view(B, S, N, Dn + Dr).split([Dn, Dr], dim=-1)
        k_nope, v_BSNV = self.kv_b_proj(c_BSC).view(B, S, N, Dn + Dv).split([Dn, Dv], dim=-1)

        q_rope = apply_rope(q_rope, cos_SP, sin_SP, self.rope_interleave)
        k_rope = apply_rope(k_rope.reshape(B, S, 1, Dr), cos_SP, sin_SP, self.rope_interleave)
        if self._unfused(S, q):
            # The concatenations copy anyway: they write the heads-first layout of the batched GEMMs.
            q_BNSQ = torch.cat((q_nope.transpose(1, 2), q_rope.transpose(1, 2)), dim=-1)
            k_BNSQ = torch.cat((k_nope.transpose(1, 2), k_rope.transpose(1, 2).expand(B, N, S, Dr)), dim=-1)
            return q_BNSQ, k_BNSQ, v_BSNV.transpose(1, 2).contiguous()
        q_BSNQ = torch.cat((q_nope, q_rope), dim=-1)
        k_BSNQ = torch.cat((k_nope, k_rope.expand(B, S, N, Dr)), dim=-1)
        # SDPA's fused (flash) kernels want one head dim for q, k and v: zero columns appended to v (see the module
        # docstring).
        if Dv < Dn + Dr:
            v_BSNV = F.pad(v_BSNV, (0, Dn + Dr - Dv))
        return q_BSNQ.transpose(1, 2), k_BSNQ.transpose(1, 2), v_BSNV.transpose(1, 2)

    def _core_attention(self, q_BNSQ, k_BNSQ, v_BNSD, bias_B1SS: torch.Tensor | None = None) -> torch.Tensor:
        """Causal `softmax(q k^T * scale) v` over `_up_proj`'s `[B, N, S, D]` tensors; `[B, S, N*Dv]`. With the
        additive `bias_B1SS` (0 / -inf, broadcast over the heads) added to the scores instead of the causal mask
        (packed documents)."""
        B, N, S, Dq = q_BNSQ.shape
        Dv = self.v_dim
        if self._unfused(S, q_BNSQ):
            # One GEMM applies the scale and adds the mask (baddbmm: bias + scale * q k^T); k^T is a view.
            scores_ZSS = torch.baddbmm(
                causal_bias(S, q_BNSQ.dtype, q_BNSQ.device),
                q_BNSQ.view(B * N, S, Dq),
                k_BNSQ.view(B * N, S, Dq).transpose(1, 2),
                alpha=self.scale,
            )
            if bias_B1SS is not None:
                # In place on the GEMM's output (baddbmm's backward does not read it; an addition's backward passes
                # the gradient through): the keys of other documents to -inf, on top of the causal bias (which the
                # documents' bias repeats: -inf + -inf stays -inf). One broadcast add, no [B * N, S, S] bias copy.
                scores_ZSS.view(B, N, S, S).add_(bias_B1SS)
            out_ZSV = torch.bmm(torch.softmax(scores_ZSS, dim=-1), v_BNSD.view(B * N, S, Dv))
            return out_ZSV.view(B, N, S, Dv).transpose(1, 2).reshape(B, S, N * Dv)
        if bias_B1SS is None:
            out_BNSD = F.scaled_dot_product_attention(q_BNSQ, k_BNSQ, v_BNSD, is_causal=True, scale=self.scale)
        else:  # SDPA adds a float mask to the scores as is; it includes the causal part
            out_BNSD = F.scaled_dot_product_attention(q_BNSQ, k_BNSQ, v_BNSD, attn_mask=bias_B1SS, scale=self.scale)
        return out_BNSD[..., :Dv].transpose(1, 2).reshape(B, S, N * Dv)
