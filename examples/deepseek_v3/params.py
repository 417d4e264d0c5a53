"""Parameter counts of a DeepSeek-V3 config (on the meta device: nothing is allocated). Usage:

    python examples/deepseek_v3/params.py --config examples/deepseek_v3/configs/671b.toml

prints the main model's total and activated counts (DeepSeek's 671B / 37B), the MTP modules' and the checkpoint's.
"""

from __future__ import annotations

import argparse

from moe.trainer.models.deepseek_v3 import DeepseekV3Config, parameter_counts


def human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a TOML file with a [model] table")
    args = parser.parse_args()
    config = DeepseekV3Config.from_toml(args.config)
    c = parameter_counts(config)
    K, E, D = config.num_experts_per_tok, config.n_routed_experts, config.num_nextn_predict_layers
    rows = [
        ("total", c.total, f"main model: embedding, {config.num_hidden_layers} layers, final norm, output head"),
        ("activated", c.activated, f"per token: {K} of {E} routed experts, one embedding row, the output head"),
        ("", c.activated_with_embedding, "the same, counting the whole embedding table"),
        ("MTP", c.mtp_total, f"{D} MTP module(s), own parameters (embedding and head are the main model's)"),
        ("MTP act.", c.mtp_activated, "the MTP modules' parameters a token uses"),
        ("MTP stored", c.mtp_stored, "the MTP modules with the embedding and head copies the release stores"),
        ("checkpoint", c.checkpoint_total, "main + MTP as stored (FP8 block scales not counted)"),
    ]
    print(f"config: {args.config}")
    for name, n, what in rows:
        print(f"{name:<10} {human(n):>9} {n:>15,}  {what}")
    print(
        "DeepSeek-V3 publishes 671B total / 37B activated for the main model (MTP excluded), 14B for the MTP module "
        "as stored and 685B for the checkpoint on Hugging Face."
    )


if __name__ == "__main__":
    main()
