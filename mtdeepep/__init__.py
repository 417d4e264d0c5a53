"""mtdeepep: DeepEP-compatible expert-parallel communication (`import mtdeepep as deep_ep`)."""

import torch

from ._C import CommError, CommTimeoutError, EventHandle, GroupMismatchError, cleanup_stale_segments
from .autograd import combine, dispatch
from .buffer import Buffer
from .config import Config
from .event import EventOverlap

topk_idx_t = torch.int64

__all__ = [
    "Buffer",
    "CommError",
    "CommTimeoutError",
    "Config",
    "EventHandle",
    "EventOverlap",
    "GroupMismatchError",
    "cleanup_stale_segments",
    "combine",
    "dispatch",
    "topk_idx_t",
]
