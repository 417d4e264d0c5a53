"""Token generation over the MLA cache (decode.py): greedy, or temperature + top-p (nucleus) sampling, for a batch
of prompts of different lengths; each sequence stops at `eos_token_id` or after `max_new_tokens`.

On one process, or on every rank of an expert-parallel model (each rank its own prompts; the MoE layers on the
prefill and decode dispatchers of decode_dispatch.py), optionally with the decode batch split in two micro-batches
interleaved at their MoE communications (moe/layer/interleave.py), as DeepSeek's inference overlaps them."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe.layer.interleave import Event, Interleaver
from moe.trainer.models.deepseek_v3.decode import check_decodable, check_prompt_ids, forward_with_cache, prefill
from moe.trainer.models.deepseek_v3.decode_dispatch import DecodeDispatchers, check_decode_batch
from moe.trainer.models.deepseek_v3.kv_cache import MLACache
from moe.trainer.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config

logger = logging.getLogger(__name__)


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
    logits_BV: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """`[B] int64` next tokens from `logits [B, V]`: the argmax when `temperature == 0`, else a draw (from
    `generator`, or row b from `generator[b]`) of `softmax(logits / temperature)` restricted to the smallest set of
    most likely tokens whose probability reaches `top_p` (the most likely token always kept, so `top_p -> 0` is the
    argmax)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        # Drop a token when the more likely ones already reach top_p (the first token has 0 before it: kept).
        before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
        sorted_BV = sorted_BV.masked_fill(before_BV >= top_p, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    if isinstance(generator, Sequence):
        rows = zip(probs_BV, generator, strict=True)
        return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in rows])
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """ValueError for `max_new_tokens < 1`, a negative temperature or `top_p` outside (0, 1]."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@dataclass
class DecodeTrace:
    """What the decode steps of `generate` did, for benchmarks and timelines.

    step_seconds: the wall time of each decode step (the model's forward of one new token per sequence, both halves
        with the overlap; the device synchronised at each end).
    events: per decode step with the two-micro-batch overlap, the interleaver's events (sides 'A' and 'B', see
        moe/layer/interleave.py); empty without it.
    keep_logits: also keep `logits`: the `[B, V]` logits (model dtype) of the prefill, then of every decode step
        (entry j gave each sequence's token j).
    """

    step_seconds: list[float] = field(default_factory=list)
    events: list[list[Event]] = field(default_factory=list)
    keep_logits: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)


def _reduce_over_ranks(value: int, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> int:
    """`value` reduced with `op` (MIN, MAX) over `group` (None: the value itself)."""
    if group is None:
        return value
    out = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(out, op=op, group=group)
    return int(out.item())


def decode_step(
    model: DeepseekV3ForCausalLM,
    next_B: torch.Tensor,
    cache: MLACache,
    halves: tuple[MLACache, MLACache] | None,
    interleaver: Interleaver | None,
    trace: DecodeTrace | None,
) -> torch.Tensor:
    """`[B, V]` logits (model dtype) after feeding `next_B [B] int64` at each sequence's next position of `cache`:
    one forward of the batch, or with `halves` (two `cache.rows` views splitting the batch) the two halves as two
    micro-batches interleaved by `interleaver` at their MoE communications (DeepSeek's decode overlap: while one
    half's tokens are in flight the other half runs its attention and shared expert). Appends the step's wall time
    (and events, logits) to `trace`. Expert parallel: every rank calls it, with the same `halves` setting."""
    started = _now(next_B.device)
    if halves is None:
        logits_BV = forward_with_cache(model, next_B[:, None], cache, last_only=True)
    else:
        first, second = halves
        split = first.batch
        logits_a, logits_b = interleaver.run(
            lambda: forward_with_cache(model, next_B[:split, None], first, last_only=True),
            lambda: forward_with_cache(model, next_B[split:, None], second, last_only=True),
        )
        logits_BV = torch.cat((logits_a, logits_b))
        cache.lengths = torch.cat((first.lengths, second.lengths))
    if trace is not None:
        trace.step_seconds.append(_now(next_B.device) - started)
        if interleaver is not None:
            trace.events.append(list(interleaver.events))
        if trace.keep_logits:
            trace.logits.append(logits_BV)
    return logits_BV


@torch.no_grad()
def generate(
    model: DeepseekV3ForCausalLM,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    pad_token_id: int = 0,
    times: GenerationTimes | None = None,
    dispatchers: DecodeDispatchers | None = None,
    overlap: bool = False,
    trace: DecodeTrace | None = None,
    prefill_chunk_size: int | None = None,
) -> list[torch.Tensor]:
    """Continue each prompt (1-D int token ids, any lengths) of an eval-mode model.

    Args:
        max_new_tokens: the most tokens generated per sequence.
        eos_token_id: a sequence stops after generating it (it is included in the result); None: never.
        temperature: 0 = greedy (argmax), else the softmax temperature of sampling.
        top_p: nucleus sampling's probability mass (1 = the whole distribution).
        generator: the random generator of sampling (on the model's device): one for the batch, or one per prompt
            (then a prompt's tokens depend only on its own generator, not on its batch neighbours or the layout);
            None = torch's global one.
        pad_token_id: what finished sequences and the prompts' right padding feed the model (never attended to by
            a live sequence's tokens).
        times: when given, this call's prefill and decode tokens and seconds are added to it.
        dispatchers: with an expert-parallel model, the decode steps' dispatchers (decode_dispatch.py; the prefill
            runs on the model's own). None: every phase on the model's own.
        overlap: split the batch in two halves and interleave them at every MoE communication. With fewer than 2
            prompts on some rank of the EP group the whole group runs unsplit (as SGLang's two-batch overlap does
            with a batch too small to split; the ranks keep stepping together), the same tokens as without it, and
            a warning says so.
        trace: when given, each decode step's wall time (and with `overlap` its interleaver events) is appended.
        prefill_chunk_size: run the prompts' prefill in chunks of this many positions (decode.py `prefill`);
            None: one forward.

    Expert parallelism: every rank of the model's EP group calls `generate` with its own prompts (at least one)
    and the same settings; the ranks step together until every rank's sequences are done (one all-reduce of a flag
    per step), since each step's MoE layers communicate with every rank.

    Returns one 1-D int64 tensor of new tokens per prompt (on the model's device). ValueError before any compute
    for bad settings, bad prompts, or a longest prompt that with `max_new_tokens` passes `max_position_embeddings`.
    """
    check_decodable(model)
    prompts = check_generation(model.config, prompts, max_new_tokens, temperature, top_p)
    B = len(prompts)
    if overlap and _reduce_over_ranks(B, dist.ReduceOp.MIN, model.ep_group) < 2:
        overlap = False  # every rank decides alike: the split ranks' MoE layers would communicate twice per step
        if model.ep_group is None or model.ep_group.rank() == 0:
            logger.warning("overlap: a rank's decode batch is below 2 sequences, too small to split in two "
                           "micro-batches: the decode steps run unsplit")  # fmt: skip
    if dispatchers is not None:  # before any communication: a low-latency buffer too small for this batch
        check_decode_batch(B, dispatchers.plan, overlap)
    if isinstance(generator, Sequence) and len(generator) != B:
        raise ValueError(f"{len(generator)} generators for {B} prompts: give one per prompt, or one for the batch")
    device = model.embed_tokens.weight.device
    group = model.ep_group
    started = _now(device)
    # The last new token is returned, not fed back: it needs no cache position. Expert parallel: the longest prompt
    # of all ranks sets the number of prefill chunks every rank runs (their MoE layers communicate in each).
    longest = _reduce_over_ranks(max(p.numel() for p in prompts), dist.ReduceOp.MAX, group)
    capacity = longest + max_new_tokens - 1
    num_chunks = None if prefill_chunk_size is None else -(-longest // prefill_chunk_size)
    cache, logits_BV = prefill(
        model, prompts, capacity, pad_token_id=pad_token_id, chunk_size=prefill_chunk_size, num_chunks=num_chunks
    )
    if trace is not None and trace.keep_logits:
        trace.logits.append(logits_BV)
    halves = (cache.rows(0, (B + 1) // 2), cache.rows((B + 1) // 2, B)) if overlap else None
    interleaver = Interleaver(names=("A", "B")) if overlap else None
    finished_B = torch.zeros(B, dtype=torch.bool, device=logits_BV.device)
    new_tokens: list[torch.Tensor] = []
    decode_started = started
    try:
        with dispatchers.decode() if dispatchers is not None else contextlib.nullcontext():
            for step in range(max_new_tokens):
                next_B = sample_next(logits_BV, temperature, top_p, generator)
                if step == 0:
                    decode_started = _now(device)
                next_B = next_B.masked_fill(finished_B, pad_token_id)
                new_tokens.append(next_B)
                if eos_token_id is not None:
                    finished_B = finished_B | (next_B == eos_token_id)
                if step == max_new_tokens - 1 or _reduce_over_ranks(int(finished_B.all()), dist.ReduceOp.MIN, group):
                    break
                # Finished rows keep stepping (with padding) so the batch stays rectangular; their output is cut below.
                logits_BV = decode_step(model, next_B, cache, halves, interleaver, trace)
    finally:
        if interleaver is not None:
            interleaver.close()
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
