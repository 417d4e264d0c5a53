"""`bench/moe_layer_gpu.py --dry-run`: the GPU benchmark's code path (layers, parity check, timing, table, JSON) run on
the CPU at tiny sizes, as a subprocess the way a user runs it (a few seconds on 2 cores). The numbers mean nothing
here; the test checks that every variant has a row that is either timed (positive tokens/s, its parity with the
loop within its bound, its kernel counted) or skipped with a reason, FP8 always skipped on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe.layer.experts import grouped_mm_available

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "moe_layer_gpu.py"

pytestmark = pytest.mark.timeout(180)


def run_dry(tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / "moe_layer_gpu.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_dry_run_times_every_runnable_variant_and_says_why_others_are_skipped(tmp_path):
    result, stdout = run_dry(tmp_path)
    assert result["dry_run"] is True and result["device"] == "cpu"
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["loop", "grouped_bf16", "fp8"]
    assert "tokens/s" in stdout and "fp8 skipped" in stdout  # the table and the skip note

    expected_ok = {"loop"} | ({"grouped_bf16"} if grouped_mm_available("cpu", torch.bfloat16) else set())
    for name, row in rows.items():
        if name in expected_ok:
            assert row["status"] == "ok", f"{name}: {row['reason']}"
            assert row["tokens_per_s"] > 0 and row["time_ms"] > 0
            assert len(row["samples_ms"]) == result["config"]["rounds"]
            assert max(row["parity_vs_loop"].values()) <= row["tolerance"]
            assert row["vs_loop"] > 0
        else:
            assert row["status"] == "skipped" and row["reason"], f"{name}: {row}"
            assert "tokens_per_s" not in row
    assert "_scaled_mm" in rows["fp8"]["reason"]  # FP8 needs CUDA: skipped, not silently dropped
    if "grouped_bf16" in expected_ok:
        assert rows["grouped_bf16"]["kernel_calls"]["_grouped_mm"] > 0  # the grouped GEMM really ran


def test_without_dry_run_and_without_cuda_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full benchmark would run")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", str(tmp_path / "x.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "x.json").exists()
