"""Anomalies and rewind (moe/trainer/train/rewind.py): the spike test, the in-memory snapshot, injected faults, and
examples/deepseek_v3/train.py runs that rewind (one process, and EP2 with ZeRO-1 on two processes) against runs
that skip the same steps from the start."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from moe.layer.fp8.convert import apply_fp8, fp8_moe_options
from moe.trainer import run
from moe.trainer.data.token_file import TokenBatches
from moe.trainer.io.shard_files import SECTIONS, read_full_section
from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moe.trainer.train.checkpoint import ModelIO
from moe.trainer.train.checkpoint.train_state import amax_histories
from moe.trainer.train.faults import ENV, FaultPlan
from moe.trainer.train.metrics import read_events, read_metrics
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.rewind import AnomalyDetected, SpikeDetector, StateSnapshot
from moe.trainer.train.trainer import Trainer
from moe.trainer.train.training_config import TrainerConfig
from mtdeepep.utils.testing import run_processes
from tests.train import train_cases as tc

train_script = run

# ---------------------------------------------------------------------------------------------------------------
# The spike test


def test_spike_zscore_matches_the_sample_statistics():
    rng = np.random.default_rng(0)
    losses = list(5.0 + 0.2 * rng.standard_normal(12))
    det = SpikeDetector(window=8, zscore=4.0, min_steps=3)
    for x in losses:
        det.add(x)
    window = losses[-8:]  # the window keeps the last 8
    mean, std = float(np.mean(window)), float(np.std(window, ddof=1))
    probe = mean + 5 * std
    fig = det.figures(probe)
    assert fig["window"] == 8
    assert fig["mean"] == pytest.approx(mean, rel=1e-12) and fig["std"] == pytest.approx(std, rel=1e-12)
    assert fig["zscore"] == pytest.approx(5.0, rel=1e-9)
    assert det.check(probe) is not None and det.check(mean + 3 * std) is None
    assert det.check(mean - 50 * std) is None  # a falling loss is no spike
    assert det.check(math.nan) is None  # the non-finite check's business


def test_spike_needs_history_and_a_flat_window_has_a_floor():
    det = SpikeDetector(window=5, zscore=3.0, min_steps=3)
    det.add(2.0)
    det.add(2.0)
    assert det.check(100.0) is None  # two losses: not enough history
    det.add(2.0)
    # Three equal losses: the std is floored at 1e-3 x |mean|, so a rise of 0.2% is no spike, a rise of 1% is.
    assert det.figures(2.004)["zscore"] == pytest.approx(2.0) and det.check(2.004) is None
    assert det.check(2.02) is not None
    with pytest.raises(ValueError):
        SpikeDetector(window=3, zscore=3.0, min_steps=4)


# ---------------------------------------------------------------------------------------------------------------
# The snapshot


def _trainer(tmp_path, *, zero: bool, dtype: str = "float32", fp8: str | None = None) -> Trainer:
    """tiny's model on random tokens (4 sequences of 16, two micro-batches) with snapshots every step."""
    cfg = DeepseekV3Config.from_toml(tc.TINY)
    train_cfg = TrainerConfig.flat(steps=10, global_batch=4, micro_batches=2, seq_len=16, lr=3e-3, dtype=dtype,
                               use_distributed_optimizer=zero, ddp_bucket_size=50_000,
                               rewind_snapshot_interval=1)  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg, dtype=getattr(torch, dtype), moe_options=fp8_moe_options(fp8))
    if fp8 is not None:
        apply_fp8(model, fp8)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 4000).astype(np.int64)
    batches = TokenBatches(tokens, seq_len=16, global_batch=4, val_sequences=0, seed=0)
    io = ModelIO(model.full_state_dict, lambda p, sd: None, lambda p: None)
    return Trainer(model, train_cfg, ParallelState.single(), batches, tmp_path, seed=0, model_io=io,
                   mtp_loss_weight=cfg.mtp_loss_weight, num_mtp=cfg.num_nextn_predict_layers)  # fmt: skip


def _state(trainer: Trainer) -> dict:
    """Everything a step changes, copied: model parameters and buffers (router biases and counts), the optimizer's
    state (moments, steps, masters), its step counter, the FP8 amax histories."""
    out = {f"model.{k}": v.detach().clone() for k, v in trainer.model.state_dict(keep_vars=True).items()}
    out.update({f"buffer.{k}": v.clone() for k, v in trainer.model.named_buffers()})
    opt = trainer.optimizer  # its live tensors (moments, masters; ZeRO-1: the whole shards) and AdamW's step counts
    out.update({f"optim.{i}.{st.key}": st.tensor.detach().clone() for i, st in enumerate(opt.state_tensors())})
    out.update({f"optim.step.{i}": s["step"].clone() for i, s in enumerate(opt.adamw.state.values())})
    out["optim_steps"] = torch.tensor(getattr(trainer.optimizer, "steps", -1))
    for i, h in enumerate(amax_histories(trainer.model)):
        out[f"amax.{i}"] = h.history.clone()
        out[f"amax_n.{i}"] = torch.tensor(h.num_recorded)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k  # NaN != NaN: none expected


@pytest.mark.parametrize(
    "zero, dtype, fp8",
    [(False, "float32", None), (True, "float32", None), (True, "bfloat16", None), (False, "bfloat16", "delayed")],
    ids=["adamw", "zero1", "zero1_bf16", "adamw_bf16_fp8_delayed"],
)
def test_snapshot_restores_every_piece_of_state(tmp_path, one_thread, zero, dtype, fp8):
    trainer = _trainer(tmp_path, zero=zero, dtype=dtype, fp8=fp8)
    first = StateSnapshot(trainer.state)
    first.take(1)
    at_start = _state(trainer)  # before any step: no AdamW state yet
    trainer.train_step(1)
    snap = StateSnapshot(trainer.state)
    snap.take(2)
    before = _state(trainer)
    if fp8 is not None:
        assert len(amax_histories(trainer.model)) > 30  # three per FP8 GEMM site
    trainer.train_step(2)  # moves weights, moments, step counts, biases, amaxes
    trainer.faults = FaultPlan.from_json('[{"kind": "nan_loss", "step": 3, "rank": 0}]')
    with pytest.raises(AnomalyDetected, match="step 3: the loss is nan"):
        trainer.train_step(3)  # its forward and backward poisoned the router counts and the amax histories
    after = _state(trainer)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    if fp8 is not None:  # the NaN gradient reached the grad-output amax histories
        assert any(torch.isnan(v).any() for k, v in after.items() if k.startswith("amax."))
    snap.restore()
    _assert_same(_state(trainer), before)
    assert snap.nbytes >= sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    first.restore()  # back before the first step: AdamW's lazily created state goes too
    _assert_same(_state(trainer), at_start)


def test_fault_plan_parsing():
    plan = FaultPlan.from_json(
        '[{"kind": "loss_spike", "step": 2, "rank": 1, "factor": 9.5},'
        ' {"kind": "sleep", "steps": [1, 3], "rank": 0, "phase": "dispatch", "seconds": 0.01}]'
    )
    one = torch.tensor(1.0)
    assert plan.at("loss", step=2, rank=1, value=one).item() == 9.5
    assert plan.at("loss", step=2, rank=0, value=one) is one and plan.at("loss", step=3, rank=1, value=one) is one

    class Timer:
        def set_delays(self, delays):
            self.delays = delays

    timer = Timer()
    plan.at("step_start", step=3, rank=0, timer=timer)
    assert timer.delays == {"dispatch": 0.01}
    plan.at("step_start", step=4, rank=0, timer=timer)
    assert timer.delays == {} and plan.has_delays
    assert FaultPlan.from_env({}) is None
    for text, message in [
        ("{", "not JSON"),
        ('{"kind": "nan_loss"}', "JSON list"),
        ('[{"kind": "oops", "step": 1}]', "kind must be"),
        ('[{"kind": "nan_loss", "step": 0}]', "step >= 1"),
        ('[{"kind": "loss_spike", "step": 1}]', "finite factor"),
        ('[{"kind": "sleep", "steps": [3, 2], "phase": "forward", "seconds": 1}]', r"steps \[first, last\]"),
        ('[{"kind": "sleep", "steps": [1, 2], "phase": "fwd", "seconds": 1}]', "phase must be"),
        ('[{"kind": "nan_grad", "step": 1, "seconds": 1}]', "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=message):
            FaultPlan.from_json(text)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"spiky_loss_zscore": 0}, "spiky_loss_zscore"),
        ({"spiky_loss_window": 4, "spiky_loss_min_steps": 5}, "exceeds spiky_loss_window"),
        ({"spiky_loss_min_steps": 1}, "spiky_loss_min_steps must be >= 2"),
        ({"rewind_snapshot_interval": -1}, "rewind_snapshot_interval"),
        ({"rewind_max_retries": 1.5}, "rewind_max_retries"),
        ({"iterations_to_skip": [0]}, "iterations_to_skip"),
        ({"check_for_spiky_loss": 1}, "true or false"),
        ({"straggler_factor": 1.0}, "straggler_factor must be > 1"),
        ({"straggler_interval": 0}, "straggler_interval"),
        ({"straggler_min_seconds": -0.1}, "straggler_min_seconds"),
    ],
)
def test_bad_anomaly_settings_raise(change, message):
    with pytest.raises(ValueError, match=message):
        TrainerConfig.flat(**{"steps": 10, "global_batch": 8, "seq_len": 16, "lr": 1e-3, **change})


def test_skip_list_is_sorted_and_listed():
    cfg = TrainerConfig.flat(steps=10, global_batch=8, seq_len=16, lr=1e-3, iterations_to_skip=[6, 3, 6])
    assert cfg.rewind.iterations_to_skip == (3, 6) and cfg.to_tables()["rewind"]["iterations_to_skip"] == [3, 6]


# ---------------------------------------------------------------------------------------------------------------
# Training runs: a rewound run equals a run that skipped the same steps from the start

# Spikes are looked for once two losses are in the window (of the last 8 accepted ones): from step 3 on. The
# natural losses of these runs fall step after step (negative z-scores); the injected spikes are 20x the loss.
SPIKES = {"check_for_spiky_loss": True, "spiky_loss_window": 8, "spiky_loss_min_steps": 2}
SKIPPED = [3, 6]


@pytest.fixture(scope="module")
def corpus_and_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return tc.write_corpus(root / "corpus"), root / "cache"


def _config(path, corpus_and_cache, **training):
    corpus, cache = corpus_and_cache
    return tc.make_config(path, corpus, cache, training={**SPIKES, **training})


def _main(argv, monkeypatch, faults: str = "") -> int:
    monkeypatch.setenv(ENV, faults)
    return train_script.main(argv)


def _run(argv, nproc, faults: str = ""):
    run_processes(tc.torchrun_rank_with_faults, nproc, (argv, faults), timeout_s=300)


@pytest.fixture(scope="module")
def reference_one_process(tmp_path_factory, corpus_and_cache):
    """8 steps in one process with steps 3 and 6 skipped from the start."""
    root = tmp_path_factory.mktemp("ref1")
    path = _config(root / "ref.toml", corpus_and_cache, iterations_to_skip=SKIPPED)
    run_processes(tc.torchrun_rank, 1, (["--config", str(path), "--out", str(root / "run"), "--seed", "7"],),
                  timeout_s=300)  # fmt: skip
    return root / "run"


def _assert_matches_reference(run_dir, ref_dir):
    ref, got = read_metrics(ref_dir / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 4, 5, 7, 8]
    for a, b in zip(ref, got):  # bit for bit on CPU (same layout, same batches, same seeds)
        assert (a["loss"], a["mtp_loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["mtp_loss"], b["grad_norm"],
                                                                         b["lr"]), a["step"]  # fmt: skip
    assert [e["step"] for e in read_events(ref_dir / "metrics.jsonl", "skip")] == SKIPPED
    for section in SECTIONS:  # the whole of every sharded section of the last checkpoint, bit for bit
        want = read_full_section(ref_dir / "checkpoints" / "step_8", section)
        have = read_full_section(run_dir / "checkpoints" / "step_8", section)
        assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want), section
    return got


# Snapshots every 2 steps (before steps 1, 3, 5, 7): the spike at step 3 restores the snapshot taken before it (no
# step to run again), the NaN gradient at step 6 restores the state entering step 5 and runs step 5 again.
ONE_PROCESS_FAULTS = '[{"kind": "loss_spike", "step": 3, "rank": 0, "factor": 20.0}, {"kind": "nan_grad", "step": 6}]'


@pytest.mark.slow  # slow: two training runs
def test_one_process_rewind_equals_skipping_from_the_start(tmp_path, corpus_and_cache, reference_one_process):
    path = _config(tmp_path / "c.toml", corpus_and_cache, rewind_snapshot_interval=2)
    _run(["--config", str(path), "--out", str(tmp_path / "run"), "--seed", "7"], 1, ONE_PROCESS_FAULTS)
    records = _assert_matches_reference(tmp_path / "run", reference_one_process)
    events = read_events(tmp_path / "run" / "metrics.jsonl", "rewind")
    assert [(e["step"], e["reason"], e["replayed_steps"], e["retry"]) for e in events] == [
        (3, "loss_spike", [], 1), (6, "nan_grad_norm", [5], 1)
    ]  # fmt: skip
    for e in events:
        assert e["skipped_step"] == e["step"] and e["restored_to_step"] == e["step"] - 1 - len(e["replayed_steps"])
        assert e["snapshot_mib"] > 20 and e["restore_s"] >= 0
    spike = next(e for e in events if e["reason"] == "loss_spike")
    # x20 on the first of two micro-batches: the step's loss grows about tenfold.
    assert spike["detail"]["zscore"] > 6 and spike["detail"]["loss"] > 5 * spike["detail"]["mean"]
    # The snapshot's cost is in the record of the step it preceded (before 1, 3, 5, 7; step 3 was rewound, and the
    # replay of 5 reuses the snapshot taken before its first run).
    assert [r["step"] for r in records if "snapshot_s" in r] == [1, 5, 7]


@pytest.mark.parametrize(
    "training, faults, message",
    [
        # Two anomalies in a row with one retry allowed: the second stops the run.
        ({"rewind_snapshot_interval": 1, "rewind_max_retries": 1},
         '[{"kind": "nan_loss", "step": 2, "rank": 0}, {"kind": "nan_grad", "step": 3, "rank": 0}]',
         r"step 3: the gradient norm is nan; 2 anomalous steps in a row \(skipped before: \[2\]\), more than "
         r"rewind_max_retries = 1: stopping"),
        # No snapshots (the default): the first anomaly stops the run.
        ({}, '[{"kind": "nan_loss", "step": 2, "rank": 0}]',
         r"step 2: the loss is nan .*no in-memory snapshot to rewind to"),
    ],
    ids=["retries_exhausted", "no_snapshot"],
)  # fmt: skip
def test_unrecoverable_anomaly_stops_with_the_step_and_reason(tmp_path, monkeypatch, capsys, one_thread,
                                                              corpus_and_cache, training, faults, message):  # fmt: skip
    path = _config(tmp_path / "c.toml", corpus_and_cache, steps=4, **training)
    code = _main(["--config", str(path), "--out", str(tmp_path / "run"), "--seed", "7"], monkeypatch, faults)
    err = capsys.readouterr().err
    assert code == 3 and "train.py: stopped: " in err, err
    assert re.search(message, err), err
    metrics = tmp_path / "run" / "metrics.jsonl"
    stop = read_events(metrics, "stop")
    assert len(stop) == 1 and re.search(message, stop[0]["message"])
    assert [r["step"] for r in read_metrics(metrics)] == [1]


@pytest.mark.slow  # slow: two-process training run
def test_two_processes_rewind_and_report_the_slow_rank(tmp_path, corpus_and_cache):
    """EP2 with ZeRO-1 over the two ranks (DeepEP dispatch, sharded AdamW states): a NaN loss on rank 1 at step 3
    and a loss spike on rank 0 at step 6 (snapshots every 2 steps, so step 5 is replayed from ZeRO-1's restored
    shards) give the losses of a run that skipped steps 3 and 6. The same run has slow-rank detection on, with rank
    1 sleeping in its backward during steps 1-4 and rank 0 in its forward during steps 5-8: the reports name them
    (and the timers change no result: the reference run has them off). The delays are in compute phases: with two
    ranks, a delay inside a communication phase makes the other rank wait in the same phase or the next one,
    depending on timing, so its report is not reliable (moe/trainer/train/straggler.py)."""
    flags = ["--seed", "7", "--ep", "2", "--use-distributed-optimizer", "--ddp-bucket-size", "20000"]
    ref_path = _config(tmp_path / "ref.toml", corpus_and_cache, iterations_to_skip=SKIPPED)
    _run(["--config", str(ref_path), "--out", str(tmp_path / "ref"), *flags], 2)
    # min_seconds 0.05 s/step: the 2-core machine's scheduling noise stays below it, the injected delays do not
    # (2 micro-batches x 0.15 s per step).
    path = _config(tmp_path / "c.toml", corpus_and_cache, rewind_snapshot_interval=2, log_straggler=True,
                   straggler_interval=4, straggler_min_seconds=0.05)  # fmt: skip
    faults = json.dumps([
        {"kind": "nan_loss", "step": 3, "rank": 1}, {"kind": "loss_spike", "step": 6, "rank": 0, "factor": 20.0},
        {"kind": "sleep", "steps": [1, 4], "rank": 1, "phase": "backward", "seconds": 0.15},
        {"kind": "sleep", "steps": [5, 8], "rank": 0, "phase": "forward", "seconds": 0.15},
    ])  # fmt: skip
    _run(["--config", str(path), "--out", str(tmp_path / "run"), *flags], 2, faults)
    _assert_matches_reference(tmp_path / "run", tmp_path / "ref")
    metrics = tmp_path / "run" / "metrics.jsonl"
    rewinds = read_events(metrics, "rewind")
    assert [(e["step"], e["reason"], e["replayed_steps"]) for e in rewinds] == [(3, "nan_loss", []),
                                                                                (6, "loss_spike", [5])]  # fmt: skip
    assert rewinds[0]["detail"]["ranks_with_nonfinite_loss"] == [1]
    # Slow ranks: one report per 4 steps (the anomalous steps ran their phases too: 5 steps in the second).
    times = read_events(metrics, "phase_times")
    assert [(t["step"], t["first_step"], t["steps"]) for t in times] == [(4, 1, 4), (8, 5, 5)]
    for t in times:
        assert t["timer_mismatches"] == 0 and t["seconds_per_step"]["p2p"]["max"] == 0  # no pipeline
        for phase in ("forward", "backward", "dispatch", "combine", "grad_sync", "optimizer"):
            assert t["seconds_per_step"][phase]["min"] > 0, phase
    slow = read_events(metrics, "slow_rank")
    first = [(e["rank"], e["phase"]) for e in slow if e["step"] == 4]
    second = [(e["rank"], e["phase"]) for e in slow if e["step"] == 8]
    # The findings come compute phases first, the largest excess first; with two ranks, the one that waited for
    # the late one may also show up in a communication phase.
    assert first[0] == (1, "backward") and second[0] == (0, "forward"), slow
    for step, rank, phase in ((4, 1, "backward"), (8, 0, "forward")):
        sleeper = next(e for e in slow if (e["step"], e["rank"], e["phase"]) == (step, rank, phase))
        assert sleeper["seconds_per_step"] - sleeper["median_seconds_per_step"] > 0.1  # half the 0.3 s/step injected
        assert not sleeper["communication"] and sleeper["ratio"] > 1.5
