"""Cases run inside every rank of a rank pool (test_dsv3_ep_decode.py): expert-parallel generation of a model
directory, the prompts cut into the ranks' blocks as generate.py cuts them (`rank_prompt_indices`).

Every rank returns the same gathered result (all collectives run before any assertion in the parent): the generated
ids of every prompt in prompt order, and per prompt the logits of every step (prefill's last position, then each
decode step's) when asked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.trainer.models.deepseek_v3.decode_dispatch import DecodeDispatch
from moe.trainer.models.deepseek_v3.generation import DecodeTrace, generate
from moe.trainer.models.deepseek_v3.inference import load_for_decoding, rank_prompt_indices
from tests.models.dsv3_testlib import rel_err

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _gather(obj, group):
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _in_prompt_order(parts) -> list:
    by_index = dict(pair for part in parts for pair in part)
    return [by_index[i] for i in range(len(by_index))]


def generate_case(ctx, model_dir: str, prompts: list[list[int]], new: int, dtype: str, decode: str | None,
                  fp8: bool, overlap: bool, with_logits: bool, check_full_forward: bool = False,
                  prefill_chunk_size: int | None = None) -> dict:  # fmt: skip
    """`{"ids": [...], "logits": [[V] float32 per step] per prompt or None, "plan": (prefill, decode, fp8),
    "full_forward_rel_err": float or None, "step_events": int}`.

    `check_full_forward`: after generating, run the model's training forward (the 'flex' dispatcher, no cache) on
    each of this rank's whole sequences and return the largest relative difference of its logits from the cached
    steps' (max |diff| / max |logit| per sequence)."""
    group = ctx.group if ctx is not None else None
    world, rank = (ctx.world_size, ctx.rank) if ctx is not None else (1, 0)
    plan = DecodeDispatch(decode=decode, fp8=fp8).resolved(DTYPES[dtype])
    model, dispatchers = load_for_decoding(model_dir, DTYPES[dtype], "cpu", ep_group=group, plan=plan)
    indices = rank_prompt_indices(len(prompts), world, rank)
    mine = [torch.tensor(prompts[i] if i is not None else [0]) for i in indices]
    trace = DecodeTrace(keep_logits=with_logits or check_full_forward)
    out = generate(model, mine, new, dispatchers=dispatchers, overlap=overlap, trace=trace,
                   prefill_chunk_size=prefill_chunk_size)  # fmt: skip
    logits = None
    if trace.keep_logits:  # [steps] of [B, V] -> per row [steps, V]
        logits = torch.stack(trace.logits, dim=1).float()
    worst = None
    if check_full_forward:
        worst = 0.0
        with torch.no_grad():
            for b, (prompt, gen) in enumerate(zip(mine, out, strict=True)):
                seq = torch.cat((prompt, gen[:-1]))[None]
                full = model(seq).logits[0, prompt.numel() - 1 :].float()
                cached = logits[b, : full.size(0)]
                worst = max(worst, rel_err(cached, full))
    own = [
        (i, (g.tolist(), None if logits is None else logits[b, : g.numel()]))
        for b, (i, g) in enumerate(zip(indices, out, strict=True))
        if i is not None
    ]
    parts = _gather(own, group)
    worst_all = _gather(worst, group)
    model.ep_buffers.destroy()
    ordered = _in_prompt_order(parts)
    return {
        "ids": [ids for ids, _ in ordered],
        "logits": [lg for _, lg in ordered] if logits is not None else None,
        "plan": (plan.prefill, plan.decode, plan.fp8),
        "full_forward_rel_err": None if worst is None else max(worst_all),
        "step_events": len(trace.events),
    }
