"""Import Megatron-core's and torchtitan's DeepEP code, unmodified, in a CPU-only process with mtdeepep as `deep_ep`.

Only the environment around the clients is arranged; none of their code is patched:

- `import deep_ep` resolves to mtdeepep through the opt-in alias (`mtdeepep.compat.install_deep_ep_alias`).
- Megatron-core imports Triton at module level for kernels unrelated to DeepEP (e.g. the MoE paged-stash kernels
  in `megatron/core/transformer/moe/ops/paged_stash.py`, imported by `megatron.core`'s package `__init__`), and
  Triton has no CPU wheel. A tiny fake `triton` module (decorators that return the function, placeholder `tl.*`
  types, version 0) is placed in `sys.modules` only while Megatron is imported, and removed afterwards.
  PyTorch's compiler stack is loaded first, so PyTorch's own Triton probes have already seen that there is no
  Triton.
- Megatron decorates e.g. `MoEFlexTokenDispatcher.dispatch_preprocess` with `torch.compile` (its `jit_fuser`);
  compiling needs a C++ toolchain and minutes per shape on this CPU, so TorchDynamo is disabled
  (`torch._dynamo.config.disable`): the decorated functions run eagerly, with the same semantics.
- torchtitan registers its `deepep::dispatch` / `deepep::combine` custom ops for the CUDA dispatch key only; the
  same Python functions are registered for the CPU key as well (`torch.library.impl(..., "CPU")`).
- torchtitan's `torchtitan.distributed` package `__init__` needs `spmd_types` and torchtitan's config needs
  `tyro` (with `docstring-parser`, `typeguard`): small pure-Python packages installed by scripts/env.sh with
  `--no-deps`, so `torchtitan.distributed.deepep.deepep` is imported normally.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch
import torch._dynamo

from mtdeepep.compat import install_deep_ep_alias


def _fake_jit(fn=None, **_options):
    """`triton.jit` / `triton.autotune(...)` / `triton.heuristics(...)` stand-in: keep the Python function (never
    launched on CPU; calling it as a kernel (`fn[grid](...)`) fails loudly with a TypeError)."""
    if fn is None or not callable(fn):
        return lambda f: f
    return fn


def _placeholder_type(name: str) -> type:
    if name.startswith("_"):
        raise AttributeError(name)
    return type(name, (), {})


def _identity(x):
    return x


@contextlib.contextmanager
def _fake_triton():
    if "triton" in sys.modules:  # a real Triton: nothing to fake
        yield
        return
    triton = types.ModuleType("triton", "Fake Triton for importing Megatron on CPU (tests/clients/clients_env.py).")
    language = types.ModuleType("triton.language")
    language.constexpr = type("constexpr", (), {})
    # Kernel signatures annotate arguments with Triton dtypes (`tl.int32`, ...): any other name is a placeholder.
    language.__getattr__ = _placeholder_type
    # Version 0: modules that check the version (e.g. megatron/core/fusions/fused_indices_converter.py) then treat
    # Triton as unusable on a CPU-only machine and take their PyTorch paths.
    triton.__version__ = "0.0.0"
    triton.jit = triton.autotune = triton.heuristics = _fake_jit
    triton.Config = lambda *args, **kwargs: (args, kwargs)
    triton.cdiv = lambda a, b: (a + b - 1) // b
    triton.language = language
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    try:
        yield
    finally:
        for name in ("triton", "triton.language"):
            sys.modules.pop(name, None)


def prepare_megatron() -> types.SimpleNamespace:
    """Import Megatron-core's DeepEP path; returns its modules (`fused_a2a`, `token_dispatcher`, ...)."""
    install_deep_ep_alias()
    torch._dynamo.config.disable = True
    # Decorating with torch.compile loads PyTorch's compiler stack, which probes for Triton too: load it once
    # before the fake exists, so PyTorch keeps seeing no Triton.
    torch.compile(_identity)
    with _fake_triton():
        fused_a2a = importlib.import_module("megatron.core.transformer.moe.fused_a2a")
        token_dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
        transformer_config = importlib.import_module("megatron.core.transformer.transformer_config")
        process_groups = importlib.import_module("megatron.core.process_groups_config")
    assert fused_a2a.HAVE_DEEP_EP, "Megatron did not find deep_ep (the alias)"
    return types.SimpleNamespace(
        fused_a2a=fused_a2a,
        token_dispatcher=token_dispatcher,
        TransformerConfig=transformer_config.TransformerConfig,
        ProcessGroupCollection=process_groups.ProcessGroupCollection,
    )


def import_megatron(name: str) -> types.ModuleType:
    """Import one Megatron-core module by name (e.g. `megatron.core.datasets.indexed_dataset`) on this CPU-only
    machine: PyTorch's compiler stack first, then the module with the fake Triton in place (see above)."""
    torch.compile(_identity)
    with _fake_triton():
        return importlib.import_module(name)


_CPU_REGISTERED: set[str] = set()


def prepare_torchtitan() -> types.ModuleType:
    """Import torchtitan's DeepEP V2 module and register its custom ops' implementations for the CPU key."""
    install_deep_ep_alias()
    deepep = importlib.import_module("torchtitan.distributed.deepep.deepep")
    for op_name, impl in (("dispatch", deepep._dispatch_op_impl), ("combine", deepep._combine_op_impl)):
        if op_name not in _CPU_REGISTERED:
            torch.library.impl(deepep._lib, op_name, "CPU")(impl)
            _CPU_REGISTERED.add(op_name)
    return deepep
