"""Low-latency mode (`low_latency_dispatch/combine`) on the topologies where it applies (low_latency_cases.py):
one node of 2 and 4 ranks (shared-memory transport) and, for the cases that hold for both transports, several
nodes (the collective transport); on the CPU executor (the GPU tests of tests/cuda run the same cases with a GPU
placement, at upstream's size).

The rank processes start once per world size for the module (`rank_pools`); every test runs one case in them.
"""

from __future__ import annotations

import pytest

from mtdeepep import Buffer

from . import low_latency_cases as cases
from .default_dtype import under_default_dtype
from .topology import INTRANODE, NORMAL

pytestmark = pytest.mark.timeout(300)

CASES = [
    cases.dispatch_matches_upstream_checks,
    cases.fp8_cast_matches_reference,
    cases.combine_matches_reference,
    cases.combine_modes_agree,
    cases.async_and_hooks,
    cases.masked_slots_and_empty_rank,
    cases.hidden_and_topk_beyond_upstream_limits,
    cases.double_buffering,
    cases.hook_pending_two_calls_ago_is_refused,
    cases.wait_stats_name_the_late_rank,
    cases.collective_transport_equals_shared_memory,
    cases.bad_inputs_raise_value_error_before_communicating,
    cases.mismatched_calls_raise_on_every_rank,
    cases.overlap_is_real,
]


def applies(case, topology) -> bool:
    """The comparison of the two transports needs one node (it builds both)."""
    return topology.internode is False or case is not cases.collective_transport_equals_shared_memory


def _marks(case, topology) -> list:
    """The overlap measurement takes seconds: internode, it runs in the whole suite, not in `-m 'not slow'`."""
    return [pytest.mark.slow] if case is cases.overlap_is_real and topology.internode else []


@pytest.mark.parametrize(
    "case, topology",
    [pytest.param(c, t, id=f"{c.__name__}-{t}", marks=_marks(c, t)) for c in CASES for t in NORMAL if applies(c, t)],
)
def test_case(pool, case, topology):
    pool.run(case, topology)


@pytest.mark.parametrize("topology", NORMAL, ids=str)
@pytest.mark.parametrize("mode", list(cases.FP8_MODES))
def test_dispatch_matches_reference(pool, topology, mode):
    pool.run(cases.dispatch_matches_reference, topology, mode)


# The collective transport waits with the process group's own timeout, which names no missing rank: one node only.
@pytest.mark.parametrize("topology", INTRANODE, ids=str)
def test_missing_rank_times_out_then_clean_recovers(pool, topology):
    outcomes = pool.run(cases.missing_rank_times_out_then_clean_recovers, topology, 1.5)
    expected = [["timeout", "peer-destroyed"], ["destroyed"]] + [["timeout"]] * (pool.world_size - 2)
    assert outcomes == expected


def test_size_hint_covers_every_part():
    base = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    # Grows with every argument; at least two halves of the dispatch slots (bf16 rows) and the combine area.
    assert base >= 2 * (256 * 128 * 7168 * 2 + 256 * 128 * 7168 * 2)
    for args in ((256, 7168, 8, 256), (128, 8192, 8, 256), (128, 7168, 8, 512)):
        assert Buffer.get_low_latency_rdma_size_hint(*args) > base
    with pytest.raises(ValueError):
        Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 250)


@pytest.mark.parametrize("topology", [pytest.param(t, id=str(t), marks=[pytest.mark.slow]) for t in NORMAL])
def test_combine_under_bfloat16_default_dtype(pool, topology):
    """DeepEP's harnesses set bfloat16 as the default dtype: the outputs keep their documented dtypes."""
    pool.run(under_default_dtype, "bfloat16", cases.combine_matches_reference, topology)
