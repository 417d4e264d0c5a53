"""Expert parallelism over gloo: EP 2 and EP 4 against EP 1, every dispatcher, the global aux loss; the 'flex'
(mtdeepep) cases also on a one-rank group (a real `mtdeepep.Buffer` with a single rank).

The rank processes start once per world size (`ep_pools`, the one launcher's `RankPool`) and run every case of
`moe_dist_cases.CASES`; each case is its own pytest test and reports every rank's traceback on failure. Every wait
has a deadline, so a hang fails the test (and restarts the ranks) instead of blocking the suite.
"""

from __future__ import annotations

import pytest

from tests.ranks import world_size_params

from .moe_dist_cases import CASES, run_case

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=world_size_params(2, 4), ids=lambda n: f"ep{n}")
def world(request, ep_pools):
    return ep_pools[request.param]


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_case(world, case):
    world.run(run_case, case)


@pytest.mark.parametrize("case", sorted(name for name in CASES if "flex" in name and "etp" not in name))
def test_flex_on_one_rank_group(ep_pools, case):
    ep_pools[1].run(run_case, case)
