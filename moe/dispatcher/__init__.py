"""Token dispatchers behind one interface (`TokenDispatcher`), built by name from `MoEConfig`.

'flex' (`moe.dispatcher.deepep.DeepEPDispatcher`, mtdeepep normal mode, training and inference) and 'flex_ll'
(`moe.dispatcher.deepep_ll.DeepEPLowLatencyDispatcher`, mtdeepep low-latency mode, inference/decoding only) are
imported on first use, so the other dispatchers work without the compiled extension. Their mtdeepep buffers come
from an `EPBuffers` (`moe.dispatcher.buffers`) shared by the layers of a model.
"""

from moe.dispatcher.allgather import AllGatherDispatcher, build_allgather
from moe.dispatcher.alltoall import AllToAllDispatcher, build_alltoall
from moe.dispatcher.base import DispatchResult, TokenDispatcher
from moe.dispatcher.buffers import EPBuffers
from moe.dispatcher.registry import (
    available_dispatchers,
    build_dispatcher,
    check_dispatcher_name,
    register_dispatcher,
    unregister_dispatcher,
)

register_dispatcher("alltoall", build_alltoall, overwrite=True)
register_dispatcher("allgather", build_allgather, overwrite=True)


def _build_flex(config, ep_group, ep_buffers) -> TokenDispatcher:
    from moe.dispatcher.deepep import build_deepep

    return build_deepep(config, ep_group, ep_buffers)


def _build_flex_ll(config, ep_group, ep_buffers) -> TokenDispatcher:
    from moe.dispatcher.deepep_ll import build_deepep_ll

    return build_deepep_ll(config, ep_group, ep_buffers)


register_dispatcher("flex", _build_flex, overwrite=True)
register_dispatcher("flex_ll", _build_flex_ll, overwrite=True)

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DispatchResult",
    "EPBuffers",
    "TokenDispatcher",
    "available_dispatchers",
    "build_dispatcher",
    "check_dispatcher_name",
    "register_dispatcher",
    "unregister_dispatcher",
]
