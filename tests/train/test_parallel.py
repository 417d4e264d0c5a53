"""The layout check (before any process group) and the process groups of ParallelState."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moe.trainer.train.parallel_state import Layout, ParallelState


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world": 6, "pp": 4}, r"\(world 6, tp 1, pp 4, ep 1, etp 1\): world must be divisible by tp \* pp = 4"),
        ({"world": 8, "pp": 2, "ep": 8}, "ep \\* etp = 8 must divide dp \\* tp = 4"),
        ({"world": 4, "fp8": "fp4"}, "fp8 must be one of"),
        ({"world": 4, "ep": 3}, r"world 4, tp 1, pp 1, ep 3, etp 1\): ep \* etp = 3 must divide dp \* tp = 4"),
        ({"world": 2, "ep": 4}, "ep \\* etp = 4 must divide dp \\* tp = 2"),
        ({"world": 6, "tp": 4}, r"\(world 6, tp 4, pp 1, ep 1, etp 1\): world must be divisible by tp \* pp = 4"),
        ({"world": 8, "tp": 2, "ep": 4, "etp": 4}, "ep \\* etp = 16 must divide dp \\* tp = 8 \\(MoE parallel folding"),
        ({"world": 4, "etp": 0}, "etp must be a positive int"),
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
    assert layout.to_dict() == {"world": 4, "tp": 1, "pp": 1, "ep": 2, "etp": 1, "fp8": "none", "dp": 4,
                                "expert_dp": 2, "schedule": "1f1b"}  # fmt: skip
    folded = Layout(world=8, tp=2, ep=4)  # EP spans the TP pairs: 8 = edp 2 x ep 4
    assert (folded.dp, folded.expert_dp, folded.sequence_parallel) == (4, 2, True)
    assert Layout(world=8, tp=4, ep=2, etp=2).expert_dp == 2
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


def _groups_case(ctx, ep, tp=1, etp=1, pp=1):
    state = ParallelState.from_process_group(Layout(world=ctx.world_size, ep=ep, tp=tp, etp=etp, pp=pp))

    def members(group):
        return None if group is None else dist.get_process_group_ranks(group)

    return {
        "dp": members(state.dp_group),
        "ep": members(state.ep_group),
        "edp": members(state.expert_dp_group),
        "tp": members(state.tp_group),
        "etp": members(state.etp_group),
        "tokens": members(state.token_group),
        "pp": members(state.pp_group),
        "pp_rank": state.pp_rank,
        "ranks": (state.dp_rank, state.tp_rank, state.ep_rank, state.etp_rank, state.expert_dp_rank),
        "dp_rank": state.dp_rank,
        "ep_rank": state.ep_rank,
    }


@pytest.mark.slow  # slow: 4-rank groups
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_groups_on_four_ranks(rank_pools, ep):
    results = rank_pools[4].run(_groups_case, ep)
    for rank, r in enumerate(results):
        assert r["dp"] == [0, 1, 2, 3] and r["dp_rank"] == rank
        first = rank - rank % ep
        assert r["ep"] == (None if ep == 1 else list(range(first, first + ep)))
        assert r["ep_rank"] == rank % ep
        assert r["edp"] == (None if ep == 4 else list(range(rank % ep, 4, ep)))


@pytest.mark.parametrize(
    "tp, ep, etp, expected",
    [
        # Megatron-core's orders: dense tp fastest then dp; experts etp fastest, then ep, then edp.
        (2, 1, 1, {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "ep": None, "etp": None, "edp": [[0, 1, 2, 3]]}),
        (2, 2, 1, {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]], "etp": None,
                   "edp": [[0, 2], [1, 3]]}),
        (2, 4, 1, {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "ep": [[0, 1, 2, 3]], "etp": None, "edp": None}),
        (1, 2, 2, {"tp": None, "dp": [[0, 1, 2, 3]], "ep": [[0, 2], [1, 3]], "etp": [[0, 1], [2, 3]], "edp": None}),
        (4, 1, 2, {"tp": [[0, 1, 2, 3]], "dp": None, "ep": None, "etp": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]]}),
    ],
)  # fmt: skip
def test_folded_groups_on_four_ranks(rank_pools, tp, ep, etp, expected):
    """MoE parallel folding: the expert groups refold the dp x tp ranks (EP may span TP ranks)."""
    results = rank_pools[4].run(_groups_case, ep, tp, etp)
    for rank, r in enumerate(results):
        for name, groups in expected.items():
            mine = None if groups is None else next(g for g in groups if rank in g)
            assert r[name] == mine, (rank, name, r[name], mine)
        assert r["tokens"] == [0, 1, 2, 3]  # every rank's router sees other tokens


def test_pipeline_groups_on_four_ranks(rank_pools):
    """pp outermost (Megatron's order): ranks 0-1 are stage 0, ranks 2-3 stage 1; EP 2 folds within a stage."""
    results = rank_pools[4].run(_groups_case, 2, 1, 1, 2)
    for rank, r in enumerate(results):
        assert r["pp"] == [rank % 2, rank % 2 + 2] and r["pp_rank"] == rank // 2
        assert r["dp"] == [rank - rank % 2, rank - rank % 2 + 1] and r["dp_rank"] == rank % 2
        assert r["ep"] == r["dp"] and r["edp"] is None
        assert r["tokens"] == r["dp"]
