"""The config tree (moe/train/config_tree.py): TOML tables, `--section.key value` overrides, one validation."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from moe.train.config_tree import (
    FREE,
    ConfigTree,
    Override,
    Section,
    dataclass_schema,
    overrides_from_namespace,
    parse_value,
    split_overrides,
)


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
