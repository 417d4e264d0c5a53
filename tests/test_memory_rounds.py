"""Issue 23, item 5: memory over many random dispatch + combine rounds (`bench/memory_rounds.py`, run as a user runs
it). Before: each freed output's block stayed cached for a request of exactly its size, up to 2 GiB per buffer, so
rounds of varied sizes piled up one block per size (a rank grew by 130-145 MB in the second half of 520 rounds, its
mappings by one per new size). Now, between round 150 and round 600 on both ranks: the same mappings, the same
memory in use by malloc, the same Python objects, and the resident set, once the allocator gives back the free
memory it keeps (malloc_trim), within a few MB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "memory_rounds.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: 2,000 rounds


def test_memory_is_flat_over_rounds_of_varied_sizes(tmp_path):
    out = tmp_path / "memory_rounds.json"
    argv = [sys.executable, str(BENCH), "--rounds", "600", "--report", "150,600", "--trim-at-reports", "1",
            "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank, samples in enumerate(json.loads(out.read_text())["per_rank"]):
        first, last = (next(s for s in samples if s["round"] == r) for r in (150, 600))
        in_use = [s["heap_in_use_mb"] + s["mmapped_mb"] for s in (first, last)]
        assert last["mappings"] <= first["mappings"] + 2, (rank, first, last)
        assert in_use[1] - in_use[0] < 4.0, (rank, in_use)  # a leak of tensors or records would show here
        assert last["python_objects"] - first["python_objects"] < 500, (rank, first, last)
        assert last["rss_after_trim_mb"] - first["rss_after_trim_mb"] < 40.0, (rank, first, last)
        assert last["segments"] == first["segments"] and last["fds"] == first["fds"], (rank, first, last)
