"""Shared-memory hygiene: mode 0600, nothing left in /dev/shm after set-up, a failure, or a SIGKILL."""

import os
import signal
import stat
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ranks import free_port

import mtdeepep as deep_ep
from mtdeepep import _C

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


def _create_then_die(names):
    runtime = _C.Runtime(0, 2, 1 << 20, 0, 10.0, 1)  # a rank killed between creating and mapping
    names.put(runtime.segment_name())
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def test_segment_of_a_rank_killed_during_setup_is_removed_at_next_start():
    context = mp.get_context("spawn")
    names = context.Queue()
    process = context.Process(target=_create_then_die, args=(names,))
    process.start()
    name = names.get(timeout=60)
    process.join(timeout=60)
    assert process.exitcode == -signal.SIGKILL
    assert os.path.exists("/dev/shm" + name), "the killed rank's segment should still be there"
    runtime = _C.Runtime(0, 1, 1 << 20, 0, 10.0, 1)  # the next start cleans up after dead creators
    assert not os.path.exists("/dev/shm" + name)
    runtime.destroy()
    assert deep_ep.cleanup_stale_segments() == 0


def _rank_killed_in_dispatch(rank, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = deep_ep.Buffer(dist.group.WORLD, 1 << 20, timeout_s=60)
    topk_idx = torch.tensor([[0, 1]] * 16)
    x = torch.randn(16, 32).bfloat16()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.perf_counter()
    try:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx)  # fmt: skip
        results.put((rank, "no error"))
    except deep_ep.CommError as error:
        results.put((rank, f"{time.perf_counter() - start:.2f}|{error}"))


def test_sigkilled_peer_is_named_at_once_and_nothing_leaks():
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_killed_in_dispatch, args=(r, port, results)) for r in range(2)]
    for process in processes:
        process.start()
    outcome = dict([results.get(timeout=90)])  # only the survivor reports
    for process in processes:
        process.join(timeout=60)
    assert processes[1].exitcode == -signal.SIGKILL and processes[0].exitcode == 0
    elapsed, message = outcome[0].split("|", 1)
    assert "rank 1" in message and "exited" in message, message
    assert float(elapsed) < 10, "the survivor must notice the dead peer long before its 60 s timeout"
    for process in processes:
        assert segments_of(process.pid) == []
