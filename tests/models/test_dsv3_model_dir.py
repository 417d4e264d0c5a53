"""Model directories: round trip (dtypes kept), private files, atomic publication, overwrite, extra files."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from moe.trainer.io.atomic import atomic_directory
from moe.trainer.models.deepseek_v3 import read_model_dir, write_model_dir

from .dsv3_testlib import our_model, tiny_config

pytestmark = pytest.mark.timeout(60)


def test_round_trip_keeps_dtypes_and_extensions(tmp_path):
    config = tiny_config(mtp_loss_weight=0.1, seq_aux_loss_coeff=1e-4)
    state = our_model(config, dtype=torch.bfloat16).full_state_dict()
    path = write_model_dir(tmp_path / "step_1", state, config, write_extra=lambda d: (d / "opt.pt").write_bytes(b"x"))
    loaded, loaded_config = read_model_dir(path)
    assert loaded_config == config
    assert loaded.keys() == state.keys()
    for key in state:
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key]), key
    assert loaded["layers.1.mlp.router.expert_bias.bias"].dtype == torch.float32
    doc = json.loads((path / "config.json").read_text())
    assert doc["model_type"] == "deepseek_v3" and doc["dtype"] == "bfloat16"
    assert doc["mtdeepep"]["mtp_loss_weight"] == 0.1
    assert (path / "opt.pt").read_bytes() == b"x"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for child in path.iterdir():
        assert stat.S_IMODE(os.stat(child).st_mode) == 0o600, child
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # no temporary left behind


def test_existing_dir_and_failures(tmp_path):
    config = tiny_config(num_nextn_predict_layers=0, num_hidden_layers=1)
    state = our_model(config).full_state_dict()
    path = write_model_dir(tmp_path / "m", state, config)
    with pytest.raises(FileExistsError):
        write_model_dir(path, state, config)
    state2 = {k: v + 1 for k, v in state.items()}
    write_model_dir(path, state2, config, overwrite=True)
    assert torch.equal(read_model_dir(path)[0]["norm.weight"], state2["norm.weight"])

    def fail(tmp):
        (tmp / "partial").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_directory(tmp_path / "n", fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # neither the target nor a temporary
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        read_model_dir(tmp_path)
