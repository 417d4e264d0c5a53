"""FP8 in one place: the recipes, the casts, the FP8 GEMM, the FP8 linear and grouped linear, the FP8 experts and the
converter that switches a model to them. Used by the MoE layer (`MoEConfig.fp8`) and by the DeepSeek-V3 trainer's
recipes (issue 11: per-tensor delayed scaling and DeepSeek-V3 block-wise scaling, E4M3 throughout, FP32
accumulation, FP32 master weights). The one quantiser underneath is `mtdeepep.utils.fp8.quantize_blocks`.

Modules: recipe.py (the recipes, their names, the tiles, `fp8_switches`), cast.py (E4M3 casts), gemm.py (one FP8
GEMM, real or emulated, and the one `torch._scaled_mm` probe), linear.py (the FP8 linear and the per-site caster),
grouped.py (the FP8 grouped linear and `Fp8SwiGLUExperts`), state.py (delayed-scaling amax histories), convert.py
(`Fp8Converter` / `apply_fp8`: it sits above the MoE layer, so import it as `moe.layer.fp8.convert`).

Switches. Two different things run in FP8, set by different flags that resolve through `fp8_switches(config)`:
- the expert GEMMs' recipe. `MoEConfig.fp8` (None or 'e4m3' = the block-wise recipe) makes a MoE layer build
  `Fp8SwiGLUExperts`. The trainer's `--fp8` (`Layout.fp8`: 'none', 'delayed' or 'blockwise') converts the whole
  model (`apply_fp8`: Linears, dense MLPs, shared and routed experts); it builds the model with FP8 dispatch
  (`fp8_moe_options`), since the converter never rewrites a built layer's config.
- the dispatch wire format: E4M3 tokens with 1x128 scales between ranks, the GEMMs untouched.
  `MoEConfig.moe_flex_use_fp8` for the 'flex' dispatcher (combine in high precision), `moe_flex_ll_use_fp8` for
  'flex_ll'.

Recipes (recipe.py):
- `DelayedScaling` (Transformer Engine's per-tensor recipe): one scale per tensor, from an amax history per operand
  role (input, weight, grad-output) of each GEMM site, 'max' or 'most_recent' over `amax_history_len` steps, with
  a `margin`; the first step's scale comes from the current amax. With a `tp_group` the amaxes are max-reduced over
  it, so all tensor-parallel ranks cast with one scale (state.py).
- `BlockwiseScaling` (DeepSeek-V3): activations and gradients in 1x128 tiles along the reduction dimension (weight
  gradients: along the tokens), weights in 128x128 blocks, one FP32 scale per tile from the tile itself,
  optionally rounded up to powers of two (UE8M0).
Gradients are E4M3 too in both recipes (recipe.py says why the delayed recipe does not use TE's E5M2).

What runs in FP8 (`apply_fp8`, convert.py): the forward, input-gradient and weight-gradient GEMMs of every Linear but
the output head (attention projections, MTP's `eh_proj`; tensor-parallel linears through their `linear_fn` hook),
of the dense SwiGLU MLPs and shared experts, and of the routed experts' grouped GEMMs (grouped.py). The MoE layers'
'flex' dispatcher sends E4M3 tokens with their 1x128 scales through mtdeepep and combines in high precision
(moe/layer/dispatcher/flex.py, `moe_flex_use_fp8`). What does not: embeddings, the output head, the routers (FP32),
norms, rotary embedding, the attention core (SDPA), the SwiGLU activations, the losses; those stay in the model's
dtype (BF16 or FP32). Weights stay in their dtype as master weights (FP32 with `MasterAdamW`) and are cast per use.

Emulation vs real (gemm.py): on CPU (and on a GPU whose build fails a one-time probe) an FP8 GEMM is emulated
exactly: both operands are rounded through `torch.float8_e4m3fn` with the recipe's scales (saturating at +-448 *
scale), dequantised to FP32 and multiplied in FP32, which is what FP8 tensor cores compute up to the FP32 summation
order. On CUDA `torch._scaled_mm` runs the real FP8 GEMM (per-tensor scales, or 1x128 x 128x128 block scales).

Limits: under the delayed recipe a recomputed forward (activation checkpointing: recompute levels, full-layer
recompute) records its amaxes again and may cast with a newer scale than the original forward, so its values can
differ by one E4M3 rounding (the block-wise recipe recomputes exactly: its scales come from the tensors). The amax
histories are checkpointed with each rank's state: a resume in the same layout is exact
(moe/trainer/train/checkpoint/train_state.py says how another layout merges them). Expert-parallel ranks scale their
local rows per tensor under the delayed recipe, so EP layouts differ by E4M3 roundings there.

torchao (0.18, evaluated for this): its `Float8Linear` runs forward and backward on CPU with `emulate=True`, but it
only offers dynamic scaling (delayed scaling was removed), per-tensor or row-wise (no 1x128 / 128x128 tiles outside
its CUDA/Triton `blockwise_fp8_training` prototype), E5M2 gradients by default, and it replaces the module's
forward through a tensor subclass rather than a GEMM hook that composes with our tensor-parallel linears; nothing of
it is used at run time. The tests use it as an independent reference for the first delayed step (a dynamic
per-tensor E4M3 cast) when it is installed.
"""

from moe.layer.fp8.amax_history import AmaxHistory, DelayedState, delayed_states
from moe.layer.fp8.cast import Fp8Operand, amax_to_scale, cast_blockwise, cast_per_tensor, fake_quantize
from moe.layer.fp8.gemm import probe_scaled_mm, scaled_matmul, scaled_mm_variant
from moe.layer.fp8.grouped import Fp8SwiGLUExperts, fp8_grouped_linear
from moe.layer.fp8.linear import Fp8Caster, Fp8LinearFn, fp8_linear
from moe.layer.fp8.recipe import (
    ACT_TILE,
    COL_TILE,
    FP8_FORMATS,
    FP8_RECIPES,
    WEIGHT_TILE,
    BlockwiseScaling,
    DelayedScaling,
    Fp8Recipe,
    Fp8Switches,
    fp8_switches,
    recipe_from_name,
)

__all__ = [
    "ACT_TILE",
    "COL_TILE",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "WEIGHT_TILE",
    "AmaxHistory",
    "BlockwiseScaling",
    "DelayedScaling",
    "DelayedState",
    "Fp8Caster",
    "Fp8LinearFn",
    "Fp8Operand",
    "Fp8Recipe",
    "Fp8SwiGLUExperts",
    "Fp8Switches",
    "amax_to_scale",
    "cast_blockwise",
    "cast_per_tensor",
    "delayed_states",
    "fake_quantize",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_switches",
    "recipe_from_name",
    "probe_scaled_mm",
    "scaled_matmul",
    "scaled_mm_variant",
]
