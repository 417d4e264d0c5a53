"""The config tree (moe/trainer/train/config_tree.py): TOML tables, `--section.key value` overrides, one validation."""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from moe.trainer.models.deepseek_v3 import DeepseekV3Config
from moe.trainer.train import job_config
from moe.trainer.train.config_tree import (
    FREE,
    ConfigTree,
    Override,
    Section,
    dataclass_schema,
    overrides_from_namespace,
    parse_value,
    split_overrides,
)
from moe.trainer.train.parallel_state import Layout
from moe.trainer.train.training_config import MOVED, TrainerConfig, TrainingConfig

ROOT = Path(__file__).resolve().parents[2]


@dataclass(kw_only=True)
class Inner:
    corpus: str = "stdlib"
    val_sequences: int = 32


@dataclass(kw_only=True)
class Outer:
    lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    rope: dict = field(default_factory=dict)
    data: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"[training] lr must be > 0, got {self.lr!r}")
        if isinstance(self.data, dict):
            self.data = Inner(**self.data)


def _tree() -> ConfigTree:
    def to_table(obj: Outer) -> dict:
        return {"lr": obj.lr, "betas": list(obj.betas), "rope": obj.rope, "data": vars(obj.data)}

    return ConfigTree([Section("training", dataclass_schema(Outer), lambda t: Outer(**t), to_table)])


def test_schema_reads_sub_tables_and_free_tables():
    assert dataclass_schema(Outer) == {
        "lr": None,
        "betas": None,
        "rope": FREE,
        "data": {"corpus": None, "val_sequences": None},
    }


@pytest.mark.parametrize(
    "text, value",
    [("1e-3", 1e-3), ("32", 32), ("true", True), ("[0.9, 0.99]", [0.9, 0.99]), ('"a b"', "a b"), ("DIR/x", "DIR/x")],
)
def test_values_read_as_toml_else_text(text, value):
    assert parse_value(text) == value


def test_overrides_split_from_the_other_arguments():
    rest, overrides = split_overrides(["--config", "a.toml", "--training.lr", "1e-3", "--training.data.val-sequences=4",
                                       "--tp", "2"])  # fmt: skip
    assert rest == ["--config", "a.toml", "--tp", "2"]
    assert [(o.path, o.value) for o in overrides] == [
        (("training", "lr"), 1e-3),
        (("training", "data", "val_sequences"), 4),
    ]
    with pytest.raises(ValueError, match="needs a value"):
        split_overrides(["--training.lr"])


def test_file_then_overrides_then_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[training]\nlr = 0.1\n[training.data]\ncorpus = "mine"\n')
    tree = _tree()
    _, overrides = split_overrides(["--training.lr", "0.5", "--training.rope.theta", "5e4"])
    tables = tree.read(path, overrides)
    built = tree.build(tables)["training"]
    assert built.lr == 0.5 and built.data.corpus == "mine" and built.data.val_sequences == 32
    assert built.rope == {"theta": 5e4}
    assert tree.resolved({"training": built})["training"]["data"] == {"corpus": "mine", "val_sequences": 32}


@pytest.mark.parametrize(
    "args, match",
    [
        (["--training.lrr", "1"], r"unknown key 'training.lrr' \(did you mean lr\?\)"),
        (["--trainig.lr", "1"], r"unknown section 'trainig' \(did you mean training\?\)"),
        (["--training.data", "1"], "is a table"),
        (["--training.lr.x", "1"], "is a value, not a table"),
        (["--training.lr", "-1"], "lr must be > 0"),
        (["--training.data.corpus_dir", "x"], "unknown key 'training.data.corpus_dir'"),
    ],
)
def test_bad_overrides_are_clear_errors(args, match):
    tree = _tree()
    with pytest.raises(ValueError, match=match):
        _, overrides = split_overrides(args)
        tree.build(tree.read(None, [Override(("training", "lr"), 1.0, "default"), *overrides]))


def test_bad_file_is_a_clear_error(tmp_path):
    tree = _tree()
    path = tmp_path / "run.toml"
    path.write_text("[trainin]\nlr = 1\n")
    with pytest.raises(ValueError, match=r"unknown table \[trainin\]"):
        tree.read(path)
    path.write_text("[training]\nlr = 1\nlrr = 2\n")
    with pytest.raises(ValueError, match=r"\[training\] has an unknown key 'lrr'"):
        tree.read(path)
    path.write_text("[training\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        tree.read(path)
    with pytest.raises(ValueError, match="does not exist"):
        tree.read(tmp_path / "missing.toml")


def test_aliases_are_argparse_options_with_a_tree_path():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", dest="training.lr", type=float)
    parser.add_argument("--train-iters", dest="training.steps", type=int)
    args = parser.parse_args(["--lr", "0.25"])
    assert [(o.path, o.value) for o in overrides_from_namespace(args)] == [(("training", "lr"), 0.25)]


# -- the trainer's tree (moe/trainer/train/job_config.py)
# -----------------------------------------------------------------

TINY = ROOT / "examples" / "deepseek_v3" / "configs" / "tiny.toml"


def _job(argv: list[str], world: int = 4):
    parser = argparse.ArgumentParser()
    job_config.add_tree_options(parser)
    _, overrides = job_config.parse(parser, argv)
    return job_config.load_job(TINY, overrides, world=world)


@pytest.mark.parametrize(
    "argv", [["--tp", "2"], ["--tensor-model-parallel-size", "2"], ["--parallel.tp", "2"], ["--parallel.tp=2"]]
)
def test_short_flags_megatron_names_and_paths_set_the_same_field(argv):
    job = _job(argv)
    assert job.layout.tp == 2 and job.parallel.tp == 2 and job.tables["parallel"]["tp"] == 2


def test_every_section_takes_overrides_and_the_saved_tree_runs_again(tmp_path):
    job = _job(["--train-iters", "7", "--optimizer.lr", "1e-3", "--data.val-sequences", "4", "--ep", "4",
                "--model.rope_parameters.rope_theta", "5e4", "--recompute-granularity", "selective",
                "--bf16"])  # fmt: skip
    assert (job.training.steps, job.optimizer.lr, job.data.val_sequences) == (7, 1e-3, 4)
    assert job.training.dtype == "bfloat16" and job.layout.ep == 4
    assert job.model.rope_parameters["rope_theta"] == 5e4 and job.recompute.granularity == "selective"
    job.save(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved tree is in the new layout: no moved key
        again = job_config.load_job(tmp_path / job_config.CONFIG_TOML, [], world=4)
    assert again.tables == job.tables and again.toml() == job.toml()
    assert again.model == job.model and again.trainer == job.trainer and again.recompute == job.recompute


@pytest.mark.parametrize("argv", [["--compile"], ["--training.compile", "true"]])
def test_compile_is_opt_in(argv):
    assert not _job([], world=1).training.compile
    assert _job(argv, world=1).training.compile


def test_the_file_alone_gives_what_train_py_read_before():
    """No override: the model and training configs equal those the file's own readers give."""
    job = _job([], world=1)
    assert job.model == DeepseekV3Config.from_toml(TINY) and job.training == TrainingConfig.from_toml(TINY)
    assert job.trainer == TrainerConfig.from_toml(TINY)
    assert job.layout == Layout(world=1) and job.split is None


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--ep", "3"], r"ep \* etp = 3 must divide dp \* tp = 4"),
        (["--model.hidden_sise", "64"], r"unknown key 'model.hidden_sise' \(did you mean hidden_size\?\)"),
        (["--parallel.pp", "4", "--parallel.pp_schedule", "dualpipev"], r"DualPipeV needs at least 2 \* pp = 8"),
        (["--recompute.granularity", "full"], "needs recompute_method"),
        (["--optimizer.betas", "[0.9]"], r"\[optimizer\] betas must be two numbers"),
        # Virtual pipeline stages (--num-virtual-stages-per-pipeline-rank): each rule before any process group.
        (["--num-virtual-stages-per-pipeline-rank", "2"], r"vpp 2 \(--num-virtual-stages-per-pipeline-rank\) needs pp"),
        (["--pp", "2", "--pp-schedule", "dualpipev", "--vpp", "2"], "DualPipeV already holds 2 stages per rank in a V"),
        (["--pp", "4", "--vpp", "2", "--micro-batches", "2"], "micro_batches=2 must be a multiple of 4"),
        (["--pp", "4", "--vpp", "2", "--pp-schedule", "zbh1", "--micro-batches", "2"], "interleaved zbh1"),
        (["--pp", "2", "--vpp", "2", "--decoder-first-pipeline-num-layers", "1"], "rank 0 holds 1, rank 1 holds 3"),
        (["--parallel.num_virtual_stages_per_pipeline_rank", "0"], "vpp must be a positive int, got 0"),
        (["--compile", "--tp", "2"], r"compile with --tp > 1"),
        (["--training.compile", "yes"], "compile must be true or false"),
    ],
)
def test_bad_trees_fail_with_the_rule(argv, match):
    with pytest.raises(ValueError, match=match):
        _job(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-virtual-stages-per-pipeline-rank", "2"],
        ["--vpp", "2"],
        ["--parallel.num_virtual_stages_per_pipeline_rank", "2"],
    ],
)
def test_virtual_stages_set_the_layout_and_the_split(argv):
    # tiny's 4 layers at pp 2 x V 2 (world 4: dp 2): 4 stages of one layer, rank 0 holds stages 0 and 2.
    job = _job(["--pp", "2", *argv])
    assert job.layout.vpp == 2 and job.parallel.num_virtual_stages_per_pipeline_rank == 2
    assert job.split.slots == ((0,), (1,), (2,), (3,))
    assert job.layout.to_dict()["vpp"] == 2 and "vpp" not in Layout(world=4, pp=2).to_dict()
    assert job.tables["parallel"]["num_virtual_stages_per_pipeline_rank"] == 2
    # Megatron-core's first-rank count under V: 2 layers for rank 0's stages 0 and 2.
    uneven = _job(["--pp", "2", *argv, "--decoder-first-pipeline-num-layers", "2"])
    assert uneven.split.slots == ((0,), (1,), (2,), (3,))
    assert _job(["--pp", "2"]).layout.vpp == 1 and _job(["--pp", "2"]).split.slots == ((0, 1), (2, 3))


# -- the trainer's tables, split by component: old files and flags still read ------------------------------------


def _old_layout(job) -> dict:
    """`job`'s tables as a file written before the split: every trainer key in [training], [training.data]."""
    tables = {name: dict(table) for name, table in job.tables.items()}
    training = tables["training"]
    for (_, key), new in MOVED.items():
        if key != "data":
            training[key] = tables[new[0]].pop(key)
    training["data"] = tables.pop("data")
    return {name: table for name, table in tables.items() if table}


def test_an_old_file_reads_the_same_and_names_each_moved_key(tmp_path):
    import tomli_w

    job = _job([], world=1)
    old = tmp_path / "old.toml"
    old.write_text(tomli_w.dumps(job_config._drop_none(_old_layout(job))))
    with pytest.warns(FutureWarning) as caught:
        again = job_config.load_job(old, [], world=1)
    message = str(caught[0].message)
    for moved in ("[training] lr -> [optimizer] lr", "[training] use_distributed_optimizer -> [zero]",
                  "[training] checkpoint_every -> [checkpoint]", "[training] rewind_max_retries -> [rewind]",
                  "[training] log_straggler -> [straggler]", "[training.data] -> [data]"):  # fmt: skip
        assert moved in message
    assert len(caught) == 1 and again.tables == job.tables and again.trainer == job.trainer


@pytest.mark.parametrize(
    "argv, path, value",
    [
        (["--training.lr", "0.5"], ("optimizer", "lr"), 0.5),
        (["--training.use_distributed_optimizer", "true"], ("zero", "use_distributed_optimizer"), True),
        (["--training.data.val_sequences", "4"], ("data", "val_sequences"), 4),
        (["--training.rewind_snapshot_interval", "2"], ("rewind", "rewind_snapshot_interval"), 2),
    ],
)
def test_an_old_flag_sets_the_moved_key_with_a_warning(argv, path, value):
    with pytest.warns(FutureWarning, match=rf"--{'.'.join(argv[0][2:].split('.'))} -> --{path[0]}\."):
        job = _job(argv, world=2)
    assert job.tables[path[0]][path[1]] == value


@pytest.mark.parametrize(
    "argv, path, value",
    [
        (["--lr", "0.5"], ("optimizer", "lr"), 0.5),
        (["--min-lr", "0"], ("optimizer", "min_lr"), 0.0),
        (["--lr-warmup-iters", "3"], ("optimizer", "warmup_steps"), 3),
        (["--weight-decay", "0.2"], ("optimizer", "weight_decay"), 0.2),
        (["--clip-grad", "0"], ("optimizer", "clip_grad"), 0.0),
        (["--save-interval", "5"], ("checkpoint", "checkpoint_every"), 5),
        (["--use-distributed-optimizer"], ("zero", "use_distributed_optimizer"), True),
        (["--ddp-bucket-size", "1000"], ("zero", "ddp_bucket_size"), 1000),
        (["--overlap-grad-reduce"], ("zero", "overlap_grad_reduce"), True),
        (["--corpus", "x"], ("data", "corpus"), "x"),
        (["--eod-mask-loss"], ("data", "eod_mask_loss"), True),
        (["--train-iters", "9"], ("training", "steps"), 9),
        (["--seq-length", "64"], ("training", "seq_len"), 64),
    ],
)
def test_megatron_names_set_their_components_field(argv, path, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job = _job(argv, world=2)
    assert job.tables[path[0]][path[1]] == value and getattr(getattr(job, path[0]), path[1]) == value


def test_a_key_in_both_places_is_refused(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text(TINY.read_text().replace("[training]\n", "[training]\nclip_grad = 0.5\n", 1))  # and [optimizer]
    with pytest.raises(ValueError, match=r"clip_grad is given in \[training\] and in \[optimizer\]"):
        job_config.load_job(path, [], world=1)
