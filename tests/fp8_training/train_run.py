"""The short FP8 training run of the headline test: the `tiny` DeepSeek-V3 model trained with `moe.train`'s own
`Trainer.train_step` (micro-batches, MTP loss, clipping, schedule, aux-loss-free bias updates, `MasterAdamW`) on a
deterministic synthetic corpus, the same seed and data with and without FP8.

Run as a script to print the losses and timings: `python -m tests.fp8_training.train_run [steps]`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from moe.fp8_training import apply_fp8
from moe.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.models.deepseek_v3.config import DeepseekV3Config
from moe.train.config import DataConfig, TrainingConfig
from moe.train.data import TokenBatches, prepare_tokens
from moe.train.parallel import ParallelState
from moe.train.trainer import Trainer
from tests.train.train_cases import TINY, write_corpus

SEED = 1234
# 8 sequences of 64 tokens per step: a short batch so that 200 steps fit the test budget
# on 2 CPU cores (the FP8 GEMMs are emulated); tiny.toml's optimiser settings otherwise.
BATCH = dict(global_batch=8, micro_batches=1, seq_len=64)


def training_config(steps: int, corpus: Path, cache: Path) -> TrainingConfig:
    data = DataConfig(corpus=str(corpus), tokenizer="bpe", val_sequences=8, cache_dir=str(cache))
    return TrainingConfig(
        steps=steps, lr=3e-3, min_lr=3e-4, warmup_steps=10, betas=(0.9, 0.95), weight_decay=0.1, clip_grad=1.0,
        data=data, **BATCH,
    )  # fmt: skip


def train(recipe: str | None, steps: int, workdir: Path) -> dict:
    """Train `steps` steps (recipe None = unquantised FP32). Returns the per-step losses, the final held-out loss
    and the seconds taken."""
    corpus = workdir / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    config = training_config(steps, corpus, workdir / "cache")
    model_cfg = DeepseekV3Config.from_toml(TINY)
    tokens = prepare_tokens(config.data, model_cfg.vocab_size)
    batches = TokenBatches(
        tokens.tokens, seq_len=config.seq_len, global_batch=config.global_batch,
        val_sequences=config.data.val_sequences, seed=SEED,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(model_cfg)
    if recipe is not None:
        apply_fp8(model, recipe)
    trainer = Trainer(
        model, config, ParallelState.single(), batches, workdir / f"run-{recipe}", seed=SEED, model_io=None,
        mtp_loss_weight=0.3, num_mtp=model_cfg.num_nextn_predict_layers,
    )  # fmt: skip
    start = time.perf_counter()
    losses = [trainer.train_step(step)["loss"] for step in range(1, steps + 1)]
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        val = batches.val_tokens()
        val_loss = float(model(val, labels=val).loss)
    return {"losses": losses, "val_loss": val_loss, "seconds": seconds}


if __name__ == "__main__":
    torch.set_num_threads(1)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in (None, "delayed", "blockwise"):
            r = train(recipe, steps, Path(tmp))
            tail = sum(r["losses"][-20:]) / 20
            print(f"{recipe}: last {r['losses'][-1]:.4f} mean(last 20) {tail:.4f} val {r['val_loss']:.4f} "
                  f"{r['seconds']:.1f}s", flush=True)  # fmt: skip
