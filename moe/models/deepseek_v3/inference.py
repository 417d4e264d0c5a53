"""What examples/deepseek_v3/generate.py does besides parsing its flags: the checks of its input against a model
directory's config before any weight is read, loading the model for cached decoding, the prompts (token ids or text
through the directory's tokenizer) and the per-prompt results.

Generation itself is generation.py's `generate` (single process). Expert-parallel decode on the low-latency
dispatcher, FP8 dispatch and overlap are later work: `check_parallel_options` refuses them with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe.models.deepseek_v3.config import DeepseekV3Config
from moe.models.deepseek_v3.generation import GenerationTimes
from moe.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moe.models.deepseek_v3.model_dir import read_model_dir


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


def check_parallel_options(config: DeepseekV3Config, ep: int, fp8_dispatch: bool, overlap: bool) -> None:
    """ValueError for an expert-parallel size that is not positive or does not divide `n_routed_experts`, then
    for any of the options single-process decoding does not implement yet (`ep > 1`, FP8 dispatch, overlap)."""
    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    if config.n_routed_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the model's n_routed_experts={config.n_routed_experts}")
    later = [
        name
        for name, used in (
            (f"--ep {ep} (expert-parallel decode on the low-latency dispatcher)", ep > 1),
            ("--fp8-dispatch", fp8_dispatch),
            ("--overlap", overlap),
        )
        if used
    ]
    if later:
        raise ValueError(f"not implemented yet: {', '.join(later)}; decoding runs on one process (--ep 1)")


def load_for_decoding(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> DeepseekV3ForCausalLM:
    """The model of a model directory or checkpoint (`read_model_dir`) with all its experts, in `dtype` on
    `device`, in eval mode (what `generate` needs)."""
    state_dict, config = read_model_dir(path)
    model = DeepseekV3ForCausalLM(config, dtype=dtype, device=device)
    model.load_full_state_dict(state_dict)
    return model.eval()


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
