"""The normal-mode conformance cases (tests/conformance/normal_cases.py, unchanged) on the triton executor under
Triton's interpreter, one process per rank, on one node of 2 ranks (the internode topologies, where the internode
engine composes the triton executor: test_internode.py). Every case the CPU executor passes there is served.

Run only the Triton cases: `pytest tests/triton` (the interpreter costs ~2.6 ms per program instance, so these are
marked slow). Measured on the shared 2-core machine at load average ~30 (other sessions' tests): this file 385 s
(25 passed, before the two internode-composed cases were served); the staging-rounds cases take most of it
(async_outputs_staged_in_rounds 70 s, small_buffer_moves_in_rounds 24 s: a 4 KiB region moves a few rows per
round)."""

from __future__ import annotations

import pytest

from ..conformance import normal_cases as cases
from ..conformance.test_normal import CASES, applies
from ..conformance.topology import INTRANODE_2
from .served import case_params

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

# Cases of the CPU executor's normal mode that the triton executor does not serve (none: it serves every one).
NOT_SERVED: dict = {}


@pytest.mark.parametrize("case, topology", case_params(CASES, applies, INTRANODE_2, NOT_SERVED))
def test_case(pool, topology, case):
    pool.run(case, topology)


TIMEOUT_S = 1.5  # the buffers' timeout in the timeout cases (tests/conformance/test_normal.py's)


@pytest.mark.parametrize("topology", [INTRANODE_2], ids=str)
def test_bad_input_on_one_rank_times_out_the_others(pool, topology):
    outcomes = pool.run(cases.bad_input_on_one_rank_times_out_the_others, topology, TIMEOUT_S)
    assert outcomes == cases.bad_input_outcomes(topology)


@pytest.mark.parametrize("topology", [INTRANODE_2], ids=str)
@pytest.mark.parametrize("async_finish", [False, True], ids=["sync", "async"])
def test_missing_rank_in_combine_times_out(pool, topology, async_finish):
    outcomes = pool.run(cases.missing_rank_in_combine_times_out, topology, TIMEOUT_S, async_finish)
    assert outcomes == cases.missing_in_combine_outcomes(topology)
