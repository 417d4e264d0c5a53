"""Token dispatchers behind one interface (`TokenDispatcher`), built by name from `MoEConfig`.

'flex' (`moe.dispatcher.deepep.DeepEPDispatcher`, on mtdeepep) is imported on first use, so the other dispatchers
work without the compiled extension.
"""

from moe.dispatcher.allgather import AllGatherDispatcher, build_allgather
from moe.dispatcher.alltoall import AllToAllDispatcher, build_alltoall
from moe.dispatcher.base import DispatchResult, TokenDispatcher
from moe.dispatcher.registry import available_dispatchers, build_dispatcher, register_dispatcher

register_dispatcher("alltoall", build_alltoall, overwrite=True)
register_dispatcher("allgather", build_allgather, overwrite=True)


def _build_flex(config, ep_group) -> TokenDispatcher:
    from moe.dispatcher.deepep import build_deepep

    return build_deepep(config, ep_group)


register_dispatcher("flex", _build_flex, overwrite=True)

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DispatchResult",
    "TokenDispatcher",
    "available_dispatchers",
    "build_dispatcher",
    "register_dispatcher",
]
