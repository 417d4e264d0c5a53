"""A peer SIGKILLed after set-up, on the GPU (process_cases.py): the survivors' next dispatch ends with an error
naming the dead rank within about the timeout, the GPU stays usable and the buffer can be destroyed. Skipped, with
one reason, without a CUDA device or without mtdeepep's CUDA executor."""

from __future__ import annotations

import signal

import pytest

from mtdeepep.utils.testing import run_processes

from . import process_cases as cases
from .gpu import rank_ids, skip_unless_cuda

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(300)]

TIMEOUT_S = 3.0


@pytest.mark.parametrize("num_processes", [2, 3], ids=rank_ids)
def test_killed_peer_is_named_and_the_gpu_stays_usable(num_processes):
    finished = run_processes(cases.killed_peer, num_processes, (TIMEOUT_S,), timeout_s=120)
    expected_codes = [0] * num_processes
    expected_codes[cases.VICTIM] = -signal.SIGKILL
    assert finished.exitcodes == expected_codes, finished.exitcodes
    for rank, values in finished.values.items():
        if rank == cases.VICTIM:
            assert values == [], values
            continue
        ((kind, named, seconds, usable, destroy_seconds),) = values
        assert kind in ("CommTimeoutError", "CommError"), (rank, kind, named)
        assert named == [cases.VICTIM], f"rank {rank}: the error does not name rank {cases.VICTIM}: {named}"
        assert seconds < 2 * TIMEOUT_S + 2, f"rank {rank} waited {seconds:.1f} s"
        assert usable, f"rank {rank}: the GPU is not usable after the error"
        assert destroy_seconds < 2 * TIMEOUT_S + 2, f"rank {rank}: destroy took {destroy_seconds:.1f} s"
