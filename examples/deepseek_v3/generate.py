"""Generate text with a DeepSeek-V3 checkpoint: cached (MLA latent) decoding on one process.

    python examples/deepseek_v3/generate.py --checkpoint RUN_DIR/checkpoints/step_N --prompt "def " \
        --max-new-tokens 64 --greedy
    python examples/deepseek_v3/generate.py --checkpoint MODEL_DIR --prompt-ids "1,2,3" --prompt-ids "4,5" \
        --temperature 0.8 --top-p 0.95 --seed 0 --output-json out.json

`--checkpoint`: a train.py checkpoint (RUN_DIR/checkpoints/step_N) or a model directory (hf.py import, the trainer's
export): whatever evaluate.py reads. Text prompts are encoded and continuations decoded with the directory's
`tokenizer.json`; `--prompt-ids` needs none. Each sequence stops after its end-of-text token (config.json's
`eos_token_id`, else the tokenizer's `<|endoftext|>`) or `--max-new-tokens`. Without `--temperature` (or with 0)
decoding is greedy. Printed: each prompt and its continuation, then the prefill and decode tokens/s.
`--output-json`: per prompt, in prompt order, `prompt_ids` and `generated_ids` (plus the texts for text prompts),
and the timings. `--ep N > 1`, `--fp8-dispatch` and `--overlap` (expert-parallel decode on the low-latency
dispatcher) are not implemented yet and are refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe.models.deepseek_v3.generation import GenerationTimes, check_generation, generate  # noqa: E402
from moe.models.deepseek_v3.inference import (  # noqa: E402
    check_parallel_options,
    load_for_decoding,
    prompts_from_input,
    result_records,
    timing_record,
)
from moe.models.deepseek_v3.model_dir import check_model_dir, read_config  # noqa: E402
from moe.models.deepseek_v3.tokenizer import eos_token_id, load_tokenizer  # noqa: E402

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
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generator (default 0)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameters and activations")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (only 1 is implemented yet)")
    p.add_argument("--fp8-dispatch", action="store_true", help="FP8 token dispatch (not implemented yet)")
    p.add_argument("--overlap", action="store_true", help="overlap dispatch with compute (not implemented yet)")
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
    try:  # every check before a weight is read
        check_model_dir(args.checkpoint)
        config = read_config(args.checkpoint)
        check_parallel_options(config, args.ep, args.fp8_dispatch, args.overlap)
        temperature, top_p, seed = sampling_settings(args)
        tokenizer = load_tokenizer(args.checkpoint) if args.prompt and not args.prompt_ids else None
        prompts = prompts_from_input(args.prompt, args.prompt_ids, tokenizer)
        check_generation(config, prompts.ids, args.max_new_tokens, temperature, top_p)
        eos = eos_token_id(args.checkpoint)
    except ValueError as exc:
        print(f"generate.py: error: {exc}", file=sys.stderr)
        return 2
    model = load_for_decoding(args.checkpoint, DTYPES[args.dtype], device)
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    times = GenerationTimes()
    generated = generate(
        model,
        [torch.tensor(ids, device=device) for ids in prompts.ids],
        args.max_new_tokens,
        eos_token_id=eos,
        temperature=temperature,
        top_p=top_p,
        generator=generator,
        times=times,
    )
    records = result_records(prompts, generated, tokenizer)
    for b, record in enumerate(records):
        print(f"--- prompt {b}: {record.get('prompt', record['prompt_ids'])!r}")
        print(f"--- continuation {b} ({len(record['generated_ids'])} tokens):")
        print(record.get("continuation", record["generated_ids"]))
    timing = timing_record(times)
    for phase, t in timing.items():
        rate = "n/a" if t["tokens_per_second"] is None else f"{t['tokens_per_second']:.1f}"
        print(f"{phase}: {t['tokens']} tokens in {t['seconds']:.3f} s, {rate} tokens/s")
    if args.output_json:
        doc = {
            "checkpoint": str(args.checkpoint),
            "dtype": args.dtype,
            "device": str(device),
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


if __name__ == "__main__":
    sys.exit(main())
