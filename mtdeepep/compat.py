"""Opt-in `deep_ep` alias: make `import deep_ep` resolve to mtdeepep, for code that names DeepEP's package.

Megatron-core (`from deep_ep import Buffer`, `from deep_ep.utils import EventHandle, EventOverlap`) and torchtitan
(`from deep_ep import ElasticBuffer`) import DeepEP by name. Rather than editing them, call once, before they are
imported:

    import mtdeepep.compat
    mtdeepep.compat.install_deep_ep_alias()

This registers, in `sys.modules`, small modules holding mtdeepep's objects under DeepEP's names:

- `deep_ep`: `Buffer`, `Config`, `EventOverlap`, `EventHandle`, `topk_idx_t` (DeepEP V1 and V2) and
  `ElasticBuffer`, `EPHandle` (DeepEP V2, from `mtdeepep.elastic`);
- `deep_ep.utils`: `EventOverlap`, `EventHandle`, `check_nvlink_connections` (V1's `deep_ep/utils.py`);
- `deep_ep.utils.event`: `EventOverlap`, `EventHandle` (V2's `deep_ep/utils/event.py`).

Nothing else is aliased: a name DeepEP has and mtdeepep does not (e.g. `HybridEPBuffer`) stays missing, so
`from deep_ep import HybridEPBuffer` raises ImportError as on an install without it, and clients that probe for
optional features take their fallback. The objects are mtdeepep's own (`deep_ep.Buffer is mtdeepep.Buffer`).
It refuses to shadow a `deep_ep` that is already imported and is not this alias (a real DeepEP).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import mtdeepep

from . import elastic, utils
from .utils import event

ALIAS_NAME = "deep_ep"
_MARK = "__mtdeepep_alias__"


def _module(name: str, doc: str, names: dict[str, object]) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    # A package with no search path: registered submodules resolve, any other one is a clean ImportError.
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__all__ = sorted(names)
    setattr(module, _MARK, True)
    for key, value in names.items():
        setattr(module, key, value)
    return module


def _alias_modules() -> dict[str, types.ModuleType]:
    top = _module(
        ALIAS_NAME,
        "mtdeepep under DeepEP's package name (mtdeepep.compat.install_deep_ep_alias).",
        {
            "Buffer": mtdeepep.Buffer,
            "Config": mtdeepep.Config,
            "EventOverlap": event.EventOverlap,
            "EventHandle": event.EventHandle,
            "topk_idx_t": mtdeepep.topk_idx_t,
            "ElasticBuffer": elastic.ElasticBuffer,
            "EPHandle": elastic.EPHandle,
        },
    )
    utils_module = _module(
        f"{ALIAS_NAME}.utils",
        "mtdeepep.utils under DeepEP's name.",
        {name: getattr(utils, name) for name in ("EventOverlap", "EventHandle", "check_nvlink_connections")},
    )
    event_module = _module(
        f"{ALIAS_NAME}.utils.event",
        "mtdeepep.utils.event under DeepEP V2's name.",
        {"EventOverlap": event.EventOverlap, "EventHandle": event.EventHandle},
    )
    top.utils = utils_module
    utils_module.event = event_module
    return {m.__name__: m for m in (top, utils_module, event_module)}


def is_deep_ep_alias_installed() -> bool:
    """True when `deep_ep` in `sys.modules` is this alias."""
    return getattr(sys.modules.get(ALIAS_NAME), _MARK, False)


def install_deep_ep_alias() -> types.ModuleType:
    """Register the `deep_ep` alias modules and return the top one. Idempotent.

    Raises RuntimeError if a `deep_ep` module that is not this alias is already imported (it would be shadowed
    for later importers but not for modules that already hold it).
    """
    existing = sys.modules.get(ALIAS_NAME)
    if existing is not None:
        if getattr(existing, _MARK, False):
            return existing
        raise RuntimeError(
            f"mtdeepep: a real `{ALIAS_NAME}` ({getattr(existing, '__file__', existing)!r}) is already imported; "
            "install the alias before anything imports DeepEP, or use that DeepEP"
        )
    modules = _alias_modules()
    sys.modules.update(modules)
    return modules[ALIAS_NAME]


def uninstall_deep_ep_alias() -> None:
    """Remove the alias modules from `sys.modules` (modules that already imported names from it keep them)."""
    for name in [n for n in sys.modules if n == ALIAS_NAME or n.startswith(f"{ALIAS_NAME}.")]:
        if getattr(sys.modules[name], _MARK, False):
            del sys.modules[name]
