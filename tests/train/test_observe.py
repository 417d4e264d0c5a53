"""Where users watch a run: TensorBoard scalars, Weights & Biases (offline), and a torch.profiler trace of chosen
steps (moe/trainer/train/loggers.py, moe/trainer/train/profiling.py, moe/layer/trace_regions.py), with Megatron's and
torchtitan's names.

- Two launches of examples/deepseek_v3/train.py: one process with Megatron's --tensorboard-dir, --wandb-project
  (offline) and --profile of step 2, whose step 3 is rewound (an injected NaN loss); then, after the newest checkpoint
  is damaged, a --resume from step 2 in another layout (--ep 2 on 2 ranks) with torchtitan's enable_tensorboard and
  enable_wandb, that profiles step 4 on both ranks and skips step 5.
  TensorBoard's own event reader and the offline W&B run's transaction log give back every number of metrics.jsonl
  (TensorBoard: as float32), the resumed TensorBoard run continues (the steps trained again replace the first
  launch's, the rewind of step 3 included), and each trace is valid against the trace-event schema that Chrome and
  Perfetto read (tests/train/trace_event_schema.json) with the MoE layer's regions named.
- Bad values, and W&B asked for without the wandb package, fail before any process group.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import struct
import sys
import zlib
from pathlib import Path

import fastjsonschema
import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe.layer.trace_regions import COMBINE, DISPATCH, EXPERT_GEMM, ROUTER
from moe.trainer import run
from moe.trainer.train.loggers import scalars
from moe.trainer.train.metrics import read_events, read_metrics
from moe.trainer.train.profiling import ProfilingConfig, StepProfiler
from mtdeepep.utils.testing import run_processes
from tests.train import train_cases as tc

train_script = run
TRACE_SCHEMA = Path(__file__).with_name("trace_event_schema.json")


def test_scalars_flatten_a_record_and_an_event():
    layers = {"model.layers.1.mlp": 0.25, "model.layers.2.mlp": 0.5}
    record = {"step": 3, "loss": 2.5, "mtp_loss": None, "lr": 1e-3, "mfu": None, "tokens_per_s": 10,
              "expert_load_cv": layers}  # fmt: skip
    assert scalars(record) == {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 10.0,
                               **{f"expert_load_cv/{k}": v for k, v in layers.items()}}  # fmt: skip
    assert scalars({"kind": "skip", "step": 5, "reason": "iterations_to_skip"}) == {"events/skip": 1.0}


# -- readers of what the loggers wrote -------------------------------------------------------------------------------


def _tensorboard(log_dir: Path) -> tuple[dict[str, dict[int, float]], str]:
    """`({tag: {step: value}}, the config text)` through TensorBoard's own reader (it purges what a resumed writer's
    purge_step orphans)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    values = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        if not events:  # every step of the tag purged by a resumed writer
            continue
        values[tag] = {e.step: e.value for e in events}
        assert len(values[tag]) == len(events), f"{tag}: a step written twice"
    text = acc.Tensors("config/text_summary")[-1].tensor_proto.string_val[0].decode()
    return values, text


def _wandb_records(path: Path):
    """The records of a `.wandb` transaction log (W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of
    chunks with a CRC-32, a length and a type). wandb 0.31 keeps no Python reader of its own (the Go core writes the
    file), so the test reads the framing here and leaves the records to wandb's protobuf classes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad chunk checksum"
        pending = body if kind in (1, 2) else pending + body  # full / first, or middle / last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_history(path: Path) -> tuple[dict[int, dict[str, float]], dict]:
    """`({step: {key: value}}, the run's project, name and config)` of an offline run's transaction log."""
    history: dict[int, dict[str, float]] = {}
    run: dict = {"config": {}}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            step = row.pop("_step")
            history.setdefault(step, {}).update({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "run":
            run.update(project=record.run.project, name=record.run.display_name)
            run["config"].update({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                  for item in record.run.config.update})  # fmt: skip
    return history, run


def _expected(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl as the loggers write it: {step: scalars of its record and events}."""
    out: dict[int, dict[str, float]] = {}
    for record in read_metrics(run_dir / "metrics.jsonl") + read_events(run_dir / "metrics.jsonl"):
        out.setdefault(record["step"], {}).update(scalars(record))
    return out


def _check_tensorboard(tb: Path, expected: dict[int, dict[str, float]]) -> str:
    values, text = _tensorboard(tb)
    by_tag: dict[str, dict[int, float]] = {}
    for step, row in expected.items():
        for tag, value in row.items():
            by_tag.setdefault(tag, {})[step] = value
    assert set(values) == set(by_tag)
    for tag, steps in by_tag.items():
        assert values[tag] == {s: np.float32(v) for s, v in steps.items()}, tag  # TensorBoard keeps float32
    return text


def _check_trace(path: Path, schema: bool = True) -> set[str]:
    """A trace valid against the trace-event schema Chrome and Perfetto read (unless `schema` is False: a second
    trace of one launch, from the same exporter, left to the names, which saves seconds of the suite); returns its
    complete events' names."""
    trace = json.loads(path.read_text())
    if schema:
        _trace_validator()(trace)  # JsonSchemaValueException naming the first event that does not conform
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert complete
    return {e["name"] for e in complete}


@functools.cache
def _trace_validator():
    return fastjsonschema.compile(json.loads(TRACE_SCHEMA.read_text()))


def test_the_trace_schema_rejects_what_perfetto_cannot_read():
    """The schema check can fail: a complete event without its duration or timestamp, or with a negative duration,
    an unknown phase, a flow event without its id, an unknown metadata name, and a trace with no events."""
    event = {"ph": "X", "name": "moe/dispatch", "pid": 1, "tid": 2, "ts": 10.5, "dur": 3.0, "cat": "user_annotation"}
    flow = {"ph": "f", "name": "fwdbwd", "pid": 1, "tid": 2, "ts": 11.0, "id": 7, "bp": "e"}
    meta = {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "main"}}
    _trace_validator()({"traceEvents": [event, flow, meta], "displayTimeUnit": "ms"})

    def without(e, key):
        return {k: v for k, v in e.items() if k != key}

    bad = [without(event, "dur"), {**event, "dur": -1.0}, without(event, "ts"), {**event, "ph": "Z"},
           without(flow, "id"), {**meta, "name": "process_nickname"}]  # fmt: skip
    for e in bad:
        with pytest.raises(fastjsonschema.JsonSchemaValueException):
            _trace_validator()({"traceEvents": [event, e]})
    with pytest.raises(fastjsonschema.JsonSchemaValueException):
        _trace_validator()({"traceEvents": []})


def test_the_overhead_bench_swaps_the_function_the_layer_calls():
    """bench/observe_overhead.py times the layer with `region` swapped out of the module that calls it: that module
    must still be where the layer looks the name up."""
    from bench import observe_overhead
    from moe.layer import trace_regions

    assert observe_overhead.moe_layer.region is trace_regions.region


# -- end to end ------------------------------------------------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network here
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written outside the test
        monkeypatch.setenv(name, str(tmp_path / name.lower()))


def _run(argv, nproc=1, faults=""):
    return run_processes(tc.torchrun_rank_with_faults, nproc, (argv, faults), timeout_s=300)


@pytest.mark.slow  # two launches of train.py (one process, then two ranks)
def test_tensorboard_wandb_and_profile_across_a_resume(tmp_path, wandb_offline, monkeypatch, capfd):
    corpus = tc.write_corpus(tmp_path / "corpus", num_files=6, lines=200)
    config = tc.make_config(tmp_path / "c.toml", corpus, tmp_path / "cache",
                            training={"steps": 4, "global_batch": 4, "seq_len": 32, "checkpoint_every": 2,
                                      "rewind_snapshot_interval": 1},
                            data={"val_sequences": 2})  # fmt: skip
    run_dir = tmp_path / "run"
    tb = run_dir / "tb"  # where the resumed launch's torchtitan switch writes too
    common = ["--config", str(config), "--out", str(run_dir)]
    _run([*common, "--tensorboard-dir", str(tb), "--wandb-project", "observe-test", "--wandb-exp-name", "first",
          "--profile", "--profile-step-start", "1", "--profile-step-end", "2"],
         faults='[{"kind": "nan_loss", "step": 3, "rank": 0}]')  # fmt: skip
    out = capfd.readouterr().out
    first = _expected(run_dir)
    assert sorted(first) == [1, 2, 3, 4] and first[3] == {"events/rewind": 1.0}  # step 3 rewound and skipped
    assert {"loss", "mtp_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_s", "data_s"} <= set(first[1])
    for field in ("expert_load_max_over_mean", "expert_load_min_over_mean", "expert_load_cv"):
        assert sum(tag.startswith(field + "/") for tag in first[1]) == 4  # layers 1-3 and the MTP block
    text = _check_tensorboard(tb, first)
    assert "[metrics]" in text and f'tensorboard_dir = "{tb}"' in text

    # W&B: the offline run's history is metrics.jsonl, its config the resolved tree.
    (log,) = (run_dir / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    history, wb_run = _wandb_history(log)
    assert history == first
    assert (wb_run["project"], wb_run["name"]) == ("observe-test", "first")
    assert wb_run["config"]["metrics"]["wandb_project"] == "observe-test" and wb_run["config"]["training"]["steps"] == 4

    # The profile: step 2 (step 1 warmed the profiler up), rank 0, the MoE regions named; the table printed.
    trace = run_dir / "profile_traces" / "iteration_2" / "rank0_trace.json"
    names = _check_trace(trace)
    assert {ROUTER, DISPATCH, EXPERT_GEMM, COMBINE, "train_step#2"} <= names and "train_step#1" not in names
    assert "rank 0, step 2: top operators" in out and "Self CPU" in out
    assert (trace.parent / "rank0_top_operators.txt").read_text().strip() in out

    # Resume from step 2 (step 4's checkpoint damaged: steps 3 and 4 train again), on 2 ranks, to step 5 (skipped),
    # with torchtitan's switches: enable_tensorboard (into RUN_DIR/tb), enable_wandb (project $WANDB_PROJECT).
    shard = run_dir / "checkpoints" / "step_4" / "rank_00000" / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    shutil.rmtree(run_dir / "profile_traces")
    profile = ["--profile", "--profile-step-start", "3", "--profile-step-end", "4", "--profile-ranks", "0", "1"]
    monkeypatch.setenv("WANDB_PROJECT", "observe-test")
    _run([*common, "--resume", "--steps", "5", "--rewind.iterations_to_skip", "[5]", "--ep", "2", *profile,
          "--metrics.enable_tensorboard", "true", "--metrics.enable_wandb", "true"], nproc=2)  # fmt: skip
    out = capfd.readouterr().out
    final = _expected(run_dir)
    assert sorted(final) == [1, 2, 3, 4, 5] and final[5] == {"events/skip": 1.0}
    # Trained again: TensorBoard must hold the new values, and no longer the rewind of step 3.
    assert "loss" in final[3] and "events/rewind" not in final[3] and final[4]["step_s"] != first[4]["step_s"]
    _check_tensorboard(tb, final)

    traces = sorted(p.relative_to(run_dir).as_posix() for p in (run_dir / "profile_traces").rglob("*.json"))
    assert traces == [f"profile_traces/iteration_4/rank{r}_trace.json" for r in (0, 1)]  # a trace per rank
    for rank, trace in enumerate(traces):
        assert {DISPATCH, EXPERT_GEMM, COMBINE, "train_step#4"} <= _check_trace(run_dir / trace, schema=rank == 1)
        assert f"rank {rank}, step 4: top operators" in out

    # The second launch is a second W&B run (rank 0's only; named after the run directory), holding steps 3-5.
    logs = [p for p in (run_dir / "wandb").glob("wandb/offline-run-*/run-*.wandb") if p != log]
    (second,) = logs
    history, wb_run = _wandb_history(second)
    assert history == {s: final[s] for s in (3, 4, 5)}
    assert (wb_run["project"], wb_run["name"]) == ("observe-test", "run")


# -- bad values fail before anything runs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (["--profile", "--profile-step-start", "3", "--profile-step-end", "2"], 1, "must be above --profile-step"),
        (["--profile", "--profile-step-start", "2", "--profile-step-end", "2"], 1, "must be above --profile-step"),
        (["--profile", "--profile-step-start", "-1", "--profile-step-end", "2"], 1, "must be >= 0"),
        (["--profile", "--profile-step-start", "0", "--profile-step-end", "9"], 1, "past the run's last step 4"),
        (["--profile"], 1, "--profile-step-end 12 is past the run's last step 4"),  # Megatron's default window
        (["--profile", "--profile-step-start", "0", "--profile-step-end", "2", "--profile-ranks", "0", "2"], 2,
         r"--profile-ranks \[2\]: outside the world of 2 ranks"),
        (["--profile-step-start", "0", "--profile-step-end", "2"], 1, "need --profile"),
        (["--profile", "--profiling.profile_freq", "2", "--profile-step-end", "3"], 1, "not both"),
        (["--profile", "--profiling.profile_freq", "0"], 1, "profile_freq must be >= 1"),
        (["--wandb-exp-name", "x"], 1, "need wandb_project"),
        (["--metrics.enable_tensorboard", "yes"], 1, "enable_tensorboard must be true or false"),
    ],
)  # fmt: skip
def test_bad_values_fail_before_any_process_group(tmp_path, monkeypatch, capsys, flags, world, message):
    _fails_before_any_group(tmp_path, monkeypatch, capsys, flags, world, message)


def test_wandb_asked_for_without_the_package_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError, as when not installed
    _fails_before_any_group(tmp_path, monkeypatch, capsys, ["--wandb-project", "p"], 1,
                            "needs the wandb package, which is not installed")  # fmt: skip
    _fails_before_any_group(tmp_path, monkeypatch, capsys, ["--metrics.enable_wandb", "true"], 1, "pip install wandb")


def _fails_before_any_group(tmp_path, monkeypatch, capsys, flags, world, message):
    config = tc.make_config(tmp_path / "bad.toml", tmp_path / "corpus", tmp_path / "cache", training={"steps": 4})
    # torchrun's environment with nobody at the rendezvous: any process-group work would hang, not fail fast.
    for name, value in {"WORLD_SIZE": world, "RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 9}.items():
        monkeypatch.setenv(name, str(value))
    code = train_script.main(["--config", str(config), "--out", str(tmp_path / "run"), "--ep", str(world), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("train.py: error:"), err
    assert re.search(message, err), err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_profile_windows_and_torchtitans_profile_freq(tmp_path):
    """Megatron's window (steps start+1..end, the step before it the warm-up), torchtitan's profile_freq (every F-th
    step, one each), and a rank left out of profile_ranks profiling nothing; a step loop of small matmuls."""
    megatron = ProfilingConfig(enable_profiling=True, profile_step_start=1, profile_step_end=3)
    titan = ProfilingConfig(enable_profiling=True, profile_freq=2)
    assert megatron.windows(5) == [(2, 3)] and titan.windows(5) == [(2, 2), (4, 4)]
    assert ProfilingConfig().windows(5) == []
    assert not ProfilingConfig(enable_profiling=True, profile_ranks=[1]).profiles_rank(0)
    x = torch.randn(16, 16)
    profiler = StepProfiler(titan, tmp_path, rank=3, steps=5)
    for step in range(1, 6):
        profiler.before_step(step)
        with torch.profiler.record_function(DISPATCH):
            x = torch.tanh(x @ x)
        profiler.after_step(step)
    profiler.close()
    assert [p.relative_to(tmp_path).as_posix() for p in profiler.traces] == [
        "profile_traces/iteration_2/rank3_trace.json", "profile_traces/iteration_4/rank3_trace.json"
    ]  # fmt: skip
    for step, trace in zip((2, 4), profiler.traces):
        names = _check_trace(trace)
        assert {f"train_step#{step}", DISPATCH, "aten::mm"} <= names
        assert not {f"train_step#{s}" for s in range(1, 6) if s != step} & names  # warm-up and other steps left out
    assert "rank 3, step 2: top operators" in profiler.summary() and "aten::mm" in profiler.summary()
    idle = StepProfiler(ProfilingConfig(enable_profiling=True, profile_freq=2, profile_ranks=[0]), tmp_path / "b", 3, 5)
    for step in range(1, 6):
        idle.before_step(step)
        idle.after_step(step)
    assert idle.traces == [] and idle.summary() == "" and not (tmp_path / "b").exists()


def test_a_rewound_step_is_traced_once(tmp_path):
    """A rewind at the traced step (its snapshot taken before it) calls the profiler for that step twice, the second
    time skipped: the window's trace is the step that ran, not overwritten by the skipped one."""
    profiler = StepProfiler(ProfilingConfig(enable_profiling=True, profile_freq=2), tmp_path, rank=0, steps=3)
    x = torch.randn(16, 16)
    for step, runs in ((1, True), (2, True), (2, False), (3, True)):  # step 2 rewound, then skipped
        profiler.before_step(step)
        if runs:
            with torch.profiler.record_function(DISPATCH):
                x = torch.tanh(x @ x)
        profiler.after_step(step)
    profiler.close()
    (trace,) = profiler.traces
    assert trace == tmp_path / "profile_traces" / "iteration_2" / "rank0_trace.json"
    assert {"train_step#2", DISPATCH, "aten::mm"} <= _check_trace(trace)
