"""One config tree for a run: the tables of a TOML file, every field of which the command line can override, built
and validated once, before any process group exists, then printed and saved with the run.

A tree is a list of `Section`s, one per top-level table (`[model]`, `[training]`, `[parallel]`, ...). Each knows
the keys it accepts (its `schema`, read off a dataclass by `dataclass_schema`) and how to build its config object
from its table (the dataclass's own validation raises ValueError). On the command line:

    --optimizer.lr 1e-3    --data.corpus DIR            --model.rope_parameters.rope_theta 5e4    --parallel.tp=2

A value is read as a TOML value (`1e-3`, `true`, `[0.9, 0.95]`, `"text"`), and as a plain string when it is not one
(`DIR`, `full`). Dashes in keys read as underscores (`--training.global-batch 32`). A key the schema does not know is
an error that names the close matches, before anything runs. Precedence: the command line over the file over the
dataclasses' defaults. Aliases (e.g. Megatron's `--tensor-model-parallel-size`) are the caller's argparse options
whose `dest` is a tree path (`dest="parallel.tp"`): `overrides_from_namespace` turns the ones given into overrides.

A key that moved to another table (`moved`: `(old table, key) -> new path`) is still read at its old place, in the
file and on the command line (`--training.lr`), and put at its new one; one `FutureWarning` names every moved key
given and its new home. A warning rather than an error, so that users' files and command lines keep working; the
resolved tree a run saves is in the new layout, so `--config RUN_DIR/config.toml` never warns.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

FREE = "free"  # a schema entry: a sub-table whose keys the section's builder checks itself


@dataclass(frozen=True)
class Override:
    """`path = value` from the command line; `source` is the argument as given, for error messages."""

    path: tuple[str, ...]
    value: Any
    source: str


@dataclass(frozen=True)
class Section:
    """A top-level table. `schema`: key -> None (a value), a nested schema (a sub-table) or FREE. `build(table)`
    returns the section's config object and raises ValueError for a bad value. `to_table(obj)` gives the resolved
    table back (what the run saves)."""

    name: str
    schema: Mapping[str, Any]
    build: Callable[[dict[str, Any]], Any]
    to_table: Callable[[Any], dict[str, Any]]


def dataclass_schema(cls: type, free: Iterable[str] = ()) -> dict[str, Any]:
    """The keys of dataclass `cls`: a field whose default is a dataclass is a sub-table (recursively), one whose
    default is a dict (or named in `free`) is a free sub-table."""
    schema: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name in free or isinstance(default, dict):
            schema[f.name] = FREE
        elif dataclasses.is_dataclass(default):
            schema[f.name] = dataclass_schema(type(default))
        else:
            schema[f.name] = None
    return schema


def parse_value(text: str) -> Any:
    """A command-line value as TOML reads it; the text itself when it is not a TOML value."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def split_overrides(argv: Iterable[str]) -> tuple[list[str], list[Override]]:
    """`(the other arguments, the --a.b[.c] overrides)`; ValueError for an override without a value."""
    argv = list(argv)
    rest: list[str] = []
    overrides: list[Override] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, text = arg[2:].partition("=")
        if arg.startswith("--") and "." in key:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg} needs a value")
                i += 1
                text = argv[i]
            path = tuple(part.replace("-", "_") for part in key.split("."))
            if not all(path):
                raise ValueError(f"{arg}: an empty key in {key!r}")
            overrides.append(Override(path, parse_value(text), f"{arg}" if eq else f"{arg} {text}"))
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def overrides_from_namespace(namespace: Any) -> list[Override]:
    """The overrides of argparse options whose `dest` is a tree path (contains a dot) and that were given (not
    None); their values are already typed by argparse."""
    overrides = []
    for dest, value in vars(namespace).items():
        if "." in dest and value is not None:
            overrides.append(Override(tuple(dest.split(".")), value, f"--{dest}"))
    return overrides


class ConfigTree:
    """The sections of a run's config, loaded from a TOML file with command-line overrides."""

    def __init__(
        self, sections: Iterable[Section], moved: Mapping[tuple[str, str], tuple[str, ...]] | None = None
    ) -> None:
        self.sections = {s.name: s for s in sections}
        self.moved = dict(moved or {})  # (old table, key) -> new path: read at the old place, with a warning

    def read(self, path: str | Path | None, overrides: Iterable[Override] = ()) -> dict[str, dict[str, Any]]:
        """The merged tables: the file's (only the tree's sections; an unknown table or key is an error) with the
        overrides applied in order. ValueError names the file, the key and the close matches. Moved keys are read
        at their old place, with one `FutureWarning` naming them."""
        doc: dict[str, Any] = {}
        notes: list[str] = []
        if path is not None:
            path = Path(path)
            if not path.is_file():
                raise ValueError(f"config file {path} does not exist")
            with path.open("rb") as f:
                try:
                    doc = tomllib.load(f)
                except tomllib.TOMLDecodeError as exc:
                    raise ValueError(f"{path}: not valid TOML: {exc}") from None
            doc, notes = move_keys(doc, self.moved)
            for name in doc:
                if name not in self.sections:
                    raise ValueError(f"{path}: unknown table [{name}]{_close(name, self.sections)}")
                if not isinstance(doc[name], dict):
                    raise ValueError(f"{path}: {name} must be a table")
                _check_table(self.sections[name].schema, doc[name], (name,), str(path))
        if notes:
            warnings.warn(moved_keys_message(notes, path), FutureWarning, stacklevel=2)
        tables = {name: copy.deepcopy(doc.get(name, {})) for name in self.sections}
        notes = []
        for override in overrides:
            new = self.moved.get(override.path[:2])
            if new is not None:
                path_text = ".".join((*new, *override.path[2:]))
                notes.append(f"--{'.'.join(override.path)} -> --{path_text}")
                override = Override((*new, *override.path[2:]), override.value, override.source)
            self._apply(tables, override)
        if notes:
            warnings.warn(moved_keys_message(notes, "the command line"), FutureWarning, stacklevel=2)
        return tables

    def build(self, tables: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """Each section's config object from its table (the section's own validation; ValueError)."""
        built = {}
        for name, section in self.sections.items():
            try:
                built[name] = section.build(copy.deepcopy(tables.get(name, {})))
            except TypeError as exc:  # a dataclass given a value of the wrong shape
                raise ValueError(f"[{name}]: {exc}") from None
        return built

    def resolved(self, built: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The tables of the built configs, every default filled in (what the run prints and saves)."""
        return {name: section.to_table(built[name]) for name, section in self.sections.items()}

    def _apply(self, tables: dict[str, dict[str, Any]], override: Override) -> None:
        head, *keys = override.path
        if head not in self.sections:
            raise ValueError(f"{override.source}: unknown section {head!r}{_close(head, self.sections)}")
        if not keys:
            raise ValueError(f"{override.source}: give a key of [{head}], e.g. --{head}.<key> VALUE")
        schema: Any = self.sections[head].schema
        table = tables[head]
        for depth, key in enumerate(keys):
            last = depth == len(keys) - 1
            if schema is not FREE:
                if key not in schema:
                    where = ".".join(override.path[: depth + 2])
                    raise ValueError(f"{override.source}: unknown key {where!r}{_close(key, schema)}")
                schema = schema[key]
                if not last and schema is None:
                    raise ValueError(f"{override.source}: {'.'.join(override.path[: depth + 3])!r}: "
                                     f"{key!r} is a value, not a table")  # fmt: skip
                if last and isinstance(schema, dict):
                    raise ValueError(f"{override.source}: {key!r} is a table: set its keys (--{head}.{key}.<key>)")
            if last:
                table[key] = override.value
            else:
                table = table.setdefault(key, {})
                if not isinstance(table, dict):
                    raise ValueError(f"{override.source}: {key!r} is not a table in the config")


def move_keys(
    doc: Mapping[str, Any], moved: Mapping[tuple[str, str], tuple[str, ...]]
) -> tuple[dict[str, Any], list[str]]:
    """`(doc with every moved key at its new path, a note per key moved)`: `moved` maps `(old table, key)` to the
    new path, `(table, key)` or `(table,)` for a sub-table that became a table. ValueError for a key given at both
    places."""
    out = {name: dict(table) if isinstance(table, dict) else table for name, table in doc.items()}
    notes = []
    for (old, key), new in moved.items():
        if not isinstance(out.get(old), dict) or key not in out[old]:
            continue
        value = out[old].pop(key)
        if len(new) == 1:  # a sub-table that became a table
            if new[0] in out:
                raise ValueError(f"[{old}.{key}] and [{new[0]}] are both given: keep [{new[0]}]")
            out[new[0]] = value
            notes.append(f"[{old}.{key}] -> [{new[0]}]")
            continue
        target = out.setdefault(new[0], {})
        if not isinstance(target, dict):
            raise ValueError(f"{new[0]} must be a table")
        if new[1] in target:
            raise ValueError(f"{key} is given in [{old}] and in [{new[0]}]: keep [{new[0]}] {new[1]}")
        target[new[1]] = value
        notes.append(f"[{old}] {key} -> [{new[0]}] {new[1]}")
    return out, notes


def moved_keys_message(notes: Iterable[str], source: str | Path) -> str:
    """The warning for keys given at their old place (`notes`: old -> new, one per key)."""
    return (f"{source}: keys read at their old place, which still works but is deprecated (the run's saved "
            f"config.toml has the new layout): {'; '.join(notes)}")  # fmt: skip


def _check_table(schema: Mapping[str, Any], table: Mapping[str, Any], where: tuple[str, ...], source: str) -> None:
    for key, value in table.items():
        if key not in schema:
            raise ValueError(f"{source}: [{'.'.join(where)}] has an unknown key {key!r}{_close(key, schema)}")
        sub = schema[key]
        if isinstance(sub, dict):
            if not isinstance(value, dict):
                raise ValueError(f"{source}: {'.'.join((*where, key))} must be a table")
            _check_table(sub, value, (*where, key), source)


def _close(name: str, known: Iterable[str]) -> str:
    known = sorted(known)
    matches = difflib.get_close_matches(name, known, n=3)
    if matches:
        return f" (did you mean {', '.join(matches)}?)"
    return f" (known: {', '.join(known)})"
