"""The layout enumeration: every accepted layout passes the trainer's own rules, every choice is counted once, and
the rejections carry the right reasons."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from moe.trainer import run
from moe.trainer.models.deepseek_v3 import DeepseekV3Config
from moe.trainer.models.deepseek_v3.tensor_parallel import check_tensor_parallel
from moe.trainer.pipeline.split import check_schedule
from moe.trainer.plan.devices import CPU, MTT_S4000
from moe.trainer.plan.model_shape import RECOMPUTE_CHOICES
from moe.trainer.plan.search import plan
from moe.trainer.plan.space import (
    PIPELINE_SCHEDULES,
    REASONS,
    Candidate,
    Workload,
    divisors,
    enumerate_candidates,
)
from moe.trainer.train import job_config
from moe.trainer.train.layout_rules import check_expert_tensor_parallel, check_model_layout
from moe.trainer.train.parallel_state import FP8_RECIPES, Layout

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "deepseek_v3" / "configs"
TINY = DeepseekV3Config.from_toml(CONFIGS / "tiny.toml")
WORK = Workload(global_batch=32, micro_batches=4, seq_len=128, dtype="float32")


def all_choices(world: int) -> int:
    """Every complete choice, counted independently of the planner: TP x PP x EP x ETP over the divisors of the
    world, times the schedules (one without pipeline), recomputes, FP8 recipes and ZeRO-1 (when some state can be
    sharded)."""
    total = 0
    for tp, pp, ep, etp in itertools.product(divisors(world), repeat=4):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        edp = dp * tp // (ep * etp) if (dp * tp) % (ep * etp) == 0 else 1
        zeros = 2 if max(dp, edp) > 1 else 1
        schedules = 1 if pp == 1 else len(PIPELINE_SCHEDULES)
        total += schedules * len(RECOMPUTE_CHOICES) * len(FP8_RECIPES) * zeros
    return total


@pytest.mark.parametrize("world", [1, 4, 8])
def test_every_choice_is_counted_once(world):
    result = plan(TINY, WORK, world, CPU)
    assert result.total == all_choices(world)
    assert len(result.ranked) + sum(result.rejected.values()) == result.total
    assert set(result.rejected) <= set(REASONS)


def test_accepted_layouts_pass_the_trainer_rules():
    space = enumerate_candidates(TINY, WORK, 8, CPU)
    assert space.accepted
    assert job_config.check_model_layout is check_model_layout  # the planner's rule is the trainer's own
    for c in space.accepted:
        layout = Layout(world=c.world, tp=c.tp, pp=c.pp, ep=c.ep, etp=c.etp)  # raises if the folding is broken
        layout.check_experts(TINY.n_routed_experts)
        layout.check_batch(WORK.global_batch, WORK.micro_batches)
        check_tensor_parallel(TINY, c.tp)
        check_expert_tensor_parallel(TINY, c.etp, c.fp8)  # whole FFN shares, whole FP8 tiles (train.py's rule)
        assert c.micro_rows(WORK) >= 1
        if c.pp > 1:
            interleaved = c.schedule == "interleaved"
            check_schedule("1f1b" if interleaved else c.schedule, c.pp, WORK.micro_batches, c.vpp if interleaved else 1)
        # train.py's own parser and checks accept the flags the planner prints
        _, overrides = job_config.parse(run.build_parser(), ["--config", "c.toml", "--out", "o", *c.train_flags()])
        given = {o.path: o.value for o in overrides}
        sizes = (given.get(("parallel", name), 1) for name in ("tp", "pp", "ep", "etp"))
        assert tuple(sizes) == (c.tp, c.pp, c.ep, c.etp)
        schedule = given.get(("parallel", "pp_schedule"), "1f1b")
        vpp = given.get(("parallel", "num_virtual_stages_per_pipeline_rank"), 1)
        assert c.pp == 1 or (schedule, vpp) == ((c.schedule, 1) if c.schedule != "interleaved" else ("1f1b", c.vpp))
        assert bool(given.get(("zero", "use_distributed_optimizer"))) == c.zero1
        assert given.get(("parallel", "fp8"), "none") == c.fp8
    assert {c.etp for c in space.accepted} == {1, 2, 4, 8}  # ETP layouts are choices, not refusals


def test_rejection_reasons():
    """Each rule rejects what it should, with the example naming such a choice."""
    result = plan(TINY, WORK, 16, CPU)
    rejected, examples = result.rejected, result.examples
    assert rejected["experts"] > 0 and "ep16" in examples["experts"]  # 8 experts over 16 ranks
    assert rejected["batch"] > 0 and "dp16" in examples["batch"]  # 32 sequences over 16 x 4 micro-batches
    assert rejected["tp_shapes"] > 0 and examples["tp_shapes"].startswith(("tp8 ", "tp16 "))  # 4 heads
    assert "etp" not in rejected  # train.py runs expert tensor parallelism: only its rules reject
    assert rejected["etp_fp8"] > 0 and "etp2" in examples["etp_fp8"] and "fp8" in examples["etp_fp8"]  # 128 / 2
    assert rejected["folding"] > 0
    assert rejected["schedule"] > 0


def test_dualpipev_needs_two_micro_batches_per_rank():
    """check_schedule: DualPipeV over pp 4 needs 8 micro-batches; with 4 it is rejected, with 8 it is ranked."""

    def dualpipev_pp4(result):
        return [e for e in result.ranked if e.candidate.schedule == "dualpipev" and e.candidate.pp == 4]

    four = plan(TINY, WORK, 4, CPU)
    assert not dualpipev_pp4(four) and "dualpipev" in four.examples["schedule"]
    eight = plan(TINY, Workload(32, 8, 128, "float32"), 4, CPU)
    assert dualpipev_pp4(eight)


def test_fp8_on_a_device_without_fp8_and_memory_limits():
    s4000 = plan(TINY, WORK, 2, MTT_S4000)
    assert s4000.rejected["no_fp8"] > 0
    assert all(e.candidate.fp8 == "none" for e in s4000.ranked)
    tiny_memory = CPU.replace(memory_gib=0.5)  # 0.25 GiB per rank with 2 ranks: below the process runtime
    none = plan(TINY, WORK, 2, tiny_memory)
    assert not none.ranked and none.rejected["memory"] > 0


def test_interleaved_layouts_are_train_py_runs():
    """Interleaved 1F1B is train.py's 1f1b with virtual stages: its candidates are ranked, their flags give the
    same layout in train.py's config tree, and Megatron's micro-batch rule (a multiple of pp) rejects the others."""
    result = plan(TINY, WORK, 4, CPU)
    interleaved = [e.candidate for e in result.ranked if e.candidate.schedule == "interleaved"]
    assert interleaved
    for c in {(c.pp, c.vpp): c for c in interleaved}.values():
        job = job_config.load_job(
            CONFIGS / "tiny.toml",
            job_config.parse(run.build_parser(), ["--config", "c", "--out", "o", *c.train_flags()])[1],
            world=c.world,
        )
        assert (job.layout.pp, job.layout.vpp, job.layout.pp_schedule) == (c.pp, c.vpp, "1f1b")
        assert job.split.num_stages == c.stages
    odd = plan(TINY, Workload(30, 6, 128, "float32"), 4, CPU)  # 6 micro-batches: not a multiple of pp 4
    pp4 = {e.candidate.schedule for e in odd.ranked if e.candidate.pp == 4}
    assert "1f1b" in pp4 and "interleaved" not in pp4


def test_candidate_rejects_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="does not split"):
        Candidate(world=4, tp=1, pp=1, ep=1).micro_rows(Workload(global_batch=6, micro_batches=4, seq_len=8))


def test_bad_arguments():
    with pytest.raises(ValueError, match="devices"):
        enumerate_candidates(TINY, WORK, 0, CPU)
    with pytest.raises(ValueError, match="unknown recompute"):
        enumerate_candidates(TINY, WORK, 2, CPU, recomputes=("sometimes",))
    with pytest.raises(ValueError, match="global_batch"):
        Workload(global_batch=0, micro_batches=1, seq_len=8)
    with pytest.raises(ValueError, match="dtype"):
        Workload(global_batch=1, micro_batches=1, seq_len=8, dtype="float16")
