"""Utilities with DeepEP's `deep_ep.utils` names (events, link check), plain-PyTorch references (`refs`), the block-wise
FP8 quantiser (`fp8`), the multi-process launcher (`testing`) and per-thread settings (`thread_local`)."""

from .event import EventHandle, EventOverlap, check_nvlink_connections

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
