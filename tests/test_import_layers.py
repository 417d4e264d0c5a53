"""Dependencies point one way: the library (`mtdeepep/`, `moe/`) never reaches into `examples/` or `tests/`, mtdeepep
never imports the trainer above it, and every library module imports on its own, with no circle held together by
imports deferred into functions.

- `test_library_never_reaches_examples_or_tests`: an AST scan of every library file for imports of `examples` /
  `tests`, and for the ways to run a file by path (`runpy`, `spec_from_file_location`, `exec_module`, `exec`).
- `test_function_level_imports_are_the_allowed_ones`: every import inside a function is listed in `ALLOWED` with
  its reason (optional third-party packages, loaded where they are used); a new one, or a listed one that is gone,
  fails. A deferred import of the library itself is never allowed: it is how an import circle hides.
- `test_module_level_imports_form_no_circle`: the graph of module-level imports between library modules (an import
  of a package's name counts for that package's `__init__`, `from pkg import submodule` for the submodule) has no
  cycle.
- `test_packages_import_down_the_layer_table`: every module-level import between library packages points down
  `LAYERS` (ARCHITECTURE.md's layer table, bottom up) or stays within one layer.
- `test_layer_room_never_imports_the_trainer_room`: `moe`'s two rooms, the MoE layer (`moe/layer/`) and the trainer
  (`moe/trainer/`): no import of the layer room, at any level, names the trainer room.
- `test_every_library_module_imports_in_isolation`: each module imported alone in a fresh process, which loads no
  module of `examples/` or `tests/` on the way.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("mtdeepep", "moe")
FORBIDDEN_ROOTS = {"examples", "tests"}
# Calls that run a file or a string as code: the library has no business doing either.
PATH_EXECUTION = {"spec_from_file_location", "run_path", "run_module", "exec_module", "exec"}

# (file, imported module) -> why the import waits until the function runs. Only optional packages: each is needed
# by one feature, and the library imports without it.
ALLOWED = {
    (
        "moe/trainer/models/deepseek_v3/model_config.py",
        "tomllib",
    ): "Python >= 3.11; the fallback below covers older ones",
    ("moe/trainer/models/deepseek_v3/model_config.py", "tomli"): "the TOML reader before Python 3.11 (optional)",
    ("moe/trainer/pipeline/overlap.py", "matplotlib.backends.backend_agg"): "plots only: matplotlib is optional",
    ("moe/trainer/pipeline/overlap.py", "matplotlib.figure"): "plots only: matplotlib is optional",
    ("moe/trainer/pipeline/overlap.py", "matplotlib.patches"): "plots only: matplotlib is optional",
    (
        "moe/trainer/models/deepseek_v3/decode_timeline.py",
        "matplotlib.backends.backend_agg",
    ): "plots only: matplotlib is optional",
    ("moe/trainer/models/deepseek_v3/decode_timeline.py", "matplotlib.figure"): "plots only",
    ("moe/trainer/data/corpus.py", "pyarrow"): "optional: only to read .parquet",
    ("moe/trainer/data/corpus.py", "pyarrow.parquet"): "optional: only to read .parquet",
    ("moe/trainer/data/tokenizer.py", "tokenizers"): "only to train or load a tokenizer",
    ("moe/trainer/data/tokenizer.py", "transformers"): "only for a tokenizer directory without tokenizer.json",
    ("moe/trainer/data/tokenize.py", "tqdm.auto"): "only for the progress bar",
    (
        "moe/trainer/data/vocab_check.py",
        "tqdm.auto",
    ): "only for the progress bar of a scan past a second: tqdm is optional",
    ("moe/trainer/pipeline/timeline.py", "matplotlib.backends.backend_agg"): "plots only: matplotlib is optional",
    ("moe/trainer/pipeline/timeline.py", "matplotlib.figure"): "plots only: matplotlib is optional",
    ("moe/trainer/pipeline/timeline.py", "matplotlib.patches"): "plots only: matplotlib is optional",
    ("moe/trainer/train/metrics.py", "matplotlib"): "plots only: matplotlib is optional",
    ("moe/trainer/train/metrics.py", "matplotlib.pyplot"): "plots only: matplotlib is optional",
    ("moe/trainer/train/loggers.py", "torch.utils.tensorboard"): "only with --tensorboard-dir: tensorboard is optional",
    ("moe/trainer/train/loggers.py", "wandb"): "only with --wandb-project: wandb is optional",
    ("moe/trainer/data/token_file.py", "tokenizers"): "only to train or key a tokenizer: tokenizers is optional",
    (
        "moe/trainer/models/deepseek_v3/model_tokens.py",
        "tokenizers",
    ): "only to encode or decode text: tokenizers is optional",
    ("moe/trainer/io/shard_files.py", "safetensors"): "only to read a safetensors file of a checkpoint",
    ("moe/trainer/train/metrics.py", "tqdm.auto"): "the progress bar only: tqdm is optional",
    (
        "moe/trainer/train/parallel_state.py",
        "torch.distributed.device_mesh",
    ): "torch's device meshes, only once a process "
    "group exists (the module is imported before torch.distributed is initialised, e.g. by the planner)",
}


def _library_files() -> list[Path]:
    return sorted(p for lib in LIBRARIES for p in (ROOT / lib).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str) -> list[str]:
    """The absolute module names an import statement of `module` names (a relative import resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            is_package = ROOT.joinpath(*module.split(".")).is_dir()
            base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            return [".".join([*base, *([node.module] if node.module else [])])]
        return [node.module or ""]
    return []


def test_library_never_reaches_examples_or_tests():
    found = []
    for path in _library_files():
        rel, module = path.relative_to(ROOT).as_posix(), _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            for name in _imported(node, module):
                if name.split(".")[0] in FORBIDDEN_ROOTS | {"runpy"}:
                    found.append(f"{rel}:{node.lineno}: imports {name}")
                if rel.startswith("mtdeepep/") and name.split(".")[0] == "moe":
                    found.append(f"{rel}:{node.lineno}: mtdeepep imports the layer above it ({name})")
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in PATH_EXECUTION:
                    found.append(f"{rel}:{node.lineno}: runs code by path or string ({name})")
                if name == "import_module" and any(
                    isinstance(a, ast.Constant) and str(a.value).split(".")[0] in FORBIDDEN_ROOTS for a in node.args
                ):
                    found.append(f"{rel}:{node.lineno}: imports {node.args[0].value} by name")
    assert not found, "\n".join(found)


def test_function_level_imports_are_the_allowed_ones():
    found = set()
    for path in _library_files():
        rel, module = path.relative_to(ROOT).as_posix(), _module_name(path)
        for fn in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    for name in _imported(node, module):
                        found.add((rel, name))
    library = sorted(f"{rel}: {name}" for rel, name in found if name.split(".")[0] in LIBRARIES)
    assert not library, "deferred imports of the library (an import circle hides behind them):\n" + "\n".join(library)
    assert found - ALLOWED.keys() == set(), "function-level imports without a reason in ALLOWED"
    assert ALLOWED.keys() - found == set(), "ALLOWED lists imports that are gone: remove them"


def _is_module(name: str) -> bool:
    """Whether `name` is a library module: a source file, a package or a compiled extension (`mtdeepep._C`)."""
    *parent, last = name.split(".")
    base = ROOT.joinpath(*parent)
    return (base / f"{last}.py").is_file() or (base / last / "__init__.py").is_file() or any(base.glob(f"{last}.*.so"))


def _module_level_imports(tree: ast.Module) -> list[ast.AST]:
    """The import statements that run when the module is imported (not those in functions, classes' methods or
    `if TYPE_CHECKING:` blocks)."""
    found = []
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        found += [node for node in ast.walk(statement) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return found


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _library_files():
        module = _module_name(path)
        edges = graph.setdefault(module, set())
        for node in _module_level_imports(ast.parse(path.read_text())):
            for name in _imported(node, module):
                submodules = [f"{name}.{alias.name}" for alias in getattr(node, "names", [])]
                if isinstance(node, ast.ImportFrom) and all(_is_module(m) for m in submodules):
                    edges.update(submodules)  # `from pkg import submodule`: needs the submodule
                elif _is_module(name):
                    edges.add(name)
        edges &= {_module_name(p) for p in _library_files()}
        edges.discard(module)
    return graph


# ARCHITECTURE.md's layers, bottom up, as library packages (a module belongs to the longest package naming it).
# `moe` holds two rooms: the MoE layer (`moe.layer`: router, balancing, dispatchers, experts, FP8, TP/SP blocks, one
# layer here, whose modules import each other) and above it the trainer (`moe.trainer`), whose packages are layers of
# their own; the files and the pipeline sit below the model, which reads checkpoints and splits into stages.
LAYER_ROOM, TRAINER_ROOM = "moe.layer", "moe.trainer"
LAYERS = (
    ("communication", ("mtdeepep",)),
    ("MoE layer room", ("moe", LAYER_ROOM)),
    ("trainer room", (TRAINER_ROOM,)),
    ("files", ("moe.trainer.io",)),
    ("pipeline", ("moe.trainer.pipeline",)),
    ("model", ("moe.trainer.models",)),
    ("data", ("moe.trainer.data",)),
    ("trainer", ("moe.trainer.train",)),
    ("planner", ("moe.trainer.plan",)),
    ("run assembly", ("moe.trainer.run",)),
)


def _layer_of(module: str) -> int:
    ranks = [
        (len(package), rank)
        for rank, (_, packages) in enumerate(LAYERS)
        for package in packages
        if module == package or module.startswith(package + ".")
    ]
    assert ranks, f"{module} is in no layer of LAYERS: add its package"
    return max(ranks)[1]


def test_packages_import_down_the_layer_table():
    upward = [
        f"{module} ({LAYERS[_layer_of(module)][0]}) imports {target} ({LAYERS[_layer_of(target)][0]})"
        for module, targets in sorted(_import_graph().items())
        for target in sorted(targets)
        if _layer_of(target) > _layer_of(module)
    ]
    assert not upward, "imports up the layer table:\n" + "\n".join(upward)
    assert _layer_of("moe.trainer.data.indexed") > _layer_of("moe.trainer.io.atomic"), "the scan must see the layers"


def test_layer_room_never_imports_the_trainer_room():
    """The two rooms of `moe`: the MoE layer (and `moe` itself, which re-exports it) never imports the trainer, at
    module level or in a function."""
    found = []
    for path in _library_files():
        module = _module_name(path)
        if module.startswith("mtdeepep") or module == TRAINER_ROOM or module.startswith(TRAINER_ROOM + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported(node, module):
                if name == TRAINER_ROOM or name.startswith(TRAINER_ROOM + "."):
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: imports {name}")
    assert not found, "the MoE layer room imports the trainer room above it:\n" + "\n".join(found)
    assert _layer_of(LAYER_ROOM + ".wgrad") < min(_layer_of(p) for _, ps in LAYERS[2:] for p in ps)


def test_module_level_imports_form_no_circle():
    graph = _import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert graph["mtdeepep.buffer"] >= {"mtdeepep.engines"}, "the scan must see the facade's imports"


# Run in a fresh interpreter: third-party packages are loaded once, then every library module is imported in a
# forked child (one per core at a time) that holds none of the library yet (a circle shows as an ImportError of a
# partly initialised module, whichever module of the circle comes first).
_ISOLATION_SCRIPT = r"""
import json, os, sys, traceback
sys.path.insert(0, ROOT)
# Third party only (the library is not loaded yet), each package the library imports at module level, so that the
# children import only the library's own modules (half the CPU time of preloading torch alone).
import numpy, torch, torch.distributed, torch.multiprocessing, torch.distributed.pipelining, torch.nn.attention
import torch._dynamo, sympy, safetensors, safetensors.torch, tomli_w, tomllib
import triton, triton.language, triton.runtime
assert not [m for m in sys.modules if m.split(".")[0] in LIBRARIES], "the library was loaded before the children"
failures = {}
running = {}  # pid -> (module, read end of its pipe); one child per core at a time


def reap():
    pid, _ = os.wait()
    name, read = running.pop(pid)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    if message:
        failures[name] = message


for name in MODULES:
    if len(running) >= max(1, os.cpu_count() or 1):
        reap()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(name)
            strays = sorted(m for m in sys.modules if m.split(".")[0] in ("examples", "tests"))
            message = f"loaded {strays}" if strays else ""
        except BaseException:
            message = traceback.format_exc(limit=-3)
        os.write(write, message.encode()[:60000])  # under a pipe's buffer: the child never blocks before its wait
        os._exit(0)
    os.close(write)
    running[pid] = (name, read)
while running:
    reap()
print(json.dumps(failures))
"""


@pytest.mark.slow  # slow: a fresh interpreter per module
def test_every_library_module_imports_in_isolation():
    modules = [_module_name(p) for p in _library_files()]
    script = (
        f"ROOT = {str(ROOT)!r}\nLIBRARIES = {LIBRARIES!r}\nMODULES = {modules!r}\n" + _ISOLATION_SCRIPT
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    failures = json.loads(out.stdout.splitlines()[-1])
    assert not failures, "\n\n".join(f"{name}:\n{message}" for name, message in failures.items())
