"""ZeRO-1 (moe/trainer/train/zero.py): the same parameters, norms and state as MasterAdamW, sharded state, the
contract's tags, overlap of the bucket reductions with the backward (and under a pipeline with the schedule: each
stage's buckets after its last weight-gradient action, bit for bit the same training), and deadlines."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.trainer.train.optim import MasterAdamW
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.training_config import OptimizerConfig
from moe.trainer.train.zero import DistributedAdamW, ZeroConfig
from tests.train import zero_cases as cases
from tests.train import zero_pipeline_cases as zcases
from tests.train.state_io import load_state, save_state

# Both optimizers sum the same FP32 gradients with gloo, but over differently cut buffers, so with more than 2 ranks
# the order of the additions may differ: a few ulps (~1e-7 relative) per gradient element. AdamW's update
# m / (sqrt(v) + eps) carries a relative error of the gradient through with a factor of about 1, so after 3 steps of
# lr <= 3e-2 the parameters may differ by ~1e-8 absolute; rtol 1e-5 / atol 1e-6 leaves a wide margin and still
# catches any missing or doubled contribution (those change values at the 1e-3 level).
RTOL, ATOL = 1e-5, 1e-6


def _config(**kw) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, **kw)


@pytest.mark.parametrize(
    "world, ep, micro, bucket_size",
    [(2, 1, 1, None), (2, 2, 3, 200), (4, 1, 2, 150), (4, 2, 4, 97)],
)
@pytest.mark.slow  # slow: 4-rank ZeRO-1 runs
def test_parameters_equal_plain_master_adamw(rank_pools, tmp_path, world, ep, micro, bucket_size):
    steps, clip = 3, 0.5
    results = rank_pools[world].run(cases.parity_case, ep, steps, micro, clip, bucket_size, str(tmp_path))
    for out in results:
        ref_norms, ref_params, ref_state, ref_bytes = out["ref"]
        norms, params, state, zero_bytes = out["zero"]
        # the norm of the summed gradient, every element once (float64 sums of FP32 partial norms)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0)
        assert ref_norms[0] > clip  # clipping acted
        for name in ref_params:
            torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=ATOL, msg=name)
        assert set(state) == set(ref_state)
        for key in state:
            torch.testing.assert_close(state[key], ref_state[key], rtol=RTOL, atol=ATOL, msg=key)
        if bucket_size is not None:  # several buckets, parameters cut between the ranks' shards
            assert len(out["buckets"]) > 3 and out["straddling"] > 0
        # optimizer-state bytes (FP32 parameters: the 2 moments; MasterAdamW keeps them for every element): each
        # bucket's over its group's ranks (dense: dp, experts: expert dp), padding included
        buckets = out["buckets"]
        assert ref_bytes == 8 * sum(unpadded for _, _, _, unpadded in buckets)
        assert zero_bytes == sum(8 * padded // size for _, padded, size, _ in buckets)
        if ep == 1:  # every group is the dp group: about 1/dp of plain DP
            assert ref_bytes / world <= zero_bytes <= ref_bytes / world * 1.03


@pytest.mark.slow  # slow: ZeRO-1 against AdamW over 150 steps
def test_bf16_parameters_keep_fp32_masters(rank_pools, tmp_path):
    [out, _] = rank_pools[2].run(cases.parity_case, 1, 3, 1, 0.5, 150, str(tmp_path), torch.bfloat16)
    ref_norms, ref_params, ref_state, ref_bytes = out["ref"]
    norms, params, state, zero_bytes = out["zero"]
    assert params["inp.weight"].dtype == torch.bfloat16 and state["inp.weight.master"].dtype == torch.float32
    # One micro-batch: both optimizers convert the same bf16 gradients to FP32 and sum 2 terms (order-free), so
    # the masters agree to FP32 rounding of the norms' partial sums.
    for name in ref_params:
        torch.testing.assert_close(state[f"{name}.master"], ref_state[f"{name}.master"], rtol=RTOL, atol=ATOL)
        assert torch.equal(params[name], state[f"{name}.master"].to(torch.bfloat16)), name
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0)
    # masters + 2 moments (12 bytes per element) for half the elements, plus padding
    assert ref_bytes / 2 <= zero_bytes <= 0.51 * ref_bytes


@pytest.mark.slow  # slow: 4 ranks
def test_full_state_moves_between_zero1_and_master_adamw(rank_pools, tmp_path):
    results = rank_pools[4].run(cases.state_swap_case, 2, 60, str(tmp_path))
    for state, back, ref_params, params, zero_state, other in results:
        assert set(back) == set(state)
        for key in state:  # sharded and gathered back: the same bits
            assert torch.equal(back[key], state[key]), key
        for name in ref_params:  # the step after loading: the same update as the optimizer that wrote the state
            torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=ATOL, msg=name)
        assert set(other) == set(zero_state)
        for key in zero_state:
            assert torch.equal(other[key], zero_state[key]), key


@pytest.mark.parametrize("tp, ep", [(2, 2), (2, 1), (1, 4)])
def test_tags_reduce_and_count_once(rank_pools, tp, ep):
    """TP-sharded, sequence-parallel (partial gradient per TP rank) and expert parameters against one process
    holding the full parameters and the gradients of the global loss."""
    steps, clip, world = 3, 2.0, 4
    results = rank_pools[world].run(cases.tagged_case, tp, ep, steps, clip, 5)
    ranks = [(r, tp_rank, ep_rank) for r, (tp_rank, ep_rank, _, _) in enumerate(results)]
    full = {k: nn.Parameter(v.clone()) for k, v in cases.full_tagged().items()}
    model = nn.ParameterDict(full)
    ref = MasterAdamW(model, [], cases.config(clip), ParallelState.single())
    rows, n = 8 // tp, cases.E // ep
    ref_norms = []
    for step in range(1, steps + 1):
        ref.zero_grad()
        grads = {k: torch.zeros_like(v) for k, v in full.items()}
        for r, tp_rank, ep_rank in ranks:
            g = cases.tagged_grads(r, step, tp, ep, tp_rank, ep_rank)
            grads["col"][tp_rank * rows : (tp_rank + 1) * rows] += g["col"]
            grads["norm"] += g["norm"]
            grads["experts"][ep_rank * n : (ep_rank + 1) * n] += g["experts"]
        for k, p in full.items():
            p.grad = grads[k]
        ref.reduce_gradients()
        norm = ref.global_grad_norm()
        ref.clip(norm)
        ref.step(lr=1e-2 * step)
        ref_norms.append(norm)
    assert ref_norms[0] > clip
    for (_, tp_rank, ep_rank), (_, _, norms, params) in zip(ranks, results):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0)
        torch.testing.assert_close(params["col"], full["col"][tp_rank * rows : (tp_rank + 1) * rows].detach(),
                                   rtol=RTOL, atol=ATOL)  # fmt: skip
        torch.testing.assert_close(params["norm"], full["norm"].detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(params["experts"], full["experts"][ep_rank * n : (ep_rank + 1) * n].detach(),
                                   rtol=RTOL, atol=ATOL)  # fmt: skip


def test_reduce_scatters_start_during_the_backward(rank_pools):
    on = rank_pools[2].run(cases.overlap_case, True)
    off = rank_pools[2].run(cases.overlap_case, False)
    for rank_steps in on:
        for s in rank_steps:
            times = [t for _, t in s["launches"]]
            assert [i for i, _ in s["launches"]] == list(range(s["num_buckets"])) and s["num_buckets"] >= 4
            assert times[0] < s["backward_end"]  # the first buckets went out while the backward still ran
            assert sum(t < s["backward_end"] for t in times) >= s["num_buckets"] - 1
    for rank_steps in off:
        for s in rank_steps:
            assert all(t >= s["backward_end"] for _, t in s["launches"])


# schedule, virtual stages per rank, micro-batches: 1F1B (a stage's last B), ZB-H1 (its last W), and rank 0
# holding stages 0 and 2 under interleaved 1F1B, stages 0 and 3 under DualPipeV (F&B actions).
PIPELINES = [("1f1b", 1, 2), ("zbh1", 1, 2), ("1f1b", 2, 2), ("dualpipev", 1, 4)]


@pytest.mark.slow  # slow: 4 ranks train tiny's model twice per schedule
@pytest.mark.parametrize("schedule, vpp, micro", PIPELINES, ids=[f"{s}_v{v}" for s, v, _ in PIPELINES])
def test_pipeline_stages_reduce_during_the_schedule(rank_pools, tmp_path, schedule, vpp, micro):
    """PP2 x DP2: each stage's buckets are launched inside the schedule, right after the stage's last
    weight-gradient action, with the same losses, norms and weights bit for bit as reducing after the schedule."""
    steps = 2
    results = rank_pools[4].run(zcases.overlap_on_off_case, schedule, vpp, micro, steps, str(tmp_path))
    assert [(r["pp_rank"], r["dp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        off, on = r["off"], r["on"]
        # The reduction is the same sum over the same buckets, only earlier: everything is bitwise equal.
        assert on["records"] == off["records"], (on["records"], off["records"])
        assert on["params"].keys() == off["params"].keys()
        for name, value in off["params"].items():
            assert torch.equal(on["params"][name], value), name
        # Buckets follow the stages: each holds parameters of one stage only (tiny ties no embedding).
        assert on["buckets"] == off["buckets"]
        stage_of = {n: s for s, names in on["stage_params"].items() for n in names}
        stages = sorted(on["stage_params"])
        assert stages == sorted(on["stage_ids"]) and len(stages) == (1 if schedule != "dualpipev" and vpp == 1 else 2)
        for _, bucket_stages, _, names in on["buckets"]:
            assert len(bucket_stages) == 1 and {stage_of[n] for n in names} == set(bucket_stages), names
        assert {b[1][0] for b in on["buckets"]} == set(stages) and len(on["buckets"]) > 2 * len(stages)
        for run, overlap in ((off, False), (on, True)):
            for t in run["timing"]:
                launches = dict(t["launches"])  # bucket index -> seconds after the schedule's end
                done = dict(t["stages_done"])  # stage -> seconds after the schedule's end
                assert sorted(launches) == [b[0] for b in run["buckets"]]  # every bucket once
                assert sorted(done) == stages and all(v < 0 for v in done.values())  # reported inside the schedule
                if not overlap:
                    assert all(v >= 0 for v in launches.values())  # reduced after the schedule
                    continue
                # Each bucket went out inside the schedule, once its stage was done: its launch lies between its
                # stage's report and the next report (or the schedule's end).
                reports = sorted(done.values())
                for index, bucket_stages, _, _ in run["buckets"]:
                    at = done[bucket_stages[0]]
                    later = [v for v in reports if v > at]
                    assert at <= launches[index] < (later[0] if later else 0.0), (index, at, launches[index])
    # With two stages on a rank, the first stage's buckets went out while the other stage still computed.
    if len(results[0]["on"]["stage_params"]) == 2:
        for r in results:
            for t in r["on"]["timing"]:
                first, second = sorted(v for _, v in t["stages_done"])
                assert any(first <= v < second for _, v in t["launches"])


def test_a_rank_that_never_arrives_fails_naming_the_phase(rank_pools):
    message, waited = rank_pools[2].run(cases.timeout_case)[0]
    assert "gradient reduce-scatter of bucket 0" in message and "timed out" in message
    assert waited < 10


def test_misuse_is_reported(tmp_path):
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="bucket_size"):
        ZeroConfig(bucket_size=0)
    opt = DistributedAdamW(model, [], _config(), ParallelState.single(), ZeroConfig(bucket_size=4))
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="before finish_grad_sync"):
        opt.step(1e-2)
    model(torch.ones(1, 3)).sum().backward()  # one process: every bucket "launches" as soon as it is complete
    with pytest.raises(RuntimeError, match="arrived after the reduce-scatter"):
        model(torch.ones(1, 3)).sum().backward()
    other = nn.Linear(3, 5)  # a checkpoint of another model: "weight" [5, 3]
    other_opt = MasterAdamW(other, [], _config(), ParallelState.single())
    other(torch.ones(1, 3)).sum().backward()
    other_opt.reduce_gradients()
    other_opt.step(1e-2)
    path = save_state(other_opt, ParallelState.single(), tmp_path)
    with pytest.raises(ValueError, match=r"optimizer tensor (weight|bias)\.exp_avg: the checkpoint holds shape \(5"):
        load_state(opt, ParallelState.single(), path, steps=1)
    tagged = nn.Linear(2, 2)
    tagged.weight.expert_parallel = True
    tagged.weight.sequence_parallel_grad = True
    with pytest.raises(ValueError, match="cannot be tagged sequence_parallel_grad"):
        DistributedAdamW(tagged, [], _config(), ParallelState.single())


def test_weight_decay_on_matrices_only_and_single_process_equals_master_adamw():
    cfg = _config(weight_decay=0.5, clip_grad=1.0)
    ref_model, model = nn.Linear(5, 4), nn.Linear(5, 4)
    model.load_state_dict(ref_model.state_dict())
    ref = MasterAdamW(ref_model, [], cfg, ParallelState.single())
    opt = DistributedAdamW(model, [], cfg, ParallelState.single(), ZeroConfig(bucket_size=7))
    decay, no_decay = opt.adamw.param_groups
    assert decay["weight_decay"] == 0.5 and sum(p.numel() for p in decay["params"]) == 20
    assert no_decay["weight_decay"] == 0.0 and sum(p.numel() for p in no_decay["params"]) == 4
    for step in range(1, 4):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        for o, m in ((ref, ref_model), (opt, model)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.reduce_gradients()
            o.clip(o.global_grad_norm())
            o.step(lr=0.1)
    for name, p in ref_model.named_parameters():  # one process: the same sums, the same element-wise AdamW
        assert torch.equal(dict(model.named_parameters())[name], p), name
