"""Crash injection for the checkpoint tests: a rank SIGKILLs itself at a chosen point of a run.

Set `MTDEEPEP_CRASH_FAULT` in the environment of the ranks (every rank reads it; only the named one acts):
    kill_at_step:R:S    rank R kills itself when optimizer step S is about to start, once its pending checkpoint
                        write has finished (so the checkpoint before S is on disk and the run dies in training)
    kill_in_write:R:S   rank R kills itself in the middle of writing its model shard of the checkpoint of step S
                        (half of the file's bytes written)
SIGKILL runs no handler, no `finally` and no atexit: what is on disk is what a real crash leaves.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

ENV = "MTDEEPEP_CRASH_FAULT"
KINDS = ("kill_at_step", "kill_in_write")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.strip().split(":")
        if len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{ENV}={text!r}: expected one of {KINDS} as KIND:RANK:STEP, e.g. kill_at_step:1:6")
        return cls(parts[0], int(parts[1]), int(parts[2]))


def from_env() -> Fault | None:
    text = os.environ.get(ENV)
    return Fault.parse(text) if text else None


def kill_self(what: str) -> None:
    print(f"fault injection ({ENV}): SIGKILL {what}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
