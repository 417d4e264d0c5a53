"""Dispatcher factories keyed by `MoEConfig.moe_token_dispatcher_type`.

Built in (registered by `moe.layer.dispatcher`):
- 'alltoall': all-to-all of one row per (token, expert) slot (`moe.layer.dispatcher.alltoall`), the baseline;
- 'allgather': every rank gathers all tokens and keeps its experts' rows (`moe.layer.dispatcher.allgather`);
- 'flex': mtdeepep normal mode (`moe.layer.dispatcher.flex.FlexDispatcher`, DeepEP's normal kernels), the default
  for training: differentiable, any dtype, shared expert overlapped with the dispatch;
- 'flex_ll' (ours; Megatron has no name for it): mtdeepep low-latency mode
  (`moe.layer.dispatcher.flex_ll.FlexLowLatencyDispatcher`), for inference/decoding only: bfloat16 (or FP8) rows,
  at most `num_max_dispatch_tokens_per_rank` tokens per rank, shared expert overlapped through the receive hook.

Other backends plug in the same way. A name is looked up where the dispatcher is built (`build_dispatcher`, called
by `MoELayer` before any communication), not when a `MoEConfig` is made: a config holds any name, and a layer
built from it needs that name registered by then:

    @register_dispatcher("my_backend")
    def _build(config: MoEConfig, ep_group, ep_buffers) -> TokenDispatcher: ...

A factory takes `(config, ep_group, ep_buffers)` and returns a `TokenDispatcher`: `ep_group` is None for a single
process; `ep_buffers` is the caller's `moe.layer.dispatcher.buffers.EPBuffers` for the mtdeepep buffers the layers
share, or None (mtdeepep dispatchers then use the group's default). To pass anything else a factory cannot build itself,
build the dispatcher and give it to `MoELayer(..., dispatcher=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from moe.layer.dispatcher.base import TokenDispatcher

if TYPE_CHECKING:
    from moe.layer.dispatcher.buffers import EPBuffers
    from moe.layer.moe_config import MoEConfig

DispatcherFactory = Callable[["MoEConfig", "dist.ProcessGroup | None", "EPBuffers | None"], TokenDispatcher]

_FACTORIES: dict[str, DispatcherFactory] = {}


def register_dispatcher(name: str, factory: DispatcherFactory | None = None, *, overwrite: bool = False):
    """Register `factory` under `name`; usable as a decorator. Re-registering a name needs `overwrite=True`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a token dispatcher name must be a non-empty str, got {name!r}")

    def _register(fn: DispatcherFactory) -> DispatcherFactory:
        if name in _FACTORIES and not overwrite:
            raise ValueError(f"a token dispatcher named {name!r} is already registered")
        _FACTORIES[name] = fn
        return fn

    return _register if factory is None else _register(factory)


def unregister_dispatcher(name: str) -> None:
    """Remove the factory registered under `name` (KeyError if there is none)."""
    del _FACTORIES[name]


def available_dispatchers() -> list[str]:
    """The registered names, sorted."""
    return sorted(_FACTORIES)


def check_dispatcher_name(name: object) -> None:
    """ValueError, listing the registered names, if no dispatcher is registered as `name`."""
    if name not in _FACTORIES:
        raise ValueError(
            f"moe_token_dispatcher_type={name!r} names no registered token dispatcher (registered: "
            f"{available_dispatchers()}); register one with moe.layer.dispatcher.register_dispatcher"
        )


def build_dispatcher(
    config: MoEConfig, ep_group: dist.ProcessGroup | None = None, ep_buffers: EPBuffers | None = None
) -> TokenDispatcher:
    """The dispatcher named by `config.moe_token_dispatcher_type`, for `ep_group` (None = single process), taking
    its mtdeepep buffer from `ep_buffers` (None: the group's default)."""
    name = config.moe_token_dispatcher_type
    check_dispatcher_name(name)
    dispatcher = _FACTORIES[name](config, ep_group, ep_buffers)
    if not isinstance(dispatcher, TokenDispatcher):
        raise TypeError(f"the factory of {name!r} returned {type(dispatcher).__name__}, not a TokenDispatcher")
    return dispatcher
