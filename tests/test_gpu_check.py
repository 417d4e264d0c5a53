"""`scripts/gpu_check.sh --dry-run`: the plumbing of the staged GPU check (stage selection, per-stage limits clipped
to the whole budget, the logs in $OUT, the summary table printed last and appended to $OUT/summary.txt, the exit
status) with the GPU work replaced by its stand-ins, run as a subprocess the way the device machine runs it.
GPU_CHECK_DRY_SLEEP_S makes every dry stage (build included) sleep, so that small budgets show the clipping."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # slow: dry runs of the staged GPU check

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STAGES = [
    "facts", "build", "triton", "measure", "smoke", "local", "sanitizer", "bench", "core2", "gemm", "fail2",
    "torchtitan", "core4", "fail4",
]  # fmt: skip
PYTEST_STAGES = ["triton", "local", "core2", "gemm", "fail2", "torchtitan", "core4", "fail4"]
# The files the script documents in $OUT (at most 8).
OUT_FILES = {
    "summary.txt", "build.log", "smoke.log", "tests.log", "sanitizer.log", "bench.log", "bench.json", "prebuilt.tar",
}  # fmt: skip
HEADER = "stage       verdict   time  outcome"
ROW = re.compile(r"^(\S+)\s+(PASS|FAIL|CUT|NOT RUN)\s+(\d+s|-)  ?(.*)$")


def run_check(tmp_path: Path, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, Path, float]:
    """Runs the dry check with $OUT in tmp_path and `env` on top of a clean environment (no GPU_CHECK_* or pytest
    options of the caller); returns the process, $OUT and the wall time."""
    out = tmp_path / "out"
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPU_CHECK_") and k not in ("OUT", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")
    }
    base.update(OUT=str(out), GPU_CHECK_PYTHON=sys.executable, **env)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=base, capture_output=True, text=True, timeout=timeout
    )
    return proc, out, time.monotonic() - t0


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def table(text: str) -> list[str]:
    """The summary table: its header (the last one in `text`) and every line after it."""
    lines = text.rstrip("\n").splitlines()
    assert HEADER in lines, f"no summary table in:\n{text[-3000:]}"
    start = len(lines) - 1 - lines[::-1].index(HEADER)
    return lines[start:]


def rows(text: str) -> list[tuple[str, str, str]]:
    """(stage, verdict, outcome) of each row of the summary table in `text`, in order."""
    parsed = []
    for line in table(text)[1:]:
        if line.startswith(("total ", "[gpu_check]")):
            break
        match = ROW.match(line)
        assert match, f"not a summary row: {line!r}"
        parsed.append((match[1], match[2], match[4].strip()))
    return parsed


def check_out_files(out: Path, proc: subprocess.CompletedProcess) -> list[str]:
    names = sorted(p.name for p in out.iterdir())
    assert len(names) <= 8, names
    for name in names:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", name), name
        assert (out / name).is_file(), name
    assert set(names) <= OUT_FILES, names
    assert "summary.txt" in names
    # The table is printed last and summary.txt ends with the same table.
    printed = table(proc.stdout)
    assert proc.stdout.rstrip("\n").splitlines()[-len(printed) :] == printed
    assert table((out / "summary.txt").read_text()) == printed, describe(proc)
    return names


@pytest.mark.slow
def test_full_dry_run_passes_every_stage_in_order(tmp_path):
    """Every stage runs (GPU_CHECK_STAGES unset, default budget) and passes; the pytest stages collect something."""
    proc, out, _ = run_check(tmp_path, timeout=420)
    assert proc.returncode == 0, describe(proc)
    summary = rows(proc.stdout)
    assert [name for name, _, _ in summary] == STAGES, describe(proc)
    assert all(verdict == "PASS" for _, verdict, _ in summary), describe(proc)
    for name, _, outcome in summary:
        if name in PYTEST_STAGES:
            match = re.search(r"(\d+)(?:/\d+)? tests? collected", outcome)
            assert match and int(match[1]) > 0, f"{name}: {outcome!r}"
    assert "of the 540 s budget" in table(proc.stdout)[-1], describe(proc)
    names = check_out_files(out, proc)
    assert {"build.log", "smoke.log", "tests.log", "sanitizer.log", "bench.log"} <= set(names)
    tests_log = (out / "tests.log").read_text()
    for name in PYTEST_STAGES:
        assert f"===== stage {name} (limit " in tests_log


def test_stage_selection_runs_facts_build_and_the_selected_stage(tmp_path, load_scale):
    proc, out, wall = run_check(tmp_path, timeout=120, GPU_CHECK_STAGES="smoke")
    assert proc.returncode == 0, describe(proc)
    assert [(name, verdict) for name, verdict, _ in rows(proc.stdout)] == [
        ("facts", "PASS"),
        ("build", "PASS"),
        ("smoke", "PASS"),
    ], describe(proc)
    assert sorted(check_out_files(out, proc)) == ["build.log", "smoke.log", "summary.txt"]
    assert wall < 60 * load_scale, wall


def test_small_budget_leaves_the_later_stages_not_run(tmp_path, load_scale):
    """Budget 26 s, 6 s per stage: facts, build and (when the machine is not too slow) smoke fit; a stage that finds
    under 15 s left is NOT RUN with the reason, listed all the same, and the run fails. On a busy machine the facts
    stage (it imports torch) is slower, so the budget and the stage time stretch with the load."""
    budget = round(26 * load_scale)
    selected = ["smoke", "local", "sanitizer", "bench", "core2"]
    proc, out, wall = run_check(
        tmp_path,
        timeout=budget + 90,
        GPU_CHECK_BUDGET_S=str(budget),
        GPU_CHECK_DRY_SLEEP_S=str(round(6 * load_scale)),
        GPU_CHECK_STAGES=",".join(selected),
    )
    assert proc.returncode == 1, describe(proc)
    summary = rows(proc.stdout)
    # Every selected stage has its row, in order, even those left out.
    assert [name for name, _, _ in summary] == ["facts", "build", *selected], describe(proc)
    verdicts = [verdict for _, verdict, _ in summary]
    assert verdicts[:2] == ["PASS", "PASS"], describe(proc)
    # PASS ... then at most one CUT, then NOT RUN to the end (the budget only shrinks).
    assert re.fullmatch(r"(PASS,)+(CUT,)?(NOT RUN,)+", ",".join(verdicts) + ","), describe(proc)
    for _, verdict, outcome in summary:
        if verdict == "NOT RUN":
            assert outcome == f"no time left of the {budget} s budget", outcome
    assert f"of the {budget} s budget" in table(proc.stdout)[-1]
    check_out_files(out, proc)
    assert wall < budget + 30, wall


def test_cut_build_stops_the_run_and_still_prints_the_summary(tmp_path, load_scale):
    """Budget 20 s, 30 s per stage: the build gets what is left (under 20 s), is cut at that limit, and a build that
    did not pass stops everything; the summary (facts and build only) is printed and saved all the same. The budget
    and the stage time stretch with the load (the facts stage imports torch)."""
    budget = round(20 * load_scale)
    proc, out, wall = run_check(
        tmp_path, timeout=budget + 90, GPU_CHECK_BUDGET_S=str(budget), GPU_CHECK_DRY_SLEEP_S=str(round(30 * load_scale))
    )
    assert proc.returncode == 1, describe(proc)
    summary = rows(proc.stdout)
    assert [(name, verdict) for name, verdict, _ in summary] == [("facts", "PASS"), ("build", "CUT")], describe(proc)
    limit = re.match(r"stopped at its (\d+) s limit", summary[1][2])
    assert limit and 15 <= int(limit[1]) < budget, summary[1]
    assert "the build failed: nothing else can run" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["build.log", "summary.txt"]
    assert rows((out / "summary.txt").read_text()) == summary
    assert wall < budget + 15, wall
