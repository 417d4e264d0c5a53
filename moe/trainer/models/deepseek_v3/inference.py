"""What examples/deepseek_v3/generate.py does besides parsing its flags: the checks of its input against a model
directory's config before any weight is read, loading the model for cached decoding, the prompts (token ids or text
through the directory's tokenizer) and the per-prompt results.

Generation itself is generation.py's `generate`. With `--ep N` (under torchrun, N processes) every rank holds the
replicated weights and 1/N of each MoE layer's experts, and decodes its own block of the prompts: the prompts are cut
into N blocks of `ceil(P / N)` in prompt order (`rank_prompt_indices`); a rank left short decodes one-token filler
prompts so that every rank steps the same batch, and the filler's output is dropped. `check_parallel_options` checks
the whole plan against the config before any process group exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe.layer.dispatcher import EPBuffers
from moe.layer.dispatcher.flex_ll import DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK
from moe.trainer.models.deepseek_v3.decode_dispatch import (
    DecodeDispatch,
    DecodeDispatchers,
    check_decode_batch,
)
from moe.trainer.models.deepseek_v3.generation import GenerationTimes
from moe.trainer.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.model_dir import read_model_dir


def parse_prompt_ids(text: str, index: int = 0) -> list[int]:
    """`"1,2,3"` -> `[1, 2, 3]` (spaces allowed); ValueError for an empty list or a non-integer entry."""
    parts = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not part for part in parts):
        raise ValueError(f"--prompt-ids {index} ({text!r}) must be comma-separated token ids, e.g. '1,2,3'")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"--prompt-ids {index} ({text!r}) holds a non-integer token id") from None


@dataclass
class Prompts:
    """The prompts of one run, as token ids, and their texts when they were given as text (None otherwise)."""

    ids: list[list[int]]
    texts: list[str] | None


def prompts_from_input(texts: Sequence[str], id_lists: Sequence[str], tokenizer: Any | None) -> Prompts:
    """Prompts from text (`texts`, encoded with `tokenizer`, a `tokenizers.Tokenizer`) or from comma-separated id
    lists (`id_lists`); exactly one of the two non-empty. ValueError for neither, both, or an empty prompt."""
    if not texts and not id_lists:
        raise ValueError("no prompt: give --prompt TEXT or --prompt-ids '1,2,3' (each may repeat)")
    if texts and id_lists:
        raise ValueError("give --prompt or --prompt-ids, not both (their relative order would be lost)")
    if id_lists:
        return Prompts([parse_prompt_ids(text, i) for i, text in enumerate(id_lists)], None)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer")
    ids = []
    for i, text in enumerate(texts):
        encoded = tokenizer.encode(text).ids
        if not encoded:
            raise ValueError(f"--prompt {i} ({text!r}) encodes to no tokens")
        ids.append(list(encoded))
    return Prompts(ids, list(texts))


def check_parallel_options(
    config: DeepseekV3Config,
    ep: int,
    *,
    num_prompts: int,
    dtype: torch.dtype,
    fp8_dispatch: bool = False,
    overlap: bool = False,
    decode_dispatcher: str | None = None,
    num_max_dispatch_tokens_per_rank: int = DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK,
    world_size: int = 1,
) -> DecodeDispatch:
    """The resolved `DecodeDispatch` of these options; ValueError (needing only the config) for an expert-parallel
    size that is not positive, does not divide `n_routed_experts` or differs from the number of processes, a
    dispatcher plan the model dtype cannot run (decode_dispatch.py), or a per-rank decode batch above
    `num_max_dispatch_tokens_per_rank` (an overlap with fewer than two prompts per rank is no error: `generate`
    runs it unsplit)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep must be a positive int, got {ep!r}")
    if config.n_routed_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the model's n_routed_experts={config.n_routed_experts}")
    if world_size != ep:
        raise ValueError(
            f"--ep {ep} needs {ep} processes (torchrun --nproc-per-node {ep} ...), this run has {world_size}"
        )
    plan = DecodeDispatch(
        decode=decode_dispatcher, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, fp8=fp8_dispatch
    )
    if ep == 1 and decode_dispatcher is None and not fp8_dispatch:
        plan = dataclasses.replace(plan, decode="flex")  # one process: nothing travels; the model's own dispatcher
    plan = plan.resolved(dtype, config.hidden_size)
    per_rank = -(-num_prompts // ep)  # below 2 with overlap: generate runs unsplit (and says so)
    check_decode_batch(per_rank, plan, overlap)
    return plan


def rank_prompt_indices(num_prompts: int, ep: int, rank: int) -> list[int | None]:
    """The prompts rank `rank` of `ep` decodes: block `rank` of `ceil(num_prompts / ep)` consecutive indices, padded
    with None (a filler prompt) to that length, so every rank steps the same batch."""
    per_rank = -(-num_prompts // ep)
    own = list(range(rank * per_rank, min((rank + 1) * per_rank, num_prompts)))
    return own + [None] * (per_rank - len(own))


def load_for_decoding(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    ep_group: dist.ProcessGroup | None = None,
    plan: DecodeDispatch | None = None,
) -> tuple[DeepseekV3ForCausalLM, DecodeDispatchers | None]:
    """`(model, dispatchers)`: the model of a model directory or checkpoint (`read_model_dir`) in `dtype` on
    `device`, in eval mode, holding all its experts (one process) or its EP rank's share of them (`ep_group`, the
    prefill on `plan.prefill`); and the decode steps' dispatchers of the resolved `plan` (None without a plan: every
    phase on the model's own dispatcher). The model owns the dispatchers' mtdeepep buffers (`model.ep_buffers`)."""
    state_dict, config = read_model_dir(path)
    moe_options: dict[str, Any] = {}
    if plan is not None:
        moe_options["moe_token_dispatcher_type"] = plan.prefill
    if config.n_shared_experts:
        # The shared expert runs while the routed tokens are in flight (the same sum: output unchanged).
        moe_options["moe_shared_expert_overlap"] = True
    ep_buffers = EPBuffers() if plan is not None else None
    model = DeepseekV3ForCausalLM(
        config, ep_group=ep_group, ep_buffers=ep_buffers, dtype=dtype, device=device, moe_options=moe_options
    )
    model.ep_buffers = ep_buffers
    model.load_full_state_dict(state_dict)
    model.eval()
    dispatchers = DecodeDispatchers(model, plan, ep_buffers) if plan is not None else None
    return model, dispatchers


def result_records(prompts: Prompts, generated: Sequence[torch.Tensor], tokenizer: Any | None) -> list[dict]:
    """One dict per prompt, in prompt order: `prompt_ids`, `generated_ids` (lists of int), and with text prompts
    `prompt` and `continuation` (the generated ids decoded by `tokenizer`, special tokens skipped)."""
    out = []
    for b, ids in enumerate(prompts.ids):
        record: dict[str, Any] = {"prompt_ids": list(ids), "generated_ids": generated[b].tolist()}
        if prompts.texts is not None and tokenizer is not None:
            record["prompt"] = prompts.texts[b]
            record["continuation"] = tokenizer.decode(record["generated_ids"])
        out.append(record)
    return out


def merge_times(per_rank: Sequence[GenerationTimes]) -> GenerationTimes:
    """The ranks' times as one run's: tokens summed, seconds the slowest rank's (the ranks step together)."""
    return GenerationTimes(
        prefill_tokens=sum(t.prefill_tokens for t in per_rank),
        prefill_seconds=max(t.prefill_seconds for t in per_rank),
        decode_tokens=sum(t.decode_tokens for t in per_rank),
        decode_seconds=max(t.decode_seconds for t in per_rank),
    )


def timing_record(times: GenerationTimes) -> dict[str, dict[str, float | int | None]]:
    """`{"prefill": {...}, "decode": {...}}` with each phase's tokens, seconds and tokens per second."""
    return {
        "prefill": {
            "tokens": times.prefill_tokens,
            "seconds": times.prefill_seconds,
            "tokens_per_second": times.prefill_tokens_per_second,
        },
        "decode": {
            "tokens": times.decode_tokens,
            "seconds": times.decode_seconds,
            "tokens_per_second": times.decode_tokens_per_second,
        },
    }
