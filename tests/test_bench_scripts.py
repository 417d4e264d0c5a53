"""The benchmark scripts run as `python bench/NAME.py`, which puts `bench/` first on `sys.path`: a script named like a
standard-library module (`tokenize`, `profile`, `trace`, ...) would shadow it for every other script (torch's import
reads `tokenize` through `linecache`, so they would all fail at `import torch`)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_script_shadows_the_standard_library():
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "decode" in names and "low_latency" in names  # the scan sees the scripts
    assert [n for n in names if n in sys.stdlib_module_names] == []
