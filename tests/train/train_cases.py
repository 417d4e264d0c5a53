"""Helpers of the end-to-end training tests: test configs (tiny's model, a short batch, a small synthetic corpus)
and the target that runs train.py's command (`moe.trainer.run.main`) as one rank of a torchrun-like job."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import tomli_w
import tomllib
import torch

from moe.trainer import run
from moe.trainer.models.deepseek_v3 import generate_cli
from moe.trainer.train.training_config import split_moved

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "deepseek_v3" / "configs" / "tiny.toml"
WORDS = [
    "def", "return", "self", "import", "class", "for", "in", "if", "else", "value", "items", "(", ")", ":", "=",
    "while", "try", "except", "None", "True", "False", "x", "y", "0", "1", "+", "-", "*",
]  # fmt: skip


# examples/deepseek_v3/<name>.py -> the module whose `main` the command line runs
COMMANDS = {"train": run, "generate": generate_cli}


def write_corpus(root: Path, num_files: int = 24, lines: int = 300, seed: int = 0) -> Path:
    """Python-looking text with structure a tiny model can learn (repeated idioms), deterministic."""
    rng = random.Random(seed)
    idioms = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(40)]
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        body = [f"{' ' * 4 * rng.randint(0, 2)}{rng.choice(idioms)}" for _ in range(lines)]
        (root / f"m{i:03d}.py").write_text("\n".join(body) + "\n")
    return root


def _without_none(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` without its None values (a None in a case's changes leaves the key out of the file)."""
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in doc.items() if v is not None}


def make_config(path: Path, corpus: Path, cache: Path, *, model: dict | None = None, training: dict | None = None,
                data: dict | None = None) -> Path:  # fmt: skip
    """tiny's [model] (with `model` changes) and short trainer tables at `path`: `training` changes any trainer key
    by name (`lr`, `use_distributed_optimizer`, `log_straggler`, ...: each written into its own table)."""
    with TINY.open("rb") as f:
        model_table = tomllib.load(f)["model"]
    model_table.update(model or {})
    flat = {
        "steps": 8, "global_batch": 8, "micro_batches": 2, "seq_len": 32, "lr": 3e-3, "min_lr": 3e-4,
        "warmup_steps": 2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "clip_grad": 1.0,
        "dtype": "float32", "checkpoint_every": 4, "log_every": 4,
        **(training or {}),
        "data": {"corpus": str(corpus), "tokenizer": "bpe", "val_sequences": 8, "cache_dir": str(cache),
                 **(data or {})},
    }  # fmt: skip
    tables, _ = split_moved({"training": flat})
    path.write_text(tomli_w.dumps(_without_none({"model": model_table, **tables})))
    return path


def torchrun_rank(proc, argv: list[str], script: str = "train") -> int:
    """One rank of `<script>.py argv` (an example job) with torchrun's environment (rendezvous on the launcher's
    port)."""
    os.environ.update(
        RANK=str(proc.rank), LOCAL_RANK=str(proc.rank), WORLD_SIZE=str(proc.num_processes),
        LOCAL_WORLD_SIZE=str(proc.num_processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(proc.port),
        GLOO_SOCKET_IFNAME="lo", MTDEEPEP_TIMEOUT_S="60",
    )  # fmt: skip
    torch.set_num_threads(1)
    sys.argv = [f"{script}.py", *argv]
    code = COMMANDS[script].main(argv)
    if code != 0:
        raise RuntimeError(f"{script}.py exited with {code}")
    return code


def torchrun_rank_with_faults(proc, argv: list[str], faults: str) -> int:
    """`torchrun_rank` with the fault plan `faults` (JSON, moe/trainer/train/faults.py) in the rank's environment."""
    from moe.trainer.train.faults import ENV

    os.environ[ENV] = faults
    return torchrun_rank(proc, argv)
