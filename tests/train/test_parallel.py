"""The layout check (before any process group) and the process groups of ParallelState."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moe.train.parallel import Layout, ParallelState


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world": 4, "tp": 2}, "--tp 2: tensor parallelism arrives with the next issue"),
        ({"world": 4, "pp": 2}, "--pp 2: pipeline parallelism arrives with the next issue"),
        ({"world": 4, "fp8": "blockwise"}, "--fp8 blockwise: FP8 training arrives with the next issue"),
        ({"world": 4, "ep": 3}, "--ep 3 must divide"),
        ({"world": 2, "ep": 4}, "--ep 4 must divide"),
        ({"world": 0}, "world must be a positive int"),
        ({"world": 4, "pp_schedule": "gpipe"}, "pipeline schedule"),
    ],
)
def test_layout_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_layout_sizes_and_checks():
    layout = Layout(world=4, ep=2)
    assert (layout.dp, layout.expert_dp) == (4, 2)
    assert layout.to_dict() == {"world": 4, "tp": 1, "pp": 1, "ep": 2, "fp8": "none", "dp": 4, "expert_dp": 2,
                                "schedule": "1f1b"}  # fmt: skip
    layout.check_batch(16, 4)
    with pytest.raises(ValueError, match="dp \\* micro_batches"):
        layout.check_batch(8, 4)
    layout.check_experts(8)
    with pytest.raises(ValueError, match="n_routed_experts=6 is not divisible by --ep 4"):
        Layout(world=4, ep=4).check_experts(6)


def test_single_process_state():
    state = ParallelState.single()
    assert state.dp_group is None and state.ep_group is None and state.expert_dp_group is None
    assert (state.dp_rank, state.ep_rank, state.is_main) == (0, 0, True)


def _groups_case(ctx, ep):
    state = ParallelState.from_process_group(Layout(world=ctx.world_size, ep=ep))

    def members(group):
        return None if group is None else dist.get_process_group_ranks(group)

    return {
        "dp": members(state.dp_group),
        "ep": members(state.ep_group),
        "edp": members(state.expert_dp_group),
        "dp_rank": state.dp_rank,
        "ep_rank": state.ep_rank,
    }


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_groups_on_four_ranks(rank_pools, ep):
    results = rank_pools[4].run(_groups_case, ep)
    for rank, r in enumerate(results):
        assert r["dp"] == [0, 1, 2, 3] and r["dp_rank"] == rank
        first = rank - rank % ep
        assert r["ep"] == (None if ep == 1 else list(range(first, first + ep)))
        assert r["ep_rank"] == rank % ep
        assert r["edp"] == (None if ep == 4 else list(range(rank % ep, 4, ep)))
