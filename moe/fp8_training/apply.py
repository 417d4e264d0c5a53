"""`apply_fp8(model, recipe)`: switch a model's eligible GEMMs to FP8, in place, keeping every parameter object,
parameter name and state-dict key.

Eligible, and what they become:
- every `nn.Linear` (and subclass: the tensor-parallel linears) except the output head gets a `linear_fn`
  (`Fp8LinearFn`, per the issue-11 contract: the module computes `self.linear_fn(x, self.weight, self.bias)`);
  a plain `nn.Linear`, whose forward ignores `linear_fn`, is switched to `Fp8Linear` (a subclass whose forward
  calls it). In DeepSeek-V3: the attention projections (`qkv_a_proj`, `q_b_proj`, `kv_b_proj`, `o_proj`, ...) and
  the MTP modules' `eh_proj`.
- every `moe.experts.SwiGLUMLP` (the dense MLP layers and the MoE layers' shared experts; weights `w13 [H, 2F]`,
  `w2 [F, H]`, not Linears) gets `Fp8LinearFn`s in its `linear_fns` GEMM hook (a plain one also becomes
  `Fp8SwiGLUMLP`).
- every `moe.MoELayer`'s routed experts switch to FP8 grouped GEMMs under the same recipe (`to_fp8_experts`), and a
  'flex' dispatcher sends FP8 tokens with their 1x128 scales (`moe_flex_use_fp8`), combining in high precision.
Untouched: embeddings, the output head (`lm_head`, or any Linear sharing the model's `output_weight`), the MoE
routers (float32 gates, not Linears), norms, rotary tables and the attention core (SDPA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moe.dispatcher.deepep import DeepEPDispatcher
from moe.experts import SwiGLUMLP
from moe.fp8_training.experts import to_fp8_experts
from moe.fp8_training.linear import Fp8LinearFn
from moe.fp8_training.recipe import BlockwiseScaling, DelayedScaling, Fp8Recipe, recipe_from_name
from moe.layer import MoELayer
from moe.wgrad import SplitWgradLinear

HEAD_NAMES = ("lm_head",)


class Fp8Linear(SplitWgradLinear):
    """`nn.Linear` whose GEMM is `self.linear_fn` (`moe.wgrad.linear`, i.e. F.linear, if absent); same parameters
    and state-dict keys. Its class marks the switch to FP8."""


class Fp8SwiGLUMLP(SwiGLUMLP):
    """A plain `SwiGLUMLP` switched to FP8 (its class marks the switch; the GEMMs go through the `linear_fns` hook
    every `SwiGLUMLP` honours, so subclasses such as the tensor-parallel MLP are switched by the hook alone)."""

    linear_fns: dict[str, Fp8LinearFn]


@dataclass
class Fp8Conversion:
    """What `apply_fp8` switched (module names)."""

    recipe: Fp8Recipe
    linears: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    fp8_dispatch: list[str] = field(default_factory=list)
    high_precision_dispatch: list[str] = field(default_factory=list)  # MoE layers whose dispatcher has no FP8 mode


def _output_weight(model: nn.Module) -> torch.Tensor | None:
    weight = getattr(model, "output_weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def apply_fp8(
    model: nn.Module,
    recipe: Fp8Recipe | str,
    *,
    tp_group: dist.ProcessGroup | None = None,
    fp8_dispatch: bool = True,
) -> Fp8Conversion:
    """Switch `model`'s eligible GEMMs to FP8 under `recipe` (in place; see the module docstring).

    Args:
        model: any module tree (a `DeepseekV3ForCausalLM`, a `MoELayer`, ...). Call once, before or after building
            the optimizer (parameters are not replaced).
        recipe: a `DelayedScaling` / `BlockwiseScaling`, or 'delayed' / 'blockwise' with default settings.
        tp_group: the tensor-parallel group: delayed scaling max-reduces the Linears' amaxes over it (all TP ranks
            use one scale per tensor). Routed experts are not reduced over it.
        fp8_dispatch: make the MoE layers' 'flex' dispatchers send FP8 tokens (DeepSeek-V3). Layers on other
            dispatchers keep their high-precision dispatch (listed in the result).
    Returns an `Fp8Conversion` listing what was switched.
    """
    if isinstance(recipe, str):
        recipe = recipe_from_name(recipe)
    if not isinstance(recipe, (DelayedScaling, BlockwiseScaling)):
        raise ValueError(f"recipe must be DelayedScaling, BlockwiseScaling or its name, got {recipe!r}")
    if any(hasattr(m, "linear_fns") or hasattr(m, "linear_fn") for m in model.modules()):
        raise ValueError("apply_fp8: the model already has FP8 GEMMs (apply_fp8 was called before)")
    out = Fp8Conversion(recipe)
    head = _output_weight(model)
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            if leaf in HEAD_NAMES or (head is not None and module.weight is head):
                continue
            module.linear_fn = Fp8LinearFn(recipe, tp_group)
            if type(module) is nn.Linear:
                module.__class__ = Fp8Linear
            out.linears.append(name)
        elif isinstance(module, SwiGLUMLP):  # the dense MLP (plain or tensor parallel) and shared experts
            if type(module) is SwiGLUMLP:
                module.__class__ = Fp8SwiGLUMLP
            module.linear_fns = {"w13": Fp8LinearFn(recipe, tp_group), "w2": Fp8LinearFn(recipe, tp_group)}
            out.mlps.append(name)
        elif isinstance(module, MoELayer):
            to_fp8_experts(module.experts, recipe)
            out.experts.append(f"{name}.experts" if name else "experts")
            if fp8_dispatch and isinstance(module.dispatcher, DeepEPDispatcher):
                if module.config.hidden_size % 128:
                    raise ValueError(f"FP8 dispatch needs hidden_size % 128 == 0, got {module.config.hidden_size}")
                module.dispatcher.use_fp8 = True
                module.config = dataclasses.replace(module.config, moe_flex_use_fp8=True)
                out.fp8_dispatch.append(name)
            else:
                out.high_precision_dispatch.append(name)
    return out
