"""Flash checkpoints in one process (moe/trainer/train/checkpoint/): what the step blocks for is a copy, the background
write commits an atomic directory with a manifest of sha256s, its errors reach the main thread, a process killed in the
middle of a write leaves the previous checkpoint, and damaged checkpoints are skipped with a warning."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from moe.trainer.io import shard_files as sf
from moe.trainer.train import checkpoint as ckpt
from moe.trainer.train import faults
from moe.trainer.train.checkpoint import train_state as ts
from moe.trainer.train.checkpoint.writer import CheckpointWriteError, SaveRequest, ShardWriter
from moe.trainer.train.optim import MasterAdamW
from moe.trainer.train.parallel_state import Layout, ParallelState
from moe.trainer.train.training_config import OptimizerConfig, TrainingConfig
from mtdeepep.utils.testing import run_processes

PAR = ParallelState.single()


def _trained(seed: int = 0, par: ParallelState = PAR) -> tuple[nn.Module, MasterAdamW]:
    """A small model after one AdamW step (moments exist), random weights (the same on every rank)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = MasterAdamW(model, [], OptimizerConfig(lr=1e-2), par)
    model(torch.randn(8, 32)).square().sum().backward()
    opt.reduce_gradients()
    opt.step(1e-2)
    return model, opt


def _save(cp: ShardWriter, step: int, model: nn.Module, opt: MasterAdamW, extra=(), par=PAR) -> Path:
    entries = ts.model_entries(model, par) + ts.optimizer_entries(opt, par)
    tensors, info = ts.rank_state(model)
    return cp.save(step, entries, tensors, info, SaveRequest(trainer_state={"step": step}, extra_files=tuple(extra)))


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("flash-checkpoint-")]


def test_save_commits_what_the_step_copied(tmp_path):
    model, opt = _trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {st.key: st.tensor.clone() for st in opt.state_tensors()}
    (tmp_path / "tokenizer.json").write_text("{}")
    cp = ShardWriter(tmp_path, PAR)
    final = _save(cp, 3, model, opt, extra=[tmp_path / "tokenizer.json"])
    with torch.no_grad():  # training goes on while the thread writes: the checkpoint keeps the copied values
        for p in model.parameters():
            p.add_(1.0)
    cp.close()
    assert not _writer_threads()
    assert cp.stats[0].copy_s > 0 and cp.stats[0].shard_bytes > 0 and cp.stats[0].total_bytes > cp.stats[0].shard_bytes
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_3"]
    assert ckpt.latest_checkpoint(tmp_path) == final and ckpt.is_complete(final, verify_checksums=True)
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world"] == 1 and len(manifest["session"]) == 12
    assert set(manifest["files"]) == {"trainer_state.json", "tokenizer.json", "rank_00000/index.json",
                                      *(f"rank_00000/{n}" for n in sf.SECTION_FILES.values())}  # fmt: skip
    for rel, record in manifest["files"].items():
        assert sf.sha256_file(final / rel) == sf.FileRecord(record["sha256"], record["bytes"]), rel
    # The streamed files are plain safetensors.
    stored = load_file(str(final / "rank_00000" / "model.safetensors"))
    assert stored["0.weight@0,0"].shape == (96, 32) and torch.equal(stored["0.weight@0,0"], before["0.weight"])
    # Read back into another model and optimizer: exactly the state at the save.
    model2, opt2 = _trained(seed=1)
    with sf.CheckpointReader(final) as reader:
        ts.load_entries(reader, ts.model_entries(model2, PAR) + ts.optimizer_entries(opt2, PAR, create=True))
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(st.tensor, moments[st.key]) for st in opt2.state_tensors())


def test_a_write_error_reaches_the_main_thread(tmp_path, monkeypatch):
    model, opt = _trained()
    cp = ShardWriter(tmp_path, PAR)
    _save(cp, 1, model, opt)
    cp.wait()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf, "write_safetensors", full_disk)
    _save(cp, 2, model, opt)
    with pytest.raises(CheckpointWriteError, match="checkpoint of step 2 failed: .*No space left"):
        cp.wait()
    cp.close()  # reported once
    assert not _writer_threads()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]
    _save(cp, 3, model, opt)
    with pytest.raises(CheckpointWriteError, match="No space left"):
        cp.close()  # the last checkpoint's error is raised by close
    assert not _writer_threads() and ckpt.latest_checkpoint(tmp_path).name == "step_1"


def _dp2_then_rank1_fails(proc, run_dir: str, monkeypatch_target) -> str:
    proc.init_group(timeout_s=60)
    par = ParallelState.from_process_group(Layout(world=2))
    model, opt = _trained(par=par)
    cp = ShardWriter(run_dir, par, timeout_s=60)
    _save(cp, 1, model, opt, par=par)
    cp.close()
    proc.send({("model", k): v.numpy().copy() for k, v in model.state_dict().items()}
              | {("optimizer", st.key): st.tensor.detach().numpy().copy() for st in opt.state_tensors()})  # fmt: skip
    if par.rank == 1:
        sf.write_safetensors = monkeypatch_target
    _save(cp, 2, model, opt, par=par)
    try:
        cp.close()
    except CheckpointWriteError as exc:
        return str(exc)
    return "no error"


def _full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.slow  # slow: 2-rank writes
def test_two_ranks_share_the_writes_and_one_failing_fails_the_checkpoint(tmp_path):
    result = run_processes(_dp2_then_rank1_fails, 2, (str(tmp_path), _full_disk), timeout_s=120)
    messages = [result.values[r][-1] for r in range(2)]
    saved = result.values[0][0]  # rank 0's state at step 1 (the replicas are identical)
    assert "checkpoint of step 2 failed: [Errno 28] No space left" in messages[1]
    # Rank 0 learns it from rank 1's error marker or from the all-reduce of close, whichever comes first.
    assert re.search("another rank failed to write its shard|rank 1 failed to write its shard: OSError", messages[0])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]
    step1 = tmp_path / "checkpoints" / "step_1"
    assert ckpt.is_complete(step1, verify_checksums=True)
    # Two data-parallel replicas: each stored about half of the model and optimizer bytes, every element once.
    sizes = [sum(f.stat().st_size for f in (step1 / f"rank_0000{r}").glob("*.safetensors")) for r in range(2)]
    assert min(sizes) > 0.4 * sum(sizes), sizes
    with sf.CheckpointReader(step1) as reader:
        assert reader.world == 2 and len(saved) == 6 + 12  # 3 weights and biases, 2 moments each
        for (section, key), value in saved.items():
            assert torch.equal(reader.read_full(section, key), torch.from_numpy(value)), key


def _save_then_die_writing(proc, run_dir: str) -> None:
    model, opt = _trained()
    cp = ShardWriter(run_dir, PAR)
    _save(cp, 1, model, opt)
    cp.close()
    os.environ[faults.CRASH_ENV] = "kill_in_write:0:2"
    cp = ShardWriter(run_dir, PAR, faults=faults.FaultPlan.from_env())
    _save(cp, 2, model, opt)
    cp.close()
    raise AssertionError("the fault did not fire")


@pytest.mark.slow  # slow: a killed writer
def test_killed_in_the_middle_of_a_write_leaves_the_previous_checkpoint(tmp_path):
    result = run_processes(_save_then_die_writing, 1, (str(tmp_path),), timeout_s=120)
    assert result.exitcodes == [-signal.SIGKILL]
    root = tmp_path / "checkpoints"
    partial = [p for p in root.iterdir() if p.name.startswith(".step_2.partial-")]
    assert len(partial) == 1 and not (partial[0] / "manifest.json").exists()
    assert [p.name for p in (partial[0] / "rank_00000").iterdir() if p.name.endswith(".tmp")]  # really mid-write
    assert ckpt.latest_checkpoint(tmp_path).name == "step_1"
    assert ckpt.find_resumable(tmp_path, verify_checksums=True)[0].name == "step_1"
    # The next run's first save removes the leftover.
    model, opt = _trained()
    cp = ShardWriter(tmp_path, PAR)
    _save(cp, 3, model, opt)
    cp.close()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_3"]


def test_damaged_checkpoints_are_skipped_with_a_warning(tmp_path, capsys):
    model, opt = _trained()
    cp = ShardWriter(tmp_path, PAR)
    for step in (1, 2, 3):
        _save(cp, step, model, opt)
    cp.close()
    root = tmp_path / "checkpoints"
    optimizer_file = root / "step_3" / "rank_00000" / "optimizer.safetensors"
    data = bytearray(optimizer_file.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum tells
    optimizer_file.write_bytes(bytes(data))
    (root / "step_2" / "manifest.json").unlink()  # never finished
    assert ckpt.find_resumable(tmp_path, warn=False)[0].name == "step_3"  # sizes only
    path, skipped = ckpt.find_resumable(tmp_path, verify_checksums=True)
    assert path.name == "step_1"
    assert [(p.name, reason.split()[0]) for p, reason in skipped] == [("step_3", "rank_00000/optimizer.safetensors"),
                                                                      ("step_2", "no")]  # fmt: skip
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "corrupted" in err and "was not finished" in err
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 3]
    with pytest.raises(ValueError, match="not a complete"):
        ckpt.read_trainer_state(root / "step_2")


def test_no_checkpoint_yet(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None and ckpt.list_checkpoints(tmp_path) == []
    assert ckpt.find_resumable(tmp_path) == (None, [])


def test_bad_pointer_is_reported(tmp_path):
    model, opt = _trained()
    cp = ShardWriter(tmp_path, PAR)
    _save(cp, 1, model, opt)
    cp.close()
    (tmp_path / "checkpoints" / "latest").write_text("step_9\n")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("../../etc\n")
    with pytest.raises(ValueError, match="not a checkpoint name"):
        ckpt.latest_checkpoint(tmp_path)


def test_fault_specs_are_checked():
    assert faults.parse_crash("kill_in_write:1:8") == faults.Fault("kill_in_write", 1, step=8)
    with pytest.raises(ValueError, match="KIND:RANK:STEP"):
        faults.parse_crash("kill:1")
    # The old spelling joins the JSON plan of the same run.
    environ = {faults.ENV: '[{"kind": "kill_at_step", "step": 6, "rank": 1}]', faults.CRASH_ENV: "kill_in_write:0:8"}
    assert faults.FaultPlan.from_env(environ).faults == [faults.Fault("kill_at_step", 1, step=6),
                                                         faults.Fault("kill_in_write", 0, step=8)]  # fmt: skip
    # pause_in_write: once, halfway through the rank's shard of its step, for its seconds.
    plan = faults.FaultPlan.from_json('[{"kind": "pause_in_write", "step": 4, "rank": 2, "seconds": 0.2}]')
    assert plan.faults == [faults.Fault("pause_in_write", 2, step=4, seconds=0.2)]
    took = []
    for written, step, rank in [(10, 4, 2), (60, 3, 2), (60, 4, 1), (60, 4, 2), (100, 4, 2)]:
        start = time.monotonic()
        plan.at("checkpoint_write", step=step, rank=rank, written=written, total=100, what="model")
        took.append(time.monotonic() - start >= 0.2)
    assert took == [False, False, False, True, False]
    with pytest.raises(ValueError, match="pause_in_write seconds"):
        faults.FaultPlan.from_json('[{"kind": "pause_in_write", "step": 4, "seconds": -1}]')


def _state_list(model: nn.Module, opt: MasterAdamW, seed: int = 0) -> ts.TrainState:
    """The trainer's state list for a small model (the data position of 10 training windows)."""
    cfg = TrainingConfig(steps=4, global_batch=1, seq_len=2)
    progress = ts.TrainProgress(seed, PAR, {"title": "t"})
    return ts.TrainState([progress, ts.DataPosition(cfg, SimpleNamespace(num_train=10), progress),
                          ts.LRSchedule(OptimizerConfig(lr=1e-2), cfg.steps, progress, is_main=True),
                          ts.ModelState(model, PAR), ts.OptimizerState(opt, PAR),
                          ts.RankLocalState(model, PAR)])  # fmt: skip


def test_checkpointer_owns_cadence_purging_and_load(tmp_path, capsys):
    model, opt = _trained()
    state = _state_list(model, opt)
    cp = ckpt.Checkpointer(tmp_path, PAR, state, every=2, keep_last=2)
    saved = {}
    for step in (1, 2, 2, 3, 4, 5, 6):  # step 2 again: a step replayed after a rewind is not saved twice
        state.progress.step = step
        with torch.no_grad():
            model[0].weight.add_(1.0)
        path = cp.save(step, last_step=step == 5)
        if path is not None:
            saved[step] = (path, model[0].weight.clone())
    cp.close()
    assert sorted(saved) == [2, 4, 5, 6] and len(cp.stats) == 4
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [5, 6]  # keep_last = 2
    assert ckpt.latest_checkpoint(tmp_path).name == "step_6"
    trainer_state = ckpt.read_trainer_state(saved[6][0])  # every component's keys
    assert set(trainer_state) == {"step", "seed", "layout", "title", "data", "schedule", "optimizer", "rng"}
    assert trainer_state["step"] == 6 and trainer_state["data"]["next_step"] == 7
    assert trainer_state["optimizer"] == {"kind": "MasterAdamW", "steps": 1}
    # Load into another model and optimizer: the state of step 5, the counters too.
    model2, opt2 = _trained(seed=1)
    opt2.set_steps(0)
    state2 = _state_list(model2, opt2)
    cp2 = ckpt.Checkpointer(tmp_path, PAR, state2)
    assert cp2.find_resumable() == saved[6][0]
    assert cp2.load(saved[5][0]) == 5 and state2.progress.step == 5 and opt2.steps == 1
    assert torch.equal(model2[0].weight, saved[5][1])
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(opt2.state_tensors(), opt.state_tensors()))
    assert "resumed from" in capsys.readouterr().out
    with pytest.raises(ValueError, match="seed=0, this run has 1"):
        ckpt.Checkpointer(tmp_path, PAR, _state_list(model2, opt2, seed=1)).load(saved[5][0])
