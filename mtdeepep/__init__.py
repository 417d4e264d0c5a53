"""mtdeepep: DeepEP-compatible expert-parallel communication (`import mtdeepep as deep_ep`)."""

import atexit
import threading

import torch

from ._C import (
    CommError,
    CommTimeoutError,
    EventHandle,
    GroupMismatchError,
    cleanup_stale_segments,
    shutdown_all_runtimes,
)
from ._checks import skip_value_checks
from .autograd import combine, dispatch
from .buffer import Buffer
from .config import Config
from .elastic import ElasticBuffer, EPHandle  # DeepEP V2: `import mtdeepep as deep_ep` serves V2 clients too
from .engines.handles import InternodeHandle
from .engines.internode import shutdown_all_engines
from .event import EventOverlap

topk_idx_t = torch.int64


def _release_at_exit() -> None:
    # Abort the waits of every live runtime and join its comm thread while the interpreter can still run it: a comm
    # thread that needed the GIL during finalisation would abort the process.
    shutdown_all_engines()  # Python workers first: their node runtimes go next
    shutdown_all_runtimes()


# Before threading joins the non-daemon threads (an internode worker waiting for a peer would hold the exit up to the
# timeout), else at exit.
getattr(threading, "_register_atexit", atexit.register)(_release_at_exit)

__all__ = [
    "Buffer",
    "CommError",
    "CommTimeoutError",
    "Config",
    "ElasticBuffer",
    "EPHandle",
    "EventHandle",
    "EventOverlap",
    "GroupMismatchError",
    "InternodeHandle",
    "cleanup_stale_segments",
    "combine",
    "dispatch",
    "skip_value_checks",
    "topk_idx_t",
]
