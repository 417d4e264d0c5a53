"""Cached inference of `DeepseekV3ForCausalLM`: prefill and decode over the MLA latent cache (kv_cache.py), with
the up projections absorbed as in DeepSeek's inference ("absorb" attention). Eval mode, no autograd;
it shares the down projections and their norms with the training forward (`MultiHeadLatentAttention.down_proj`),
and nothing of it runs on the training forward's path.

Legend: B sequences, S new tokens per sequence in this call, T cached positions attended over, H hidden, V vocabulary,
N heads, Dn / Dr / Dv the no-rope key, rope key and value head dims, C `kv_lora_rank`.

Expert parallelism: the model's MoE layers dispatch over its EP group (each rank runs its own sequences, every rank
calls each forward: see generation.py); everything here is per rank.

Absorbed attention (per head n; W_UK [Dn, C] and W_UV [Dv, C] are head n's key and value rows of `kv_b_proj`):
    score(s, t) = (q_nope[s] W_UK) . c[t]  +  q_rope[s] . k_rope[t]         (q_nope W_UK: [C], once per query)
    out[s]      = (sum_t p(s, t) c[t]) W_UV^T                             (the value projection after the sum)
which is the training attention's `q_nope . (W_UK c[t])` and `sum_t p v[t]` with the products reassociated: the
same function, its float sums in another order (see tests/models/test_dsv3_decode.py for the tolerance).

Positions: sequence b's new tokens go to positions `cache.lengths[b] + s` and are rotated there; a query at position
p attends to the cached positions `0 .. p` of its own sequence. Prompts of different lengths are right-padded
(`pad_prompts`): the padding's queries and keys are computed but no real token attends to them (they lie after
every real token of their row), and the next decode step overwrites them.

The MoE layers run as in training (dropless, each token routed on its own), so padding and batch neighbours do not
change a sequence's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe.trainer.models.deepseek_v3.attention import MultiHeadLatentAttention
from moe.trainer.models.deepseek_v3.kv_cache import MLACache
from moe.trainer.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.rope import apply_rope


def check_decodable(model: DeepseekV3ForCausalLM) -> None:
    """ValueError unless `model` can run cached inference here: eval mode; one process, or expert parallelism
    (every MoE layer's experts over the EP group, the rest replicated; generation.py steps the ranks together). Tensor,
    expert-tensor and pipeline parallelism are training layouts only."""
    if model.training:
        raise ValueError("cached inference needs an eval-mode model: call model.eval() first")
    if model.tp_group is not None or model.etp_group is not None or model.pipeline_stages is not None:
        raise ValueError(
            "cached inference runs on one process or over an expert-parallel group: tensor, expert-tensor and "
            "pipeline parallelism are not supported"
        )


def check_prompt_ids(cfg: DeepseekV3Config, prompts: Sequence[torch.Tensor | Sequence[int]]) -> list[torch.Tensor]:
    """The prompts as 1-D int64 tensors; ValueError (before any compute, and needing only the model's config) for
    an empty batch, an empty prompt, a prompt longer than `max_position_embeddings` or a token id outside the
    vocabulary."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        t = torch.as_tensor(p)
        if t.dim() != 1 or t.numel() == 0 or t.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"prompt {i} must be a non-empty 1-D sequence of int token ids, got {tuple(t.shape)} {t.dtype}"
            )
        if t.numel() > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {t.numel()} tokens, more than max_position_embeddings={cfg.max_position_embeddings}"
            )
        if int(t.min()) < 0 or int(t.max()) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={cfg.vocab_size})")
        out.append(t.long())
    return out


def pad_prompts(prompts: Sequence[torch.Tensor], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids [B, S_max] int64, lengths [B] int64)`: 1-D prompts right-padded with `pad_token_id` (any valid id: no
    real token attends to the padding)."""
    lengths = torch.tensor([p.numel() for p in prompts], dtype=torch.int64)
    ids = torch.full((len(prompts), int(lengths.max())), pad_token_id, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : p.numel()] = p
    return ids, lengths


@torch.no_grad()
def forward_with_cache(
    model: DeepseekV3ForCausalLM,
    input_ids: torch.Tensor,
    cache: MLACache,
    num_new: torch.Tensor | None = None,
    *,
    last_only: bool = False,
) -> torch.Tensor:
    """Run `input_ids [B, S] int64` at positions `cache.lengths[b] + 0 .. S-1`, store their latents in `cache`, and
    advance `cache.lengths` by `num_new [B] int64` (the real tokens per row, default S; the rest is right padding;
    0 for a row with nothing left to add, as a chunk of a chunked prefill may have: its padding lands after its
    last real token, where nothing reads it).

    Returns the logits in the model dtype: `[B, S, V]` (`logits[:, s]` predicts the token after position s), or with
    `last_only` `[B, V]` at each row's last real token (`num_new[b] - 1`; only that row of the head is computed; a
    row with `num_new[b] == 0` gets its last column's logits, which mean nothing).
    A prefill is one call on an empty cache with the padded prompts; a decode step one call with `S = 1`.
    """
    check_decodable(model)
    B, S = input_ids.shape
    device = input_ids.device
    num_new = torch.full((B,), S, dtype=torch.int64, device=device) if num_new is None else num_new.to(device)
    if cache.batch != B:
        raise ValueError(f"input_ids has {B} rows, the cache {cache.batch}")
    if num_new.shape != (B,) or bool((num_new < 0).any()) or bool((num_new > S).any()):
        raise ValueError(f"num_new must be [B] with values in 0..{S}, got {num_new.tolist()}")
    end = int((cache.lengths + S).max())
    if end > cache.capacity:
        raise ValueError(f"{S} more positions do not fit the cache: {end} > capacity {cache.capacity}")
    positions_BS = cache.lengths.to(device)[:, None] + torch.arange(S, device=device)[None, :]
    cos_ZP, sin_ZP = model.rotary(positions_BS.reshape(-1), model.config_dtype)  # Z = B * S
    h_BSH = model.embed_tokens(input_ids)
    for i, layer in enumerate(model.layers):
        a_BSH = layer.input_layernorm(h_BSH)
        h_BSH = h_BSH + absorbed_attention(layer.self_attn, a_BSH, cos_ZP, sin_ZP, positions_BS, cache, i, end)
        h_BSH = h_BSH + layer._mlp(layer.post_attention_layernorm(h_BSH), None)
    cache.lengths = cache.lengths + num_new.to(cache.lengths.device)
    if last_only:
        h_BSH = h_BSH[torch.arange(B, device=device), (num_new - 1).clamp(min=0)][:, None]
    logits = model._logits(model.norm(h_BSH), None)
    return logits[:, 0] if last_only else logits


def absorbed_attention(
    attn: MultiHeadLatentAttention,
    x_BSH: torch.Tensor,
    cos_ZP: torch.Tensor,
    sin_ZP: torch.Tensor,
    positions_BS: torch.Tensor,
    cache: MLACache,
    layer: int,
    end: int,
) -> torch.Tensor:
    """MLA of `x [B, S, H]` (the normed layer input) at `positions_BS [B, S] int64` against `cache` (layer `layer`),
    attending over cached positions `0 .. end-1` masked causally per row; stores the new latents first. Rotary
    tables `[B*S, Dr/2]` for the flattened positions. Returns `[B, S, H]` (after `o_proj`)."""
    B, S, _ = x_BSH.shape
    N, Dn, Dr, Dv, C = attn.num_heads, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    q_in, c_BSC, k_rope = attn.down_proj(x_BSH)
    q = attn.q_b_proj(q_in) if attn.q_b_proj is not None else q_in
    q_nope, q_rope = q.view(B, S, N, Dn + Dr).split([Dn, Dr], dim=-1)
    # apply_rope broadcasts one table row per position over the batch: flatten (b, s) into its position axis.
    q_rope = apply_rope(q_rope.reshape(1, B * S, N, Dr), cos_ZP, sin_ZP, attn.rope_interleave).view(B, S, N, Dr)
    k_rope = apply_rope(k_rope.reshape(1, B * S, 1, Dr), cos_ZP, sin_ZP, attn.rope_interleave).view(B, S, Dr)
    cache.write(layer, positions_BS, c_BSC, k_rope)

    w_NXC = attn.kv_b_proj.weight.view(N, Dn + Dv, C)  # kv_b_proj rows per head: Dn key rows, then Dv value rows
    w_uk_NDC, w_uv_NVC = w_NXC[:, :Dn], w_NXC[:, Dn:]
    latents_BTC = cache.latents[layer][:, :end]
    rope_keys_BTR = cache.rope_keys[layer][:, :end]
    q_lat_BSNC = torch.einsum("bsnd,ndc->bsnc", q_nope, w_uk_NDC)
    scores_BSNT = torch.einsum("bsnc,btc->bsnt", q_lat_BSNC, latents_BTC)
    scores_BSNT = (scores_BSNT + torch.einsum("bsnr,btr->bsnt", q_rope, rope_keys_BTR)) * attn.scale
    future = torch.arange(end, device=x_BSH.device)[None, None, None, :] > positions_BS[:, :, None, None]
    # Softmax in float32 (as SDPA's kernels keep it), back to the model dtype for the value sum.
    probs_BSNT = torch.softmax(scores_BSNT.float().masked_fill(future, float("-inf")), dim=-1).to(x_BSH.dtype)
    out_lat_BSNC = torch.einsum("bsnt,btc->bsnc", probs_BSNT, latents_BTC)
    out_BSNV = torch.einsum("bsnc,nvc->bsnv", out_lat_BSNC, w_uv_NVC)
    return attn.o_proj(out_BSNV.reshape(B, S, N * Dv))


@torch.no_grad()
def prefill(
    model: DeepseekV3ForCausalLM,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    capacity: int,
    *,
    pad_token_id: int = 0,
    chunk_size: int | None = None,
    num_chunks: int | None = None,
) -> tuple[MLACache, torch.Tensor]:
    """`(cache, logits [B, V])`: a cache of `capacity` positions per sequence filled with the prompts (any lengths,
    right-padded), and the logits after each prompt's last token, in the model dtype. ValueError before any
    compute for bad prompts (`check_prompt_ids`) or a capacity below the longest prompt.

    chunk_size: run the prompts' columns in chunks of this many positions (each chunk attends to the cache the
        earlier ones filled), so the attention's `[B, chunk, N, T]` scores and the MoE layers' rows stay bounded
        whatever the prompt length (chunked prefill). None: one forward of the whole prompts.
    num_chunks: with expert parallelism every rank must run the same number of forwards (each one's MoE layers
        communicate): the largest count over the ranks (`ceil(longest prompt / chunk_size)`); a rank with fewer
        real chunks runs the rest on padding. None: this rank's own count.
    """
    check_decodable(model)
    prompts = check_prompt_ids(model.config, prompts)
    ids, lengths = pad_prompts(prompts, pad_token_id)
    if capacity < ids.size(1):
        raise ValueError(f"cache capacity {capacity} is below the longest prompt ({ids.size(1)} tokens)")
    device = model.embed_tokens.weight.device
    cache = MLACache.empty(model.config, len(prompts), capacity, dtype=model.config_dtype, device=device)
    ids, lengths = ids.to(device), lengths.to(device)
    if chunk_size is None:
        return cache, forward_with_cache(model, ids, cache, lengths, last_only=True)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    own = -(-ids.size(1) // chunk_size)
    num_chunks = own if num_chunks is None else num_chunks
    if num_chunks < own:
        raise ValueError(f"num_chunks={num_chunks} is below this rank's {own} chunks of {chunk_size}")
    logits = None
    for c in range(num_chunks):
        start = c * chunk_size
        # Past the longest prompt (another rank's longer one sets the count) the chunk is one pad column per row, at
        # a position after each row's last token; it is never read and the next decode step overwrites it.
        chunk = ids[:, start : start + chunk_size] if start < ids.size(1) else ids[:, :1].clone().fill_(pad_token_id)
        width = chunk.size(1)
        num_new = (lengths - start).clamp(0, width)
        if bool((cache.lengths + width > capacity).any()):
            raise ValueError(f"chunk {c} of the prefill does not fit the cache's {capacity} positions")
        out = forward_with_cache(model, chunk, cache, num_new, last_only=True)
        ends_here = (num_new > 0) & (lengths <= start + width)  # the chunk holding each row's last token
        logits = out if logits is None else torch.where(ends_here[:, None], out, logits)
    return cache, logits
