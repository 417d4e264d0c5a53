"""The pipeline split (decoder layers per stage, placeholders, Megatron's first/last counts), the stages each rank
holds, and the micro-batch rules of the schedules (moe/trainer/pipeline/split.py)."""

from __future__ import annotations

import pytest

from moe.trainer.pipeline.split import (
    SCHEDULE_STAGES_PER_RANK,
    check_schedule,
    split_layers,
    stages_of_rank,
    stages_per_rank,
)


def test_even_split_and_placeholders():
    assert split_layers(4, 2).slots == ((0, 1), (2, 3))
    # DeepSeek-V3: 61 layers over DualPipe's 16 stages pad to 64; the 3 placeholders end the last stage.
    dsv3 = split_layers(61, 16)
    assert [len(s) for s in dsv3.slots] == [4] * 16
    assert dsv3.slots[-1] == (60, None, None, None) and dsv3.num_placeholders(15) == 3
    assert [i for s in range(16) for i in dsv3.layers(s)] == list(range(61))
    tiny_v = split_layers(4, 8)  # tiny under DualPipeV at PP4: stages 4-7 are placeholders only
    assert tiny_v.layers(3) == [3] and tiny_v.layers(7) == [] and tiny_v.num_placeholders(7) == 1
    assert "stage 7: no layer + 1 placeholder" in tiny_v.describe()


def test_first_and_last_stage_counts():
    assert split_layers(4, 4, first_stage_layers=2, last_stage_layers=0).slots == ((0, 1), (2,), (3,), ())
    assert split_layers(5, 4, first_stage_layers=2).slots == ((0, 1), (2,), (3,), (4,))
    assert split_layers(61, 8, first_stage_layers=5, last_stage_layers=2).layers(7) == [59, 60]
    assert [len(s) for s in split_layers(61, 8, first_stage_layers=5, last_stage_layers=2).slots] == [5] + [9] * 6 + [2]
    with pytest.raises(ValueError, match="leave 3 of the 4 decoder layers for 2 other stage"):
        split_layers(4, 3, first_stage_layers=1)
    with pytest.raises(ValueError, match="leave -1"):
        split_layers(4, 2, first_stage_layers=5)
    with pytest.raises(ValueError, match="more than one pipeline stage"):
        split_layers(4, 1, last_stage_layers=1)
    with pytest.raises(ValueError, match="must be an int >= 0"):
        split_layers(4, 2, first_stage_layers=-1)


def test_stages_of_rank():
    assert [stages_of_rank("1f1b", 4, r) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stages_of_rank("dualpipev", 4, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # Virtual stages: round-robin, rank r holds r, r + pp, ...; the embedding (stage 0) on rank 0, the head on pp-1.
    assert [stages_of_rank("1f1b", 2, r, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [stages_of_rank("zbh1", 4, r, 3) for r in range(4)] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert [stages_per_rank(s, v) for s, v in [("1f1b", 1), ("zbh1", 2), ("1f1b", 4), ("dualpipev", 1)]] == [1, 2, 4, 2]
    with pytest.raises(ValueError, match="pipeline schedule must be one of"):
        stages_of_rank("gpipe", 2, 0)
    with pytest.raises(ValueError, match="DualPipeV already holds 2 stages per rank in a V"):
        stages_of_rank("dualpipev", 2, 0, 2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_virtual_stages_per_pipeline_rank must be an int >= 1"):
            stages_per_rank("1f1b", bad)


def test_virtual_stage_split():
    # tiny's 4 layers over pp 2 x V 2: one layer per stage; rank 0 runs layers 0 and 2, rank 1 layers 1 and 3.
    assert split_layers(4, 4, virtual_stages=2).slots == ((0,), (1,), (2,), (3,))
    # pipeline8: 8 layers over pp 4 x V 2 (one each), and over pp 2 x V 2 (two each).
    assert split_layers(8, 8, virtual_stages=2).slots == tuple((i,) for i in range(8))
    assert split_layers(8, 4, virtual_stages=2).slots == ((0, 1), (2, 3), (4, 5), (6, 7))
    # Megatron-core's uneven split under a virtual pipeline: the first / last RANK's layers, spread over its V stages.
    # pp 2 x V 2, first rank 2 layers (stages 0 and 2: one each), last rank the other 4 (stages 1 and 3: two each).
    assert split_layers(6, 4, first_stage_layers=2, virtual_stages=2).slots == ((0,), (1, 2), (3,), (4, 5))
    # pp 4 x V 2: first rank 4 layers, last rank 2, the two middle ranks (10 - 6) / 2 = 2 each; one per stage but rank
    # 0's two.
    got = split_layers(10, 8, first_stage_layers=4, last_stage_layers=2, virtual_stages=2)
    assert [len(s) for s in got.slots] == [2, 1, 1, 1, 2, 1, 1, 1]
    assert [i for s in range(8) for i in got.layers(s)] == list(range(10))
    with pytest.raises(ValueError, match=r"but rank 0 holds 3 \(Megatron-core: .* must divide by 2\)"):
        split_layers(7, 4, first_stage_layers=3, virtual_stages=2)
    with pytest.raises(ValueError, match="but rank 1 holds 1, rank 2 holds 1 "):
        split_layers(6, 8, first_stage_layers=2, last_stage_layers=2, virtual_stages=2)
    with pytest.raises(ValueError, match="leave 1 of the 5 decoder layers for 0 other pipeline rank"):
        split_layers(5, 4, first_stage_layers=2, last_stage_layers=2, virtual_stages=2)
    with pytest.raises(ValueError, match="do not place round-robin"):
        split_layers(4, 3, virtual_stages=2)


@pytest.mark.parametrize(
    "schedule, pp, micro_batches, message",
    [
        ("dualpipev", 2, 3, "DualPipeV needs at least 2 \\* pp = 4 micro-batches"),
        ("zbh1", 4, 6, "rounds of pp=4: micro_batches=6"),
        ("1f1b", 2, 0, "micro_batches must be >= 1"),
        ("1f1b", 4, 2, "1F1B needs at least pp = 4 micro-batches"),
        ("interleaved", 2, 4, "pipeline schedule must be one of"),
    ],
)
def test_schedule_rules(schedule, pp, micro_batches, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(schedule, pp, micro_batches)


@pytest.mark.parametrize(
    "schedule, pp, micro_batches, virtual, message",
    [
        # Megatron-core's rule (microbatch_group_size_per_vp_stage = pp): m a multiple of pp, which also keeps
        # torch's interleaved schedules' own rule (m a multiple of max(1, m // pp) rounds).
        ("1f1b", 2, 3, 2, "micro-batches in groups of pp=2: micro_batches=3 must be a multiple of 2"),
        ("1f1b", 4, 2, 2, "micro_batches=2 must be a multiple of 4"),  # fewer than pp: torch runs it, Megatron not
        ("zbh1", 4, 3, 2, "interleaved zbh1.*micro_batches=3 must be a multiple of 4"),  # plain ZB-H1 runs 3
        ("1f1b", 4, 10, 2, "micro_batches=10 must be a multiple of 4"),  # torch runs 10 (2 rounds of 5)
        ("1f1b", 1, 2, 2, "virtual stages per pipeline rank need pp > 1"),
        ("dualpipev", 2, 8, 2, "DualPipeV already holds 2 stages per rank"),
        ("1f1b", 2, 4, 0, "num_virtual_stages_per_pipeline_rank must be an int >= 1"),
    ],
)
def test_virtual_stage_schedule_rules(schedule, pp, micro_batches, virtual, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(schedule, pp, micro_batches, virtual)


def test_schedule_counts_that_run():
    for schedule, pp, m in [("1f1b", 4, 4), ("zbh1", 4, 8), ("zbh1", 4, 3), ("dualpipev", 2, 4), ("dualpipev", 4, 9)]:
        check_schedule(schedule, pp, m)
    for schedule, pp, m, v in [("1f1b", 2, 2, 2), ("zbh1", 2, 4, 2), ("1f1b", 4, 8, 2), ("zbh1", 4, 12, 3)]:
        check_schedule(schedule, pp, m, v)


@pytest.mark.parametrize("schedule", ["zbh1", "dualpipev"])
def test_a_split_backward_schedule_needs_the_model_built_for_it(schedule):
    """The MoE layers' self-deferred expert weight gradients are a build-time choice (`pipeline_moe_options`): a
    split-backward schedule refuses a model built with them on, before it prunes or communicates anything."""
    from types import SimpleNamespace

    from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
    from moe.trainer.pipeline import PipelineRunner, pipeline_moe_options

    cfg = DeepseekV3Config.from_toml("examples/deepseek_v3/configs/tiny.toml")
    parallel = SimpleNamespace(layout=SimpleNamespace(pp=2), pp_rank=0)
    split = split_layers(cfg.num_hidden_layers, 2 * SCHEDULE_STAGES_PER_RANK[schedule])
    kw = dict(schedule=schedule, split=split, micro_batches=4, micro_rows=1, seq_len=8, mtp_loss_weight=0.3, num_mtp=1)
    model = DeepseekV3ForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"MoE layers \[0, 1, 2.*\] defer .*pipeline_moe_options"):
        PipelineRunner(model, parallel, **kw)
    assert len(model.layers) == cfg.num_hidden_layers  # nothing pruned
    assert pipeline_moe_options("1f1b") == {}
    assert pipeline_moe_options(schedule) == {"overlap_dispatch_backward_with_experts_wgrad": False}
