"""The calibration's runtime baseline loads what a training rank loads: `TRAIN_PY_MODULES` is the set of library
modules the run assembly (moe/trainer/run.py, what examples/deepseek_v3/train.py runs) imports, neither fewer nor
more."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from moe.trainer.plan.calibrate import TRAIN_PY_MODULES

ROOT = Path(__file__).resolve().parents[2]
TRAIN_PY = ROOT / "moe" / "trainer" / "run.py"  # the module train.py runs
LIBRARIES = ("moe", "mtdeepep")


def _library_imports(path: Path) -> list[ast.stmt]:
    """The module-level import statements of `path` that name a library package."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if any(name.split(".")[0] in LIBRARIES for name in names):
            found.append(node)
    return found


def test_train_py_modules_are_what_train_py_imports():
    statements = _library_imports(TRAIN_PY)
    assert statements
    # A fresh interpreter that imported TRAIN_PY_MODULES: train.py's own imports then load no further library module.
    script = "\n".join(
        [
            "import importlib, json, sys",
            f"sys.path.insert(0, {str(ROOT)!r})",
            f"for name in {TRAIN_PY_MODULES!r}: importlib.import_module(name)",
            f"before = {{m for m in sys.modules if m.split('.')[0] in {LIBRARIES!r}}}",
            *(ast.unparse(s) for s in statements),
            f"after = {{m for m in sys.modules if m.split('.')[0] in {LIBRARIES!r}}}",
            "print(json.dumps(sorted(after - before)))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [], "train.py imports library modules TRAIN_PY_MODULES lacks"
    # ... and every listed module is one train.py names (as `import m`, `from m import x` or `from p import m`).
    named = set()
    for s in statements:
        if isinstance(s, ast.ImportFrom):
            named.add(s.module)
            named.update(f"{s.module}.{alias.name}" for alias in s.names)
        else:
            named.update(alias.name for alias in s.names)
    assert set(TRAIN_PY_MODULES) <= named, sorted(set(TRAIN_PY_MODULES) - named)
