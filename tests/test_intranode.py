"""Intranode dispatch/combine on the CPU shared-memory executor, at 2 and 4 ranks.

The rank processes start once per world size; every test below runs one case of intranode_cases.py in them.
"""

import os

import intranode_cases as cases
import pytest
from ranks import RankPool

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def pool(request):
    ranks = RankPool(request.param)
    yield ranks
    ranks.close()


@pytest.mark.parametrize(
    "case",
    [
        cases.layout_matches_reference,
        cases.dispatch_matches_reference,
        cases.dispatch_segments_constant_per_source,
        cases.expert_alignment_rounds_counts,
        cases.fp8_dispatch_passes_through,
        cases.cached_dispatch_matches,
        cases.num_worst_tokens_pads_outputs,
        cases.dispatch_too_few_worst_tokens_is_an_error,
        cases.combine_matches_reference,
        cases.combine_accumulates_in_fp32,
        cases.combine_adds_bias,
        cases.async_and_previous_event,
        cases.async_runs_off_the_callers_thread,
        cases.small_buffer_moves_in_rounds,
        cases.region_too_small_for_one_row_says_how_much,
        cases.edge_cases,
        cases.local_buffer_tensor_is_the_shared_region,
        cases.gradients_match_reference,
        cases.combine_bias_gradients,
        cases.bad_inputs_raise_value_error_before_communicating,
        cases.single_rank_group,
        cases.buffer_released_by_python_or_autograd,
    ],
    ids=lambda case: case.__name__,
)
def test_case(pool, case):
    pool.run(case)


def test_bad_input_on_one_rank_times_out_the_others(pool):
    outcomes = pool.run(cases.bad_input_on_one_rank_times_out_the_others, 1.5)
    assert outcomes == ["timeout" if r != 1 else "value-error" for r in range(pool.world_size)]


def test_missing_rank_in_combine_times_out(pool):
    outcomes = pool.run(cases.missing_rank_in_combine_times_out, 1.5)
    assert outcomes == ["skipped"] + ["timeout"] * (pool.world_size - 1)


def test_async_finish_overlaps_the_transfer(pool):
    if pool.world_size > (os.cpu_count() or 1):
        # Each rank's comm thread needs a core of its own to overlap the caller's work; with more ranks than cores
        # the transfers already compete for every core and the measurement says nothing.
        pytest.skip(f"{pool.world_size} ranks on {os.cpu_count()} cores")
    pool.run(cases.async_finish_overlaps_the_transfer)
