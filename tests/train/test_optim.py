"""MasterAdamW over an expert-parallel layout equals one process that holds the gradients of the global loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe.trainer.train.optim import MasterAdamW
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.training_config import OptimizerConfig
from tests.train import optim_cases as cases
from tests.train.state_io import load_state, save_state


@pytest.mark.slow  # slow: 4-rank optimizer runs
@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_sharded_update_equals_one_process(rank_pools, tmp_path, ep, clip):
    ref_norms, ref_params, ref_state = cases.reference(3, clip, ep, str(tmp_path / "ref"))
    results = rank_pools[4].run(cases.sharded_case, 3, clip, ep, str(tmp_path / "ranks"))
    L = cases.E // ep
    for rank, (norms, params, full_state) in enumerate(results):
        # Sums of 4 FP32 terms in another order, then a norm in float64: agreement to a few ulps.
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0)
        for name in ("dense", "norm"):
            torch.testing.assert_close(params[name], ref_params[name], rtol=1e-6, atol=1e-7)
        s = rank % ep
        torch.testing.assert_close(params["experts"], ref_params["experts"][s * L : (s + 1) * L], rtol=1e-6, atol=1e-7)
        assert set(full_state) == set(ref_state)
        for key in full_state:  # gathered from the EP group's checkpoint boxes: all experts, in expert order
            torch.testing.assert_close(full_state[key], ref_state[key], rtol=1e-6, atol=1e-7)
    if clip:
        assert max(ref_norms) > clip  # clipping did act (the norm is that of 4 summed N(0,1) gradients)


@pytest.mark.slow  # slow: resharding across layouts
def test_full_state_loads_into_another_layout(rank_pools, tmp_path):
    _, _, ref_state = cases.reference(2, 1.0, 2, str(tmp_path / "ref"))
    checkpoint = str(tmp_path / "ref" / "checkpoints" / "step_2")
    for ep in (1, 4):
        results = rank_pools[4].run(cases.reload_case, checkpoint, 2, ep, str(tmp_path / f"ep{ep}"))
        L = cases.E // ep
        for rank, (local, full_state) in enumerate(results):
            s = rank % ep
            assert torch.equal(local, ref_state["experts.exp_avg"][s * L : (s + 1) * L])
            assert all(torch.equal(full_state[k], ref_state[k]) for k in ref_state)


def test_bf16_parameters_keep_fp32_master_weights(tmp_path):
    _, params, state = cases.reference(3, 1.0, 1, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    _, params32, _ = cases.reference(3, 1.0, 1, str(tmp_path / "fp32"), dtype=torch.float32)
    assert params["dense"].dtype == torch.bfloat16
    assert state["dense.master"].dtype == torch.float32
    assert torch.equal(params["dense"], state["dense.master"].to(torch.bfloat16))
    # The master weights follow the FP32 run up to the rounding of the bf16 initial values and gradients.
    torch.testing.assert_close(state["dense.master"], params32["dense"], rtol=0, atol=0.05)


def test_weight_decay_only_on_matrices():
    model = cases.Toy(cases.E)
    opt = MasterAdamW(model, [model.experts], OptimizerConfig(lr=1.0, weight_decay=0.5), ParallelState.single())
    decay, no_decay = opt.adamw.param_groups
    assert decay["weight_decay"] == 0.5 and {id(p) for p in decay["params"]} == {id(model.dense), id(model.experts)}
    assert no_decay["weight_decay"] == 0.0 and [id(p) for p in no_decay["params"]] == [id(model.norm)]


def test_state_mismatch_is_reported(tmp_path):
    cfg = OptimizerConfig(lr=1.0)
    model = cases.Toy(cases.E)
    opt = MasterAdamW(model, [model.experts], cfg, ParallelState.single())
    other = nn.Linear(5, 3)  # "weight" [3, 5] and "bias", not the Toy's parameters
    other_opt = MasterAdamW(other, [], cfg, ParallelState.single())
    other(torch.ones(1, 5)).sum().backward()
    other_opt.reduce_gradients()
    other_opt.step(1.0)
    path = save_state(other_opt, ParallelState.single(), tmp_path)
    with pytest.raises(
        ValueError, match=r"the checkpoint has no optimizer tensor '(dense|norm|experts)\.(exp_avg|exp_avg_sq)'"
    ):
        load_state(opt, ParallelState.single(), path, steps=1)
