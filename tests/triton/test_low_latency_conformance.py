"""The low-latency conformance cases (tests/conformance/low_latency_cases.py, unchanged) on the triton executor
(`MTDEEPEP_ENGINE=triton`) under Triton's interpreter, 2 ranks of one node. Slow: the interpreter costs ~2.6 ms per
program instance. Only these: `pytest tests/triton/test_low_latency_conformance.py`."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the rank processes inherit it)

import pytest  # noqa: E402

from tests.ranks import pool_fixture  # noqa: E402

from ..conformance import low_latency_cases as cases  # noqa: E402
from ..conformance.test_low_latency import CASES, applies  # noqa: E402
from ..conformance.topology import INTRANODE_2  # noqa: E402
from . import ll_cases  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
pool = pool_fixture(world_size=2, comm_timeout_s=60, deadline_s=240)

# Cases the triton executor does not serve, with the reason.
NOT_SERVED = {
    cases.collective_transport_equals_shared_memory: "builds a buffer of nodes of one rank: the triton executor "
    "serves one node (the collective transport is the internode engine's, over the CPU executor)",
    cases.overlap_is_real: "measures the CPU executor's comm thread (the hook's send runs on it); the triton "
    "executor sends in the call, on the caller's thread, and 128 x 7168 rows take seconds in the interpreter",
}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.__name__, marks=[pytest.mark.skip(reason=NOT_SERVED[c])] if c in NOT_SERVED else [])
     for c in CASES if applies(c, INTRANODE_2)],
)  # fmt: skip
def test_case(pool, case):
    pool.run(ll_cases.on_triton, case, INTRANODE_2)


@pytest.mark.parametrize("mode", list(cases.FP8_MODES))
def test_dispatch_matches_reference(pool, mode):
    pool.run(ll_cases.on_triton, cases.dispatch_matches_reference, INTRANODE_2, mode)


def test_missing_rank_times_out_then_clean_recovers(pool):
    outcomes = pool.run(ll_cases.on_triton, cases.missing_rank_times_out_then_clean_recovers, INTRANODE_2, 1.5)
    assert outcomes == [["timeout", "peer-destroyed"], ["destroyed"]]
