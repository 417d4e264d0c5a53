"""Token generation over the MLA cache (decode.py): greedy, or temperature + top-p (nucleus) sampling, for a batch
of prompts of different lengths; each sequence stops at `eos_token_id` or after `max_new_tokens`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe.models.deepseek_v3.config import DeepseekV3Config
from moe.models.deepseek_v3.decode import check_decodable, check_prompt_ids, forward_with_cache, prefill
from moe.models.deepseek_v3.model import DeepseekV3ForCausalLM


@dataclass
class GenerationTimes:
    """The two phases of one `generate` call, timed on the wall clock (the device synchronised at each end).

    prefill: the prompts' forward and the first new token of each sequence; `prefill_tokens` = the prompt tokens.
    decode: the decode steps; `decode_tokens` = the tokens they produced for live sequences (each result's length
        less its first token: the padding fed for finished sequences does not count).
    """

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float | None:
        """None when nothing was timed (no prefill ran)."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """None when no decode step ran (`max_new_tokens == 1`, or every sequence ended on its first token)."""
        return self.decode_tokens / self.decode_seconds if self.decode_tokens and self.decode_seconds > 0 else None


def _now(device: torch.device) -> float:
    """The wall clock once `device` has finished its queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def sample_next(
    logits_BV: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`[B] int64` next tokens from `logits [B, V]`: the argmax when `temperature == 0`, else a draw (from
    `generator`) of `softmax(logits / temperature)` restricted to the smallest set of most likely tokens whose
    probability reaches `top_p` (the most likely token always kept, so `top_p -> 0` is the argmax)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        # Drop a token when the more likely ones already reach top_p (the first token has 0 before it: kept).
        before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
        sorted_BV = sorted_BV.masked_fill(before_BV >= top_p, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """ValueError for `max_new_tokens < 1`, a negative temperature or `top_p` outside (0, 1]."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(
    model: DeepseekV3ForCausalLM,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    pad_token_id: int = 0,
    times: GenerationTimes | None = None,
) -> list[torch.Tensor]:
    """Continue each prompt (1-D int token ids, any lengths) of an eval-mode model.

    Args:
        max_new_tokens: the most tokens generated per sequence.
        eos_token_id: a sequence stops after generating it (it is included in the result); None: never.
        temperature: 0 = greedy (argmax), else the softmax temperature of sampling.
        top_p: nucleus sampling's probability mass (1 = the whole distribution).
        generator: the random generator of sampling (on the model's device); None = torch's global one.
        pad_token_id: what finished sequences and the prompts' right padding feed the model (never attended to by
            a live sequence's tokens).
        times: when given, this call's prefill and decode tokens and seconds are added to it.

    Returns one 1-D int64 tensor of new tokens per prompt (on the model's device). ValueError before any compute
    for bad settings, bad prompts, or a longest prompt that with `max_new_tokens` passes `max_position_embeddings`.
    """
    check_decodable(model)
    prompts = check_generation(model.config, prompts, max_new_tokens, temperature, top_p)
    device = model.embed_tokens.weight.device
    started = _now(device)
    # The last new token is returned, not fed back: it needs no cache position.
    capacity = max(p.numel() for p in prompts) + max_new_tokens - 1
    cache, logits_BV = prefill(model, prompts, capacity, pad_token_id=pad_token_id)
    B = len(prompts)
    finished_B = torch.zeros(B, dtype=torch.bool, device=logits_BV.device)
    new_tokens: list[torch.Tensor] = []
    decode_started = started
    for step in range(max_new_tokens):
        next_B = sample_next(logits_BV, temperature, top_p, generator)
        if step == 0:
            decode_started = _now(device)
        next_B = next_B.masked_fill(finished_B, pad_token_id)
        new_tokens.append(next_B)
        if eos_token_id is not None:
            finished_B = finished_B | (next_B == eos_token_id)
        if step == max_new_tokens - 1 or bool(finished_B.all()):
            break
        # Finished rows keep stepping (with padding) so the batch stays rectangular; their output is cut below.
        logits_BV = forward_with_cache(model, next_B[:, None], cache, last_only=True)
    tokens_BG = torch.stack(new_tokens, dim=1)
    out = []
    for row in tokens_BG:
        stop = row.numel()
        if eos_token_id is not None:
            hits = (row == eos_token_id).nonzero()
            stop = int(hits[0]) + 1 if hits.numel() else stop
        out.append(row[:stop].clone())
    if times is not None:
        finished = _now(device)
        times.prefill_tokens += sum(p.numel() for p in prompts)
        times.prefill_seconds += decode_started - started
        times.decode_tokens += sum(t.numel() - 1 for t in out)
        times.decode_seconds += finished - decode_started
    return out


def check_generation(
    config: DeepseekV3Config,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> list[torch.Tensor]:
    """The prompts as 1-D int64 tensors if `generate` accepts them with these settings on a model of `config`;
    ValueError otherwise (`check_sampling`, `check_prompt_ids`, or a longest prompt that with `max_new_tokens`
    passes `max_position_embeddings`). Needs no model: a caller checks its input before loading weights."""
    check_sampling(max_new_tokens, temperature, top_p)
    prompts = check_prompt_ids(config, prompts)
    longest = max(p.numel() for p in prompts)
    capacity = longest + max_new_tokens - 1
    if capacity > config.max_position_embeddings:
        raise ValueError(
            f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} needs {capacity} "
            f"positions, more than max_position_embeddings={config.max_position_embeddings}"
        )
    return prompts
