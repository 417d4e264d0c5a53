"""Smoke test of `bench/pipeline.py`, run as a user runs it, at tiny size: 1F1B on PP2 with both P2P transports
(torch.distributed's and mtdeepep's `pp_send` / `pp_recv`), one timed step each, no memory pass. Checks that both
rows were measured (step time, P2P share, the ratio to the torch transport) and that the two transports' gradients
were equal bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "pipeline.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: two rank processes build 2 pipelines


def test_pipeline_bench_compares_the_transports(tmp_path):
    out = tmp_path / "pipeline.json"
    argv = [sys.executable, str(BENCH), "--schedules", "1f1b", "--transports", "torch,deepep", "--micro-batches", "2",
            "--seq-len", "16", "--warmup", "0", "--steps", "1", "--no-memory", "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["1f1b", "1f1b/deepep"]
    for label, transport in (("1f1b", "torch"), ("1f1b/deepep", "deepep")):
        row = results[label]
        assert row["transport"] == transport and row["step_s"] > 0 and 0 < row["p2p_share"] < 1, row
        assert row["grads_equal_to_first_transport"] is True
    assert results["1f1b"]["step_vs_first_transport"] == 1.0
    assert results["1f1b/deepep"]["step_vs_first_transport"] > 0
    assert (
        "p2p share" in done.stdout and "gradients after the last step equal across the transports: True" in done.stdout
    )
