"""The low-latency conformance cases (tests/conformance/low_latency_cases.py, unchanged) on the triton executor
(`mtdeepep.kernels.low_latency` through `TritonEngine`) under Triton's interpreter, 2 rank processes."""

from __future__ import annotations

import pytest

from ..conformance import low_latency_cases as cases
from ..conformance.test_low_latency import CASES, applies
from ..conformance.topology import INTRANODE_2

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NOT_SERVED = {
    cases.collective_transport_equals_shared_memory: "compares the CPU executor's two transports",
    cases.overlap_is_real: "the kernels run on the caller's thread: async_finish cannot overlap on the CPU",
    cases.wait_stats_name_the_late_rank: "asks the rank on time to wait < 0.1 s: interpreted waits cost more",
}


@pytest.mark.parametrize(
    "case, topology",
    [pytest.param(case, INTRANODE_2, id=f"{case.__name__}-{INTRANODE_2}",
                  marks=[pytest.mark.skip(reason=NOT_SERVED[case])] if case in NOT_SERVED else [])
     for case in CASES if applies(case, INTRANODE_2)],
)  # fmt: skip
def test_case(pool, case, topology):
    pool.run(case, topology)


@pytest.mark.parametrize("topology", [INTRANODE_2], ids=str)
@pytest.mark.parametrize("mode", list(cases.FP8_MODES))
def test_dispatch_matches_reference(pool, topology, mode):
    pool.run(cases.dispatch_matches_reference, topology, mode)


@pytest.mark.skip(
    reason="asks the timeout to end within 5 s of timeout_s; the low-latency waits count spins calibrated "
    "once, which a loaded machine stretches (i34-ll's kernels)"
)
@pytest.mark.parametrize("topology", [INTRANODE_2], ids=str)
def test_missing_rank_times_out_then_clean_recovers(pool, topology):
    outcomes = pool.run(cases.missing_rank_times_out_then_clean_recovers, topology, 1.5)
    assert outcomes == [["timeout", "peer-destroyed"], ["destroyed"]]
