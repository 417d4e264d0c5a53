"""pytest-benchmark canary of one cached decode step (generation.py `decode_step`: 8 sequences, one token each,
absorbed MLA over the latent cache, the MoE layers, the head) of the tiny test config on one process, FP32 and BF16:
a slowdown of the decode path shows in the benchmark table. The expert-parallel comparison of dispatchers and the
overlap is `bench/decode.py`.

Each case also checks what the rounds did: every step advanced every sequence's cache by one position and gave
finite logits."""

from __future__ import annotations

import pytest
import torch

from moe.trainer.models.deepseek_v3 import DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.decode import prefill
from moe.trainer.models.deepseek_v3.generation import DecodeTrace, decode_step

from .dsv3_testlib import tiny_config

pytest.importorskip("pytest_benchmark")
pytestmark = pytest.mark.timeout(120)

BATCH, PROMPT, ROUNDS, WARMUP = 8, 12, 20, 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_step_benchmark(benchmark, dtype):
    config = tiny_config()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (PROMPT,), generator=gen) for _ in range(BATCH)]
    cache, logits = prefill(model, prompts, PROMPT + ROUNDS + WARMUP)
    trace = DecodeTrace()
    state = {"next": logits.argmax(-1)}

    def step():
        state["next"] = decode_step(model, state["next"], cache, None, None, trace).argmax(-1)

    with torch.no_grad():
        benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
    assert torch.equal(cache.lengths, torch.full((BATCH,), PROMPT + ROUNDS + WARMUP))
    assert len(trace.step_seconds) == ROUNDS + WARMUP and bool(torch.isfinite(logits).all())
