"""The FP8 recipes (the settings only; the arithmetic is in cast.py and gemm.py), their names, the tiles, and the one
function that reads the FP8 switches of a `MoEConfig` (`fp8_switches`).

Both recipes use E4M3 (`torch.float8_e4m3fn`, max 448, 3 mantissa bits) for every operand of every GEMM, the
gradients included. Transformer Engine's per-tensor "HYBRID" format sends gradients in E5M2 (2 mantissa bits, range
up to 57344) because one scale per tensor must cover a gradient's whole dynamic range; we keep E4M3 for the
gradients of the delayed recipe too, as the issue asks, and rely on the amax history (with `margin`) for range: a
gradient value above the history's amax saturates at 448 * scale instead of overflowing. The block-wise recipe
needs E5M2 even less: a 1x128 tile only has to cover the range of 128 values (DeepSeek-V3 uses E4M3 throughout).

This module imports nothing of `moe` (moe/layer/moe_config.py imports its name lists).
"""

from __future__ import annotations

from dataclasses import dataclass

from mtdeepep.utils.fp8 import FP8_BLOCK

# Tiles of the block-wise recipe, `(rows, cols)` of one scale (`mtdeepep.utils.fp8.quantize_blocks`).
ACT_TILE = (1, FP8_BLOCK)  # one scale per row per 128 columns (columns = the reduction dimension)
WEIGHT_TILE = (FP8_BLOCK, FP8_BLOCK)
COL_TILE = (FP8_BLOCK, 1)  # one scale per column per 128 rows (rows = the reduction dimension)

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor delayed scaling (Transformer Engine's `DelayedScaling`, E4M3 for all three operand roles).

    Each FP8 GEMM operand role (input, weight, grad-output) of a module keeps the amaxes of its last
    `amax_history_len` steps. The scale of a step comes from that history (not from the tensor being cast):
    `scale = amax * 2**margin / 448` with `amax` the history's maximum ('max') or its newest entry ('most_recent');
    the tensor's own amax is then appended. On the very first step the history is empty and the scale is taken
    from the current amax (so step 1 is a dynamic per-tensor cast). Values beyond `448 * scale` saturate.

    Args:
        amax_history_len: steps of amax history kept per role (>= 1).
        margin: extra headroom as a power of two (>= 0): the scale is multiplied by `2**margin`.
        amax_compute_algo: 'max' or 'most_recent'.
    """

    amax_history_len: int = 16
    margin: int = 0
    amax_compute_algo: str = "max"

    name = "delayed"

    def __post_init__(self) -> None:
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, got {self.amax_compute_algo!r}")


@dataclass(frozen=True)
class BlockwiseScaling:
    """DeepSeek-V3 block-wise scaling: activations and gradients in 1x128 tiles along the GEMM's reduction dimension
    (weight gradients: 1x128 / 128x1 along the tokens), weights in 128x128 blocks, one FP32 scale per tile computed
    from the tile itself (`scale = amax / 448`), FP32 accumulation.

    Args:
        power_of_two_scales: round every scale up to a power of two (UE8M0-representable, as DeepSeek-V3.1's
            `scale_fmt='ue8m0'`): the dequantisation is then exact in any float format, at a cost of up to one bit
            of the E4M3 range (a tile's largest value lands in (224, 448]).
    """

    power_of_two_scales: bool = False

    name = "blockwise"
    act_tile = ACT_TILE
    weight_tile = WEIGHT_TILE

    def __post_init__(self) -> None:
        if not isinstance(self.power_of_two_scales, bool):
            raise ValueError(f"power_of_two_scales must be a bool, got {self.power_of_two_scales!r}")


Fp8Recipe = DelayedScaling | BlockwiseScaling

# The one table of recipe names. The trainer's `--fp8` / `Layout.fp8` take a recipe name or 'none';
# `MoEConfig.fp8` takes a format name that stands for a recipe with its default settings.
RECIPES = {"delayed": DelayedScaling, "blockwise": BlockwiseScaling}
FP8_RECIPES = ("none", *RECIPES)
FORMAT_RECIPES = {"e4m3": "blockwise"}  # MoEConfig.fp8: DeepSeek-V3's block-wise E4M3 expert GEMMs
FP8_FORMATS = (None, *FORMAT_RECIPES)


def recipe_from_name(name: str, **options) -> Fp8Recipe:
    """`'delayed'` or `'blockwise'` (the trainer's `--fp8` values) with that recipe's options."""
    if name not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {tuple(RECIPES)}, got {name!r}")
    return RECIPES[name](**options)


@dataclass(frozen=True)
class Fp8Switches:
    """What a MoE layer runs in FP8 (see the package docstring for the flags behind each field).

    Attributes:
        experts: the routed experts' GEMM recipe, or None (GEMMs in the weights' dtype).
        flex_dispatch: the 'flex' dispatcher (`FlexDispatcher`) sends E4M3 tokens with 1x128 scales.
        flex_ll_dispatch: the 'flex_ll' dispatcher (`FlexLowLatencyDispatcher`) sends E4M3 payloads.
    """

    experts: Fp8Recipe | None
    flex_dispatch: bool
    flex_ll_dispatch: bool


def fp8_switches(config) -> Fp8Switches:
    """The FP8 settings of a MoE layer, from its `MoEConfig` (`fp8`, `moe_flex_use_fp8`, `moe_flex_ll_use_fp8`):
    the one place the layer, its experts and its dispatchers read them."""
    recipe = None if config.fp8 is None else recipe_from_name(FORMAT_RECIPES[config.fp8])
    return Fp8Switches(recipe, bool(config.moe_flex_use_fp8), bool(config.moe_flex_ll_use_fp8))
