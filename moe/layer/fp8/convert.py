"""`Fp8Converter` / `apply_fp8(model, recipe)`: switch a model's eligible GEMMs to FP8 under one recipe, keeping every
parameter object, parameter name and state-dict key.

The converter walks the model (as torchtitan's `QuantizationConverter`) and replaces modules with new module objects
that hold the same Parameter objects (an optimizer built before still owns them), or sets the GEMM hook of those whose
class already honours it. Eligible, and what they become:
- every `nn.Linear` (and subclass: the tensor-parallel linears) except the output head gets a `linear_fn`
  (`Fp8LinearFn`, per the issue-11 contract: the module computes `self.linear_fn(x, self.weight, self.bias)`);
  a plain `nn.Linear`, whose forward ignores `linear_fn`, is replaced by an `Fp8Linear` (a subclass whose forward
  calls it). In DeepSeek-V3: the attention projections (`qkv_a_proj`, `q_b_proj`, `kv_b_proj`, `o_proj`, ...) and
  the MTP modules' `eh_proj`.
- every `moe.layer.experts.SwiGLUMLP` (the dense MLP layers and the MoE layers' shared experts; weights `w13 [H, 2F]`,
  `w2 [F, H]`, not Linears) gets `Fp8LinearFn`s in its `linear_fns` GEMM hook (a plain one is replaced by an
  `Fp8SwiGLUMLP`).
- every `moe.MoELayer`'s routed experts are replaced by `Fp8SwiGLUExperts` under the same recipe.
The dispatch wire format is not the converter's: it is chosen when the model is built (`MoEConfig.moe_flex_use_fp8`,
DeepSeek-V3's `moe_options`; `fp8_moe_options(recipe)` gives the trainer's choice), so no config is rewritten
after the fact. The conversion reports which MoE layers dispatch in FP8 and which in high precision.
Untouched: embeddings, the output head (`lm_head`, or any Linear sharing the model's `output_weight`), the MoE
routers (float32 gates, not Linears), norms, rotary tables and the attention core (SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moe.layer.experts import SwiGLUMLP
from moe.layer.fp8.grouped import Fp8SwiGLUExperts
from moe.layer.fp8.linear import Fp8LinearFn
from moe.layer.fp8.recipe import BlockwiseScaling, DelayedScaling, Fp8Recipe, fp8_switches, recipe_from_name
from moe.layer.modules import ModuleReplacements
from moe.layer.moe_layer import MoELayer
from moe.layer.wgrad import SplitWgradLinear

HEAD_NAMES = ("lm_head",)


class Fp8Linear(SplitWgradLinear):
    """`nn.Linear` whose GEMM is `self.linear_fn` (`moe.layer.wgrad.linear`, i.e. F.linear, if absent); same parameters
    and state-dict keys. Its class marks the conversion to FP8."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, linear_fn: Fp8LinearFn) -> Fp8Linear:
        """An `Fp8Linear` holding `linear`'s Parameter objects, computing with `linear_fn`."""
        new = super().from_linear(linear)
        new.linear_fn = linear_fn
        return new


class Fp8SwiGLUMLP(SwiGLUMLP):
    """A plain `SwiGLUMLP` converted to FP8 (its class marks the conversion; the GEMMs go through the `linear_fns`
    hook every `SwiGLUMLP` honours, so subclasses such as the tensor-parallel MLP are converted by the hook alone)."""

    linear_fns: dict[str, Fp8LinearFn]

    @classmethod
    def from_mlp(cls, mlp: SwiGLUMLP, linear_fns: dict[str, Fp8LinearFn]) -> Fp8SwiGLUMLP:
        """An `Fp8SwiGLUMLP` holding `mlp`'s Parameter objects and recompute setting, computing with `linear_fns`."""
        hidden, ffn = mlp.w2.shape[1], mlp.w2.shape[0]
        new = cls(hidden, ffn, dtype=mlp.w13.dtype, device="meta")
        new.w13, new.w2 = mlp.w13, mlp.w2
        new.recompute = mlp.recompute
        new.linear_fns = linear_fns
        return new.train(mlp.training)


@dataclass
class Fp8Conversion:
    """What `apply_fp8` switched (module names)."""

    recipe: Fp8Recipe
    linears: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    fp8_dispatch: list[str] = field(default_factory=list)  # MoE layers whose config sends FP8 tokens
    high_precision_dispatch: list[str] = field(default_factory=list)  # the others (model built without FP8 dispatch)


def _output_weight(model: nn.Module) -> torch.Tensor | None:
    weight = getattr(model, "output_weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


class Fp8Converter:
    """Converts models to FP8 GEMMs under one recipe (see the module docstring).

    Args:
        recipe: a `DelayedScaling` / `BlockwiseScaling`, or 'delayed' / 'blockwise' with default settings.
        tp_group: the tensor-parallel group: delayed scaling max-reduces the Linears' amaxes over it (all TP ranks
            use one scale per tensor). Routed experts are not reduced over it.
    """

    def __init__(self, recipe: Fp8Recipe | str, *, tp_group: dist.ProcessGroup | None = None) -> None:
        if isinstance(recipe, str):
            recipe = recipe_from_name(recipe)
        if not isinstance(recipe, (DelayedScaling, BlockwiseScaling)):
            raise ValueError(f"recipe must be DelayedScaling, BlockwiseScaling or its name, got {recipe!r}")
        self.recipe = recipe
        self.tp_group = tp_group

    def convert(self, model: nn.Module) -> Fp8Conversion:
        """Convert `model` in place (its submodules are replaced; `model` itself is kept, so it must not be a plain
        `nn.Linear` or `SwiGLUMLP`). Call once, before or after building the optimizer."""
        # moe.layer.moe_layer builds its experts from this package (MoEConfig.fp8): imported at call time, not at
        # import.
        if any(hasattr(m, "linear_fns") or hasattr(m, "linear_fn") for m in model.modules()):
            raise ValueError("apply_fp8: the model already has FP8 GEMMs (apply_fp8 was called before)")
        out = Fp8Conversion(self.recipe)
        head = _output_weight(model)
        replacements = ModuleReplacements("apply_fp8")
        for name, module in list(model.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear):
                if leaf in HEAD_NAMES or (head is not None and module.weight is head):
                    continue
                linear_fn = Fp8LinearFn(self.recipe, self.tp_group)
                if type(module) is nn.Linear:
                    replacements.add(name, module, Fp8Linear.from_linear(module, linear_fn))
                else:  # a subclass whose forward already calls `linear_fn` (the tensor-parallel linears)
                    module.linear_fn = linear_fn
                out.linears.append(name)
            elif isinstance(module, SwiGLUMLP):  # the dense MLP (plain or tensor parallel) and shared experts
                fns = {"w13": Fp8LinearFn(self.recipe, self.tp_group), "w2": Fp8LinearFn(self.recipe, self.tp_group)}
                if type(module) is SwiGLUMLP:
                    replacements.add(name, module, Fp8SwiGLUMLP.from_mlp(module, fns))
                else:
                    module.linear_fns = fns
                out.mlps.append(name)
            elif isinstance(module, MoELayer):
                experts_name = f"{name}.experts" if name else "experts"
                fp8_experts = Fp8SwiGLUExperts.from_experts(module.experts, self.recipe)
                replacements.add(experts_name, module.experts, fp8_experts)
                out.experts.append(experts_name)
                switches = fp8_switches(module.config)
                if switches.flex_dispatch or switches.flex_ll_dispatch:
                    out.fp8_dispatch.append(name)
                else:
                    out.high_precision_dispatch.append(name)
        replacements.install(model)
        return out


def fp8_moe_options(recipe: Fp8Recipe | str | None) -> dict[str, bool]:
    """The `MoEConfig` fields (DeepSeek-V3's `moe_options`) of a model that `apply_fp8` will convert under `recipe`
    (None or 'none': no conversion): its 'flex' dispatcher sends E4M3 tokens with 1x128 scales, as DeepSeek-V3
    trains. Chosen when the model is built; `apply_fp8` itself never changes the dispatch."""
    return {"moe_flex_use_fp8": recipe not in (None, "none")}


def apply_fp8(
    model: nn.Module,
    recipe: Fp8Recipe | str,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> Fp8Conversion:
    """Convert `model`'s eligible GEMMs to FP8 under `recipe` (in place; see the module docstring and
    `Fp8Converter` for the arguments). Returns an `Fp8Conversion` listing what was converted."""
    return Fp8Converter(recipe, tp_group=tp_group).convert(model)
