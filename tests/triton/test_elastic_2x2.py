"""DeepEP V2's `ElasticBuffer` on the triton executor over 2 nodes x 2 ranks (four rank processes; the internode
engine composing the triton executor as its node-local stage), under Triton's interpreter: the cases the CPU
executor runs at 2 x 2 in tests/clients/test_elastic_v21.py, unchanged: DeepEP 2.1's primitives, upstream's V2 mode
grid (a sparser stride: the interpreter's cost is per launch) and the FP8 dispatch with an idle rank.

Run only them: `pytest tests/triton/test_elastic_2x2.py`. Measured on the shared 2-core machine at load average ~30:
252 s for the file (the grid 60 s with CPU sync, 75 s without; the four-rank pool's start ~55 s; the rest < 10 s a
case)."""

from __future__ import annotations

import pytest

from ..clients import v2_grid_cases as grid
from ..clients.test_elastic_v21 import CASES as V21_CASES
from ..conformance.topology import INTERNODE_2X2

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# Strides of upstream's 144-mode grid (the interpreter's cost is per launch: ~25-35 s a mode at 2 x 2 on the loaded
# shared machine). With CPU sync every 25th mode: 6 modes that take every value of every dimension (handle copy,
# alignment, FP8, 0 / 1 / 2 biases, and all 6 combinations of previous event, async and comm-stream allocation;
# 25 is coprime with the grid's periods). Without CPU sync (the `num_worst_tokens` padding path) every 53rd: 3
# modes, with and without handle copy, FP8 and BF16, both alignments, previous event or not.
STRIDES = {True: 25, False: 53}


@pytest.mark.parametrize("topology", [INTERNODE_2X2], ids=str)
@pytest.mark.parametrize("case", V21_CASES, ids=lambda case: case.__name__)
def test_v21_case(pool, case, topology):
    pool.run(case, topology.ranks_per_node)


@pytest.mark.parametrize("topology", [INTERNODE_2X2], ids=str)
@pytest.mark.parametrize("do_cpu_sync", [True, False], ids=["cpu-sync", "no-cpu-sync"])
def test_v2_mode_grid(pool, topology, do_cpu_sync):
    stride = STRIDES[do_cpu_sync]
    checked = pool.run(grid.v2_mode_grid_matches_reference, topology.ranks_per_node, stride, do_cpu_sync, (0, 1))
    expected = list(range(0, len(list(grid.enumerate_ep_modes())), stride))
    assert checked == [expected] * topology.world_size


@pytest.mark.parametrize("topology", [INTERNODE_2X2], ids=str)
def test_fp8_internode_dispatch_with_an_idle_rank(pool, topology):
    pool.run(grid.fp8_internode_dispatch_with_an_idle_rank)
