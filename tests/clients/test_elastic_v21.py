"""DeepEP 2.1's primitives and semantics on `mtdeepep.ElasticBuffer` (cases in v21_cases.py) in the logical domains
the CPU executor serves: one node of 2 ranks (the quick runs), one node of 4, and 2 nodes x 2 ranks
(`num_ranks_per_node=2`, V1's two-stage internode mode underneath); the V2 mode grid also on 4 nodes x 1 rank."""

from __future__ import annotations

import pytest

from ..ranks import pool_fixture
from . import v2_grid_cases as grid_cases
from . import v21_cases as cases

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # rank pools of 2 and 4: keeps `-m "not slow"` under 5 min

# Rank pools of 2 and 4 ranks; mtdeepep's and gloo's timeouts (30 s) end before the pool's deadline (120 s).
v21_pools = pool_fixture(comm_timeout_s=30, deadline_s=120)

DOMAINS = [
    pytest.param((2, None), id="1x2"),
    pytest.param((4, None), id="1x4", marks=pytest.mark.slow),
    pytest.param((4, 2), id="2x2", marks=pytest.mark.slow),
]

CASES = [
    cases.pp_send_recv_matches_upstream_test,
    cases.agrs_all_gather_matches_upstream_test,
    cases.engram_fetch_matches_upstream_test,
    cases.deterministic_sort_restores_arrival_independent_order,
    cases.elastic_outputs_keep_dtypes_under_bfloat16_default,
]


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_v21_case(v21_pools, case, domain):
    world_size, num_ranks_per_node = domain
    v21_pools[world_size].run(case, num_ranks_per_node)


def test_pp_recv_times_out_naming_the_sender(v21_pools):
    v21_pools[2].run(cases.pp_recv_times_out_naming_the_sender)


# Upstream's V2 mode grid (v2_grid_cases.py), every `stride`-th mode (strides coprime with the grid's inner
# periods, so that every value of every dimension is taken): 1 x 2 in the quick runs, 1 x 4 and 2 x 2 in the whole
# suite; without CPU sync every 11th.
GRID = [
    pytest.param((2, None), 7, (0, 1), id="1x2"),
    pytest.param((4, None), 5, (0, 1), id="1x4", marks=pytest.mark.slow),
    pytest.param((4, 2), 5, (0, 1), id="2x2", marks=pytest.mark.slow),
    pytest.param((4, 1), 5, (0, 1), id="4x1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("do_cpu_sync", [True, False], ids=["cpu-sync", "no-cpu-sync"])
@pytest.mark.parametrize("domain, stride, fp8_values", GRID)
def test_v2_mode_grid(v21_pools, domain, stride, fp8_values, do_cpu_sync):
    world_size, num_ranks_per_node = domain
    stride = stride if do_cpu_sync else 11
    checked = v21_pools[world_size].run(
        grid_cases.v2_mode_grid_matches_reference, num_ranks_per_node, stride, do_cpu_sync, fp8_values
    )
    modes = list(grid_cases.enumerate_ep_modes())
    expected = [i for i in range(0, len(modes), stride) if modes[i][2] in fp8_values]
    assert checked == [expected] * world_size


def test_fp8_internode_dispatch_with_an_idle_rank(v21_pools):
    v21_pools[4].run(grid_cases.fp8_internode_dispatch_with_an_idle_rank)
