"""Internode (two-stage) dispatch/combine: four ranks of this host as 2 nodes x 2 ranks and as 4 nodes x 1 rank.

The rank processes start once for the module; every test runs one case of internode_cases.py in them, for both
node layouts.
"""

import internode_cases as cases
import pytest
from ranks import RankPool

pytestmark = pytest.mark.timeout(300)

WORLD_SIZE = 4
LAYOUTS = [2, 1]  # ranks per node
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(WORLD_SIZE)
    yield ranks
    ranks.close()


@pytest.mark.parametrize("per_node", LAYOUTS, ids=lambda n: f"{WORLD_SIZE // n}x{n}")
@pytest.mark.parametrize(
    "case",
    [
        cases.layout_matches_reference,
        cases.node_layout_is_validated,
        cases.dispatch_matches_reference,
        cases.dispatch_without_topk,
        cases.dispatch_segments_constant_per_source,
        cases.expert_alignment_rounds_counts,
        cases.fp8_dispatch_passes_through,
        cases.cached_dispatch_matches,
        cases.num_worst_tokens_pads_outputs,
        cases.combine_matches_reference,
        cases.combine_accumulates_in_fp32,
        cases.combine_adds_bias,
        cases.async_and_previous_event,
        cases.async_finish_overlaps_the_transfer,
        cases.edge_cases,
        cases.gradients_match_reference,
        cases.combine_bias_gradients,
        cases.bad_inputs_raise_value_error_before_communicating,
    ],
    ids=lambda case: case.__name__,
)
def test_case(pool, case, per_node):
    pool.run(case, per_node)


@pytest.mark.parametrize(
    "per_node, expected",
    [
        # 2x2: rank 3 waits for rank 1 on the network; ranks 0 and 2 finish it and wait in their node.
        (2, ["node-local", "value-error", "node-local", "network"]),
        (1, ["network", "value-error", "network", "network"]),
    ],
    ids=["2x2", "4x1"],
)
def test_bad_input_on_one_rank_times_out_the_others(pool, per_node, expected):
    assert pool.run(cases.bad_input_on_one_rank_times_out_the_others, per_node, TIMEOUT_S) == expected


@pytest.mark.parametrize(
    "per_node, expected",
    [
        # Every combine starts with the handle identity check over the whole group, which names rank 0.
        (2, ["skipped", "network", "network", "network"]),
        (1, ["skipped", "network", "network", "network"]),
    ],
    ids=["2x2", "4x1"],
)
@pytest.mark.parametrize("async_finish", [False, True], ids=["sync", "async"])
def test_missing_rank_in_combine_times_out(pool, per_node, expected, async_finish):
    assert pool.run(cases.missing_rank_in_combine_times_out, per_node, TIMEOUT_S, async_finish) == expected
