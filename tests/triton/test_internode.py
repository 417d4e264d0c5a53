"""The internode engine composing the triton executor as its node-local stage (`MTDEEPEP_ENGINE=triton` on a group
of several nodes), under Triton's interpreter: V1's two-stage dispatch and combine on nodes of one rank (2 x 1, two
rank processes) and on an M x N domain (2 nodes x 2 ranks, four rank processes), and DeepEP V2's `ElasticBuffer`
over two nodes (the cases of tests/conformance and tests/clients, unchanged). Small shapes: the cases' own.

Run only them: `pytest tests/triton/test_internode.py`. Measured on the shared 2-core machine: see the report in
tests/triton/test_conformance.py's docstring."""

from __future__ import annotations

import pytest

from ..clients import client_cases as client
from ..clients import v2_grid_cases as grid
from ..conformance import normal_cases as cases
from ..conformance.topology import INTERNODE_2X2, Topology

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

INTERNODE_2X1 = Topology(2, ranks_per_node=1)  # every rank its own node: both stages, two processes
STRIDE = 11  # the V2 mode grid's stride
TIMEOUT_S = 1.5  # the buffers' timeout in the timeout case (tests/conformance/test_normal.py's)


@pytest.mark.parametrize(
    "case, topology",
    [
        pytest.param(case, topology, id=f"{case.__name__}-{topology}")
        for case, topology in (
            (cases.cached_dispatch_matches, INTERNODE_2X1),
            # Dispatch against the reference, then combine with biases: both stages with two ranks per node.
            (cases.combine_adds_bias, INTERNODE_2X2),
        )
    ],
)
def test_case(pool, topology, case):
    pool.run(case, topology)


@pytest.mark.parametrize("topology", [INTERNODE_2X1], ids=str)
def test_missing_rank_in_combine_times_out(pool, topology):
    outcomes = pool.run(cases.missing_rank_in_combine_times_out, topology, TIMEOUT_S, True)
    assert outcomes == cases.missing_in_combine_outcomes(topology)


@pytest.mark.parametrize("topology", [INTERNODE_2X1, INTERNODE_2X2], ids=str)
def test_elastic_dispatch_over_two_nodes(pool, topology):
    """V2 over two nodes (of one rank, of two: an M x N logical domain): the handle is V1's internode one; the V2
    fields must not change."""
    pool.run(client.elastic_dispatch_matches_reference, topology.ranks_per_node)


@pytest.mark.parametrize("topology", [INTERNODE_2X1], ids=str)
def test_v2_mode_grid_over_two_nodes(pool, topology):
    """Upstream's V2 mode grid on 2 nodes x 1 rank, every 11th BF16 mode (the stride of the CPU executor's
    no-CPU-sync runs in tests/clients/test_elastic_v21.py), each output bitwise against the reference."""
    checked = pool.run(grid.v2_mode_grid_matches_reference, 1, STRIDE, True, (0,))
    modes = list(grid.enumerate_ep_modes())
    assert checked == [[i for i in range(0, len(modes), STRIDE) if modes[i][2] == 0]] * 2
