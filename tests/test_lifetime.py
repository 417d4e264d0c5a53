"""Shared-memory hygiene and dead peers: mode 0600, nothing left in /dev/shm after set-up, a failure, or a SIGKILL;
a peer killed by SIGKILL is named at once (by pid liveness), long before the timeout, in every mode.

The set-up tests drive the runtime (`mtdeepep._C.Runtime`) directly: its segments are what they check. Processes
that die on purpose run under `mtdeepep.utils.testing.run_processes` (every join has a deadline).
"""

from __future__ import annotations

import os
import signal
import stat
import time

import pytest
import torch

import mtdeepep as deep_ep
from mtdeepep import _C
from mtdeepep.utils.testing import run_processes

pytestmark = pytest.mark.timeout(120)


def segments_of(pid: int) -> list[str]:
    prefix = f"mtdeepep-u{os.getuid()}-p{pid}-"
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def test_segment_is_private_and_unlinked_once_mapped():
    old_umask = os.umask(0)  # even with a permissive umask the segment must be 0600
    try:
        runtime = _C.Runtime(0, 1, 1 << 20, 0, 10.0, 1)
    finally:
        os.umask(old_umask)
    path = "/dev/shm" + runtime.segment_name()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    runtime.connect([runtime.segment_name()], [runtime.pid()], 1)
    assert not os.path.exists(path)
    assert segments_of(os.getpid()) == []
    runtime.destroy()


def test_failed_setup_leaves_nothing():
    runtime = _C.Runtime(0, 1, 1 << 20, 0, 10.0, 1)
    with pytest.raises(deep_ep.CommError, match="does not belong to rank 0"):
        runtime.connect([runtime.segment_name()], [runtime.pid() + 1], 1)
    assert segments_of(os.getpid()) == []


def _create_then_die(proc):
    runtime = _C.Runtime(0, 2, 1 << 20, 0, 10.0, 1)  # a rank killed between creating and mapping
    proc.send(runtime.segment_name())
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def test_segment_of_a_rank_killed_during_setup_is_removed_at_next_start():
    finished = run_processes(_create_then_die, 1, timeout_s=60)
    assert finished.exitcodes == [-signal.SIGKILL]
    [name] = finished.values[0]
    assert os.path.exists("/dev/shm" + name), "the killed rank's segment should still be there"
    runtime = _C.Runtime(0, 1, 1 << 20, 0, 10.0, 1)  # the next start cleans up after dead creators
    assert not os.path.exists("/dev/shm" + name)
    runtime.destroy()
    assert deep_ep.cleanup_stale_segments() == 0


def _rank_killed_before_dispatch(proc, mode):
    """Both ranks set up a buffer; rank 1 then kills itself and rank 0 dispatches, reporting how long until it was
    told, and what."""
    group = proc.init_group()
    topk_idx = torch.tensor([[0, 1]] * 16) if mode != "low-latency" else torch.tensor([[0, 3]] * 16)
    x = torch.randn(16, 128).bfloat16()
    if mode == "low-latency":
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(16, 128, 2, 4)
        buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, timeout_s=60)
        dispatch = lambda: buffer.low_latency_dispatch(x, topk_idx, 16, 4)  # noqa: E731
    else:
        per_node = {"internode-2x1": dict(num_ranks_per_node=1)}.get(mode, {})
        buffer = deep_ep.Buffer(group, 1 << 20, timeout_s=60, **per_node)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2)
        dispatch = lambda: buffer.dispatch(  # noqa: E731
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx,
        )  # fmt: skip
    if proc.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.perf_counter()
    try:
        dispatch()
    except deep_ep.CommError as error:
        return time.perf_counter() - start, str(error)
    return None, "no error"


@pytest.mark.parametrize("mode", ["intranode", "low-latency", "internode-2x1"])
def test_sigkilled_peer_is_named_at_once_and_nothing_leaks(mode):
    """A peer killed before a dispatch is reported long before the 60 s timeout (on one node by pid liveness,
    naming it); neither rank's segments stay in /dev/shm."""
    finished = run_processes(_rank_killed_before_dispatch, 2, (mode,), timeout_s=90)
    assert finished.exitcodes == [0, -signal.SIGKILL] and finished.values[1] == []
    [(elapsed, message)] = finished.values[0]  # only the survivor reports
    assert "dispatch" in message, message
    if mode == "internode-2x1":  # the network stage learns it from the backend (a reset connection): no rank named
        assert "network stage" in message, message
    else:  # shared memory: the peer's pid is gone
        assert "rank 1" in message and "exited" in message, message
    assert elapsed is not None and elapsed < 10, "the survivor must notice the dead peer long before its timeout"
    for pid in finished.pids:
        assert segments_of(pid) == []
