"""Generate text with a DeepSeek-V3 checkpoint: cached (MLA latent) decoding, on one process or expert-parallel.

Usage: examples/deepseek_v3/generate.py, the command line that runs `main`.

`--checkpoint`: a train.py checkpoint (RUN_DIR/checkpoints/step_N) or a model directory (hf.py import, the trainer's
export): whatever evaluate.py reads. Text prompts are encoded and continuations decoded with the directory's
`tokenizer.json`; `--prompt-ids` needs none. Each sequence stops after its end-of-text token (config.json's
`eos_token_id`, else the tokenizer's `<|endoftext|>`) or `--max-new-tokens`. Without `--temperature` (or with 0)
decoding is greedy; sampling draws each prompt's tokens from its own generator (seeded `seed + prompt index`), so
a seed gives the same text at every `--ep`. Printed: each prompt and its continuation, then the prefill and decode
tokens/s (all ranks' tokens over the slowest rank's time).
`--output-json`: per prompt, in prompt order, `prompt_ids` and `generated_ids` (plus the texts for text prompts),
and the timings.

Expert parallelism (`--ep N` under torchrun, N processes, gloo): each rank holds the replicated weights and 1/N of
every MoE layer's experts and decodes a block of the prompts (moe/trainer/models/deepseek_v3/inference.py). The prompts'
prefill dispatches on normal mode ('flex'); the decode steps on the low-latency kernels ('flex_ll', bfloat16 rows,
or with `--fp8-dispatch` E4M3 rows with 1x128 scales; the combine sums in FP32). The low-latency kernels move no
float32, so a float32 model decodes on 'flex' (`--decode-dispatcher` picks another). `--overlap` splits each rank's
batch in two micro-batches interleaved at their MoE communications (a batch below 2 per rank runs unsplit, and
says so); `--timeline PATH` draws the last step.
`--chunked-prefill-size N` runs the prompts' prefill N positions at a time (its attention scores and MoE rows stay
bounded for long prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe.layer.dispatcher.flex_ll import DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK
from moe.trainer.models.deepseek_v3 import decode_timeline
from moe.trainer.models.deepseek_v3.decode_dispatch import DECODE_DISPATCHERS
from moe.trainer.models.deepseek_v3.generation import (
    DecodeTrace,
    GenerationTimes,
    check_generation,
    generate,
)
from moe.trainer.models.deepseek_v3.inference import (
    check_parallel_options,
    load_for_decoding,
    merge_times,
    prompts_from_input,
    rank_prompt_indices,
    result_records,
    timing_record,
)
from moe.trainer.models.deepseek_v3.model_dir import check_model_dir, read_config
from moe.trainer.models.deepseek_v3.model_tokens import eos_token_id, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a train.py checkpoint or a model directory")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="a prompt as token ids '1,2,3' (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per prompt")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default without --temperature)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling's probability mass (default 1)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generators (default 0)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameters and activations")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (torchrun --nproc-per-node N)")
    p.add_argument("--fp8-dispatch", action="store_true", help="decode steps send E4M3 rows with 1x128 scales")
    p.add_argument("--overlap", action="store_true", help="two micro-batches interleaved at the MoE communications")
    p.add_argument("--decode-dispatcher", default=None, choices=DECODE_DISPATCHERS,
                   help="the decode steps' dispatcher (default: flex_ll in bfloat16, flex in float32)")  # fmt: skip
    p.add_argument("--num-max-dispatch-tokens-per-rank", type=int, default=DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK,
                   help="flex_ll's buffer bound on the tokens a rank dispatches per decode call")  # fmt: skip
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prefill in chunks of this many positions (bounds its memory; default: one chunk)")  # fmt: skip
    p.add_argument("--timeline", default=None, help="with --overlap: write PATH.png and PATH.json of the last step")
    p.add_argument("--output-json", default=None, help="write the prompts' and generated ids here")
    return p.parse_args(argv)


def sampling_settings(args: argparse.Namespace) -> tuple[float, float, int | None]:
    """`(temperature, top_p, seed)`; seed None for greedy decoding."""
    if args.greedy and (args.temperature is not None or args.top_p is not None or args.seed is not None):
        raise ValueError("--greedy takes no --temperature, --top-p or --seed")
    if args.temperature is None and (args.top_p is not None or args.seed is not None):
        raise ValueError("--top-p and --seed need --temperature T (sampling); without it decoding is greedy")
    temperature = args.temperature or 0.0
    top_p = 1.0 if args.top_p is None else args.top_p
    return temperature, top_p, (None if temperature == 0 else (0 if args.seed is None else args.seed))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # every check before a weight is read or a process group exists
        check_model_dir(args.checkpoint)
        config = read_config(args.checkpoint)
        temperature, top_p, seed = sampling_settings(args)
        tokenizer = load_tokenizer(args.checkpoint) if args.prompt and not args.prompt_ids else None
        prompts = prompts_from_input(args.prompt, args.prompt_ids, tokenizer)
        check_generation(config, prompts.ids, args.max_new_tokens, temperature, top_p)
        plan = check_parallel_options(
            config,
            args.ep,
            num_prompts=len(prompts.ids),
            dtype=DTYPES[args.dtype],
            fp8_dispatch=args.fp8_dispatch,
            overlap=args.overlap,
            decode_dispatcher=args.decode_dispatcher,
            num_max_dispatch_tokens_per_rank=args.num_max_dispatch_tokens_per_rank,
            world_size=world_size,
        )
        if args.chunked_prefill_size is not None and args.chunked_prefill_size < 1:
            raise ValueError(f"--chunked-prefill-size must be >= 1, got {args.chunked_prefill_size}")
        if args.timeline and not args.overlap:
            raise ValueError("--timeline draws the overlapped decode step: it needs --overlap")
        eos = eos_token_id(args.checkpoint)
    except ValueError as exc:
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    group, rank = None, 0
    if args.ep > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        group, rank = dist.group.WORLD, dist.get_rank()
    try:
        return _run(args, prompts, plan, group, rank, device, eos, tokenizer, temperature, top_p, seed)
    finally:
        if group is not None:
            dist.destroy_process_group()


def _run(args, prompts, plan, group, rank, device, eos, tokenizer, temperature, top_p, seed) -> int:
    model, dispatchers = load_for_decoding(args.checkpoint, DTYPES[args.dtype], device, ep_group=group, plan=plan)
    indices = rank_prompt_indices(len(prompts.ids), args.ep, rank)
    # Filler prompts (None) keep every rank's batch the same size; one pad token each, their output dropped.
    mine = [prompts.ids[i] if i is not None else [0] for i in indices]
    generators = None
    if seed is not None:  # one generator per prompt, seeded by its index: the same text whatever --ep
        generators = [torch.Generator(device).manual_seed(seed + (i if i is not None else 0)) for i in indices]
    times, trace = GenerationTimes(), DecodeTrace()
    generated = generate(
        model,
        [torch.tensor(ids, device=device) for ids in mine],
        args.max_new_tokens,
        eos_token_id=eos,
        temperature=temperature,
        top_p=top_p,
        generator=generators,
        times=times,
        dispatchers=dispatchers,
        overlap=args.overlap,
        trace=trace,
        prefill_chunk_size=args.chunked_prefill_size,
    )
    own = [(i, g.cpu()) for i, g in zip(indices, generated, strict=True) if i is not None]
    fillers = [g for i, g in zip(indices, generated, strict=True) if i is None]
    times.prefill_tokens -= len(fillers)  # a filler's one token, and its decode tokens, are not the user's
    times.decode_tokens -= sum(g.numel() - 1 for g in fillers)
    parts, rank_times, rank_events = [own], [times], [trace.events[-1] if trace.events else []]
    if group is not None:
        parts, rank_times, rank_events = (_gather(x, group) for x in (own, times, rank_events[0]))
    if model.ep_buffers is not None:
        model.ep_buffers.destroy()
    if rank != 0:
        return 0
    by_index = dict(pair for part in parts for pair in part)
    records = result_records(prompts, [by_index[i] for i in range(len(prompts.ids))], tokenizer)
    for b, record in enumerate(records):
        print(f"--- prompt {b}: {record.get('prompt', record['prompt_ids'])!r}")
        print(f"--- continuation {b} ({len(record['generated_ids'])} tokens):")
        print(record.get("continuation", record["generated_ids"]))
    timing = timing_record(merge_times(rank_times))
    for phase, t in timing.items():
        rate = "n/a" if t["tokens_per_second"] is None else f"{t['tokens_per_second']:.1f}"
        print(f"{phase}: {t['tokens']} tokens in {t['seconds']:.3f} s, {rate} tokens/s")
    layout = f"ep {args.ep}: prefill on {plan.prefill}, decode on {plan.decode}{' (fp8)' if plan.fp8 else ''}"
    overlap = ", two micro-batches overlapped" if trace.events else ", unsplit (a rank's batch is below 2)"
    print(f"{layout}{overlap if args.overlap else ''}")
    if args.timeline and all(rank_events):
        title = f"decode step, ep {args.ep}, {plan.decode}"
        decode_timeline.plot_step(args.timeline + ".png", rank_events, title)
        decode_timeline.write_chrome_trace(args.timeline + ".json", rank_events, {"decode": plan.decode})
        print(f"timeline of the last decode step: {args.timeline}.png, {args.timeline}.json")
    if args.output_json:
        doc = {
            "checkpoint": str(args.checkpoint),
            "dtype": args.dtype,
            "device": str(device),
            "ep": args.ep,
            "prefill_dispatcher": plan.prefill,
            "decode_dispatcher": plan.decode,
            "fp8_dispatch": plan.fp8,
            "overlap": args.overlap,
            "eos_token_id": eos,
            "max_new_tokens": args.max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "results": records,
            **timing,
        }
        Path(args.output_json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


if __name__ == "__main__":
    sys.exit(main())
