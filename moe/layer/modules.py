"""Replacing a model's submodules by new module objects that hold the same Parameter objects.

The model conversions (FP8 in `moe.layer.fp8.convert`, the zero-bubble split of weight gradients in `moe.layer.wgrad`)
change what a module computes, not what it holds: each builds a new module of the converting class around the old
module's Parameter objects (an optimizer built before still owns them; parameter names and state-dict keys stay)
and puts it where the old one was a child. `ModuleReplacements` records those replacements during a walk of the
model and installs them together afterwards, so the walk never sees a half-converted model.
"""

from __future__ import annotations

from torch import nn

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def has_module_hooks(module: nn.Module) -> bool:
    """Whether `module` has forward or backward hooks of its own (a replacement would not carry them over)."""
    return any(getattr(module, h, None) for h in _MODULE_HOOKS)


class ModuleReplacements:
    """Replacements of a model's submodules by new module objects, recorded by `add` and put in place by `install`.

    Args:
        caller: the conversion's name, for error messages (e.g. 'apply_fp8').
    """

    def __init__(self, caller: str) -> None:
        self.caller = caller
        self._new: dict[int, nn.Module] = {}  # id(old module) -> its replacement

    def add(self, name: str, old: nn.Module, new: nn.Module) -> None:
        """Record `new` as the replacement of `old`, the model's submodule `name` (checked: a child of the model,
        not the model itself; no module hooks, which would stay on the old object)."""
        if not name:
            raise ValueError(f"{self.caller} would replace the model itself (a plain {type(old).__name__}): pass a "
                             "module that contains it")  # fmt: skip
        if has_module_hooks(old):
            raise ValueError(f"{self.caller}: cannot replace {name} ({type(old).__name__}), it has module hooks")
        self._new[id(old)] = new

    def install(self, model: nn.Module) -> None:
        """Put each replacement wherever its old module is a child in `model` (a module shared by two parents in
        both)."""
        for parent in list(model.modules()):
            for key, child in list(parent._modules.items()):
                if child is not None and id(child) in self._new:
                    parent._modules[key] = self._new[id(child)]
