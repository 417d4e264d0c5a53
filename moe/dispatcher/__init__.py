"""Token dispatchers behind one interface (`TokenDispatcher`), built by name from `MoEConfig`."""

from moe.dispatcher.allgather import AllGatherDispatcher, build_allgather
from moe.dispatcher.alltoall import AllToAllDispatcher, build_alltoall
from moe.dispatcher.base import DispatchResult, TokenDispatcher
from moe.dispatcher.registry import available_dispatchers, build_dispatcher, register_dispatcher

register_dispatcher("alltoall", build_alltoall, overwrite=True)
register_dispatcher("allgather", build_allgather, overwrite=True)

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DispatchResult",
    "TokenDispatcher",
    "available_dispatchers",
    "build_dispatcher",
    "register_dispatcher",
]
