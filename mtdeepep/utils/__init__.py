"""Utilities with DeepEP's `deep_ep.utils` names (events, link check) and plain-PyTorch references (`refs`)."""

from .event import EventHandle, EventOverlap, check_nvlink_connections

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
