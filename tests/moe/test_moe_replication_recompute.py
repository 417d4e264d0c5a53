"""Hot-expert replication and recompute at expert-parallel 2 and 4 (cases in replication_recompute_cases.py).

The rank processes start once per world size and run every case (`rank_pools`, the one launcher's `RankPool`).
"""

from __future__ import annotations

import pytest

from tests.ranks import world_size_params

from . import replication_recompute_cases as cases

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=world_size_params(2, 4), ids=lambda n: f"ep{n}")
def pool(request, rank_pools):
    return rank_pools[request.param]


@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_replication_matches_plain_layer(pool, dispatcher):
    results = pool.run(cases.replication_matches_plain_layer, dispatcher)
    assert all(r["hot"] == results[0]["hot"] for r in results)


def test_replication_in_eval(pool):
    pool.run(cases.replication_in_eval_needs_no_backward)


def test_adaptive_recompute_per_rank(pool):
    results = pool.run(cases.adaptive_recompute_per_rank)
    # The ranks over the threshold recompute ('fc1'), the others keep their activations (None).
    assert {mode for mode, _, _ in results} == {"fc1", None}, results
    assert all((mode == "fc1") == (rows > threshold) for mode, rows, threshold in results), results


@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_recompute_levels_match(pool, dispatcher):
    pool.run(cases.recompute_levels_match, dispatcher)
