"""Low-latency dispatch/combine (shared-memory and collective transports) at 2 and 4 ranks.

The rank processes start once per world size; every test below runs one case of low_latency_cases.py in them.
"""

import os
import signal
import time

import low_latency_cases as cases
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ranks import RankPool, free_port

import mtdeepep as deep_ep

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def pool(request):
    ranks = RankPool(request.param)
    yield ranks
    ranks.close()


@pytest.mark.parametrize(
    "case",
    [
        cases.dispatch_matches_upstream_checks,
        cases.fp8_cast_matches_reference,
        cases.combine_matches_reference,
        cases.combine_modes_agree,
        cases.masked_slots_and_empty_rank,
        cases.hidden_and_topk_beyond_upstream_limits,
        cases.double_buffering,
        cases.hook_pending_two_calls_ago_is_refused,
        cases.wait_stats_name_the_late_rank,
        cases.collective_transport_equals_shared_memory,
        cases.bad_inputs_raise_value_error_before_communicating,
        cases.mismatched_calls_raise_on_every_rank,
        cases.overlap_is_real,
    ],
    ids=lambda case: case.__name__,
)
def test_case(pool, case):
    pool.run(case)


def test_missing_rank_times_out_then_clean_recovers(pool):
    outcomes = pool.run(cases.missing_rank_times_out_then_clean_recovers, 1.5)
    expected = [["timeout", "peer-destroyed"], ["destroyed"]] + [["timeout"]] * (pool.world_size - 2)
    assert outcomes == expected


def test_size_hint_covers_every_part():
    from mtdeepep import Buffer

    base = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    # Grows with every argument; at least two halves of the dispatch slots (bf16 rows) and the combine area.
    assert base >= 2 * (256 * 128 * 7168 * 2 + 256 * 128 * 7168 * 2)
    for args in ((256, 7168, 8, 256), (128, 8192, 8, 256), (128, 7168, 8, 512)):
        assert Buffer.get_low_latency_rdma_size_hint(*args) > base
    with pytest.raises(ValueError):
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 250)


def _rank_killed_before_dispatch(rank, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(16, 128, 2, 4)
    buffer = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, timeout_s=60)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.perf_counter()
    try:
        buffer.low_latency_dispatch(torch.ones(16, 128).bfloat16(), torch.tensor([[0, 3]] * 16), 16, 4)
        results.put((rank, "no error"))
    except deep_ep.CommError as error:
        results.put((rank, f"{time.perf_counter() - start:.2f}|{error}"))


def test_sigkilled_peer_is_named_at_once():
    """A peer killed before a low-latency dispatch is reported (by pid liveness) long before the 60 s timeout."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_killed_before_dispatch, args=(r, port, results)) for r in range(2)]
    for process in processes:
        process.start()
    outcome = dict([results.get(timeout=90)])  # only the survivor reports
    for process in processes:
        process.join(timeout=60)
    assert processes[1].exitcode == -signal.SIGKILL and processes[0].exitcode == 0
    elapsed, message = outcome[0].split("|", 1)
    assert "rank 1" in message and "exited" in message and "dispatch" in message, message
    assert float(elapsed) < 10
