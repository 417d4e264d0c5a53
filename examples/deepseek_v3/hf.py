"""Convert between our checkpoint directories (model.safetensors + config.json) and Hugging Face's DeepSeek-V3 layout.

    python examples/deepseek_v3/hf.py export --checkpoint CKPT_DIR --out HF_DIR
    python examples/deepseek_v3/hf.py import --hf HF_DIR --out CKPT_DIR

export: config.json (model_type deepseek_v3, rope_parameters) and safetensors with the official per-expert keys, MTP
modules under model.layers.{num_hidden_layers + k}, tensors in their trained dtype; sharded with
model.safetensors.index.json above --max-shard-gb. transformers' DeepseekV3ForCausalLM.from_pretrained loads it.
import: what transformers' save_pretrained writes, or the official release (legacy rope_scaling, FP8 E4M3 weights with
128x128 block scales, sharded index). Dtypes are kept; FP8 weights are dequantised to --fp8-dtype (default: the
checkpoint's own dtype, that of the embedding). Missing MTP weights are initialised freshly (a message says so).
Both directions carry the end-of-text id (config.json's `eos_token_id`; export falls back on the checkpoint's
tokenizer.json `<|endoftext|>`, else writes null) and copy `tokenizer.json` when there is one.
"""

from __future__ import annotations

import argparse

import torch

from moe.trainer.models.deepseek_v3.hf import export_hf, import_hf

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="our checkpoint directory -> Hugging Face directory")
    exp.add_argument("--checkpoint", required=True, help="a model directory (model.safetensors + config.json)")
    exp.add_argument("--out", required=True, help="the Hugging Face directory to create")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="shard above this size (GiB)")
    exp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    imp = sub.add_parser("import", help="Hugging Face directory -> our checkpoint directory")
    imp.add_argument("--hf", required=True, help="a Hugging Face directory (config.json + safetensors)")
    imp.add_argument("--out", required=True, help="the model directory to create")
    imp.add_argument("--fp8-dtype", choices=sorted(DTYPES), default=None, help="dtype of dequantised FP8 weights")
    imp.add_argument("--seed", type=int, default=0, help="seed of MTP modules the checkpoint lacks")
    imp.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args()

    if args.command == "export":
        path = export_hf(
            args.checkpoint, args.out, max_shard_bytes=int(args.max_shard_gb * 1024**3), overwrite=args.overwrite
        )
        print(f"wrote {path}")
    else:
        fp8_dtype = DTYPES[args.fp8_dtype] if args.fp8_dtype else None
        config = import_hf(args.hf, args.out, fp8_dtype=fp8_dtype, seed=args.seed, overwrite=args.overwrite)
        print(f"wrote {args.out} ({config.num_hidden_layers} layers, {config.n_routed_experts} experts)")


if __name__ == "__main__":
    main()
