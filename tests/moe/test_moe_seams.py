"""The dispatcher seams a trainer needs, at EP 2 and EP 4 over gloo:

- `EPBuffers`: the layers of a model share one mtdeepep buffer per process group and mode, grown when a layer needs
  more, with results bitwise those of a buffer per layer (`ep_buffer_cases.py`);
- `combine_begin` / `combine_end`: results independent of the work run in between, which overlaps the combine
  (`async_combine_cases.py`);
- selective activation checkpointing that saves mtdeepep's dispatch and combine outputs: no communication in the
  recomputation, gradients bitwise those without checkpointing (`checkpoint_cases.py`);
- the experts' delayed weight gradients (`overlap_dispatch_backward_with_experts_wgrad`): run while the dispatch's
  backward communicates, gradients bitwise those without the delay (`wgrad_overlap_cases.py`).

The rank processes start once per world size (`ep_pools`); each case is its own test and reports every rank's
traceback on failure.
"""

from __future__ import annotations

import pytest

from tests.ranks import world_size_params

from . import async_combine_cases, checkpoint_cases, ep_buffer_cases, wgrad_overlap_cases

pytestmark = pytest.mark.timeout(300)

CASES = {
    **ep_buffer_cases.CASES,
    **async_combine_cases.CASES,
    **checkpoint_cases.CASES,
    **wgrad_overlap_cases.CASES,
}


def run_case(ctx, name: str):
    """Runs the case `name` in a rank of a `RankPool`."""
    return CASES[name](ctx)


@pytest.fixture(scope="module", params=world_size_params(2, 4), ids=lambda n: f"ep{n}")
def world(request, ep_pools):
    return ep_pools[request.param]


@pytest.mark.parametrize("case", sorted(CASES))
def test_seam_case(world, case):
    results = world.run(run_case, case)
    if case in (
        "ep_buffers_layers_share_one_buffer",
        "selective_checkpoint_does_not_communicate_again",
        "delayed_wgrad_bitwise_the_undelayed",
    ):
        print(f"{case} at EP {world.world_size}: {results}")  # the measured figures, with -s
