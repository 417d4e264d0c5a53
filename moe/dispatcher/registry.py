"""Dispatcher factories keyed by `MoEConfig.moe_token_dispatcher_type`.

Built in (registered by `moe.dispatcher`):
- 'alltoall': all-to-all of one row per (token, expert) slot (`moe.dispatcher.alltoall`), the baseline;
- 'allgather': every rank gathers all tokens and keeps its experts' rows (`moe.dispatcher.allgather`);
- 'flex': mtdeepep normal mode (`moe.dispatcher.deepep.DeepEPDispatcher`, DeepEP's normal kernels), the default
  for training: differentiable, any dtype, shared expert overlapped with the dispatch;
- 'flex_ll' (ours; Megatron has no name for it): mtdeepep low-latency mode
  (`moe.dispatcher.deepep_ll.DeepEPLowLatencyDispatcher`), for inference/decoding only: bfloat16 (or FP8) rows,
  at most `num_max_dispatch_tokens_per_rank` tokens per rank, shared expert overlapped through the receive hook.

Other backends plug in the same way:

    @register_dispatcher("my_backend")
    def _build(config: MoEConfig, ep_group) -> TokenDispatcher: ...

A factory takes `(config, ep_group)` and returns a `TokenDispatcher`. To pass an object the factory cannot build
itself (e.g. one `mtdeepep.Buffer` shared by every layer), build the dispatcher and give it to
`MoELayer(..., dispatcher=...)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from moe.config import MoEConfig
from moe.dispatcher.base import TokenDispatcher

DispatcherFactory = Callable[[MoEConfig, "dist.ProcessGroup | None"], TokenDispatcher]

_FACTORIES: dict[str, DispatcherFactory] = {}


def register_dispatcher(name: str, factory: DispatcherFactory | None = None, *, overwrite: bool = False):
    """Register `factory` under `name`; usable as a decorator. Re-registering a name needs `overwrite=True`."""

    def _register(fn: DispatcherFactory) -> DispatcherFactory:
        if name in _FACTORIES and not overwrite:
            raise ValueError(f"a token dispatcher named {name!r} is already registered")
        _FACTORIES[name] = fn
        return fn

    return _register if factory is None else _register(factory)


def available_dispatchers() -> list[str]:
    return sorted(_FACTORIES)


def build_dispatcher(config: MoEConfig, ep_group: dist.ProcessGroup | None = None) -> TokenDispatcher:
    """The dispatcher named by `config.moe_token_dispatcher_type`, for `ep_group` (None = single process)."""
    name = config.moe_token_dispatcher_type
    if name not in _FACTORIES:
        raise ValueError(
            f"no token dispatcher registered as {name!r} (available: {available_dispatchers()}); "
            "register one with moe.dispatcher.register_dispatcher"
        )
    return _FACTORIES[name](config, ep_group)
