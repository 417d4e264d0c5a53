"""`thread_local_setting`: a per-thread setting changed for the duration of a `with` block."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def thread_local_setting(local: threading.local, name: str, value: Any, default: Any = None) -> Iterator[None]:
    """Within the block, `local.<name>` is `value` on this thread; on exit (also by an exception) it is set back to
    what it was (`default` if this thread had not set it), so that blocks nest."""
    previous = getattr(local, name, default)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)
