"""The model-FLOPs count (moe/trainer/models/deepseek_v3/flops.py) against torch's FLOP counter on the real model.

`torch.utils.flop_counter.FlopCounterMode` counts the matrix products the model dispatches, forward and backward
apart. It knows `mm` / `addmm` / `bmm` and the CUDA attention kernels, not the two CPU ops this model runs on, so
they are registered here: `_grouped_mm` (the routed experts' grouped GEMM; 2 x rows x K x M from its operands'
shapes, so the count follows the rows the experts really received) and SDPA's CPU flash kernel and its backward
(torch's own `sdpa_flop_count` / `sdpa_backward_flop_count`, which its CUDA kernels use). Every dispatched op whose
name says it multiplies matrices must be one the counter knows (else the profiler would miss work silently).

Where the profiler and the model-FLOPs convention differ, by design, the test states the difference exactly rather
than a tolerance:
- the weight products (Linear layers, experts, router, heads, eh_proj) must agree to the FLOP, forward and backward
  (the backward is 2x the forward: the convention holds for them exactly);
- the attention core: torch's SDPA formulas count the full S x S square (no causal mask), on the value columns v is
  padded to (Dq, attention.py), and the backward as FlashAttention runs it: 5 products (the scores recomputed) where
  the forward has 2, 2.5x. The model count takes the causal (S + 1) / 2 keys per query, Dv value columns and a 2x
  backward. Both figures come from `attention_core_flops`, so the difference of the totals is checked to the FLOP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.flops import forward_flops, model_flops_per_token

TINY = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "configs" / "tiny.toml"
aten = torch.ops.aten


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """`_grouped_mm`: `x [N, K] @ w [G, K, M]` (groups along N: forward and input gradient) or `x^T [K, N] @ g [N, M]`
    (groups along N: the weight gradient, `[G, K, M]`): 2 x K x N x M either way."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    raise AssertionError(f"unexpected _grouped_mm operands {a_shape} x {b_shape}")


def _sdpa_cpu_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _sdpa_cpu_backward_flop(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


CPU_OPS = {
    aten._grouped_mm: _grouped_mm_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}
SDPA_OPS = {aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward}
PRODUCT_WORDS = ("mm", "matmul", "linear", "attention", "conv", "dot", "einsum")


class _ProductOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dispatched ops whose names say they multiply matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(word in name for word in PRODUCT_WORDS):
            self.seen.add(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def _split(counter: FlopCounterMode) -> tuple[int, int]:
    """`(weight products, attention core)` of a counter's global counts."""
    counts = counter.get_flop_counts()["Global"]
    core = sum(v for op, v in counts.items() if op in SDPA_OPS)
    return sum(counts.values()) - core, core


def _config(changes: dict) -> DeepseekV3Config:
    return DeepseekV3Config.from_dict({**DeepseekV3Config.from_toml(TINY).to_dict(), **changes})


ALL_MOE = dict(first_k_dense_replace=0, n_shared_experts=0, num_nextn_predict_layers=0, tie_word_embeddings=True)


@pytest.mark.parametrize(
    ("changes", "S"),
    [
        ({}, 128),  # tiny itself at its training length: q LoRA, one dense layer, one MTP depth
        ({"q_lora_rank": None, "attention_bias": True, "num_nextn_predict_layers": 2}, 64),  # plain q_proj, biases
        (ALL_MOE, 64),  # no dense layer, no shared expert, no MTP, the head tied to the embedding
    ],
    ids=["tiny", "no-q-lora-bias-mtp2", "all-moe-no-shared-no-mtp-tied"],
)
def test_flops_match_the_profiler(changes, S):
    config = _config(changes)
    B = 2
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (B, S))

    def loss_of(out):
        return out.loss + sum(out.mtp_loss_sums)

    loss_of(model(ids, labels=ids)).backward()  # warm-up: the grouped-GEMM probe runs (and multiplies) once
    model.zero_grad(set_to_none=True)
    spy = _ProductOps()
    with spy, FlopCounterMode(display=False, custom_mapping=CPU_OPS) as fwd:
        loss = loss_of(model(ids, labels=ids))
    with spy, FlopCounterMode(display=False, custom_mapping=CPU_OPS) as bwd:
        loss.backward()
    known = set(fwd.flop_registry)
    assert spy.seen <= known, f"matrix products the counter does not count: {spy.seen - known}"

    # The routed experts got exactly K rows per token (dropless top-K): what the formula counts.
    K, D = config.num_experts_per_tok, config.num_nextn_predict_layers
    positions = [S] * sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    positions += [S - k for k in range(1, D + 1) if config.is_moe_layer(config.num_hidden_layers + k - 1)]
    rows = [int(layer.metrics.tokens_per_expert.sum()) for layer in model.moe_layers()]
    assert rows == [B * p * K for p in positions]

    tokens = B * S
    model_fwd = forward_flops(config, S)
    profiled_fwd = forward_flops(config, S, causal=False, padded_values=True)  # the core as torch's formulas count
    fwd_gemms, fwd_core = _split(fwd)
    bwd_gemms, bwd_core = _split(bwd)
    assert fwd_gemms == tokens * model_fwd.gemms
    assert bwd_gemms == 2 * fwd_gemms
    assert fwd_core == tokens * profiled_fwd.attention_core
    assert bwd_core == 2.5 * fwd_core  # v padded to Dq: 5 products of q/k/v width in backward, 2 in forward
    profiled = fwd.get_total_flops() + bwd.get_total_flops()
    modelled = tokens * model_flops_per_token(config, S)
    assert profiled - modelled == tokens * (3.5 * profiled_fwd.attention_core - 3 * model_fwd.attention_core)


def test_tiny_figures():
    """tiny at its 128 positions: 21.6 MFLOP per token, 93% of it the weight products (tests/plan checks 671B)."""
    config = DeepseekV3Config.from_toml(TINY)
    fwd = forward_flops(config, 128)
    assert model_flops_per_token(config, 128) == 3 * fwd.total == pytest.approx(21.64e6, rel=1e-3)
    assert fwd.gemms / fwd.total == pytest.approx(0.93, abs=0.01)
