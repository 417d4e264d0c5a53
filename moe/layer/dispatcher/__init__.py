"""Token dispatchers behind one interface (`TokenDispatcher`), built by name from `MoEConfig`.

'flex' (`moe.layer.dispatcher.flex.FlexDispatcher`, mtdeepep normal mode, training and inference) and 'flex_ll'
(`moe.layer.dispatcher.flex_ll.FlexLowLatencyDispatcher`, mtdeepep low-latency mode, inference/decoding only) take
their mtdeepep buffers from an `EPBuffers` (`moe.layer.dispatcher.buffers`) shared by the layers of a model.
"""

from moe.layer.dispatcher.allgather import AllGatherDispatcher, build_allgather
from moe.layer.dispatcher.alltoall import AllToAllDispatcher, build_alltoall
from moe.layer.dispatcher.base import DispatchResult, TokenDispatcher
from moe.layer.dispatcher.buffers import EPBuffers
from moe.layer.dispatcher.flex import build_flex
from moe.layer.dispatcher.flex_ll import build_flex_ll
from moe.layer.dispatcher.registry import (
    available_dispatchers,
    build_dispatcher,
    check_dispatcher_name,
    register_dispatcher,
    unregister_dispatcher,
)

register_dispatcher("alltoall", build_alltoall, overwrite=True)
register_dispatcher("allgather", build_allgather, overwrite=True)
register_dispatcher("flex", build_flex, overwrite=True)
register_dispatcher("flex_ll", build_flex_ll, overwrite=True)

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
