"""The bounded waits of mtdeepep.kernels.sync in one process under Triton's interpreter (a subprocess, so that
TRITON_INTERPRET is set before Triton is imported), and the executor's registry by name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtdeepep.engines import engine_name, named_engine_class

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import triton.language as tl
    from mtdeepep.kernels import sync
    # The form of the first-failure claim: compare-and-swap, or the ticket form of backends without it (MUSA).
    sync.HAS_ATOMIC_CAS = tl.constexpr(sys.argv[1] == "cas")
    R = 3
    regions = [torch.zeros(16384, dtype=torch.uint8) for _ in range(R)]
    table = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    status = sync.StatusWord(torch.device("cpu"))
    regions[0][64:72].view(torch.int64)[0] = 1  # rank 0's own flag at rank 0 (slot 0) is there
    # Rank 0 waits for ranks 1 and 2, which never signal: a timeout naming rank 1 and the phase, rank 2 poisoned
    # (rank 1, the suspect, is not written).
    sync.wait_all_kernel[(1,)](table, table, status.words, 64, 1, 20, sync.PHASE_DISPATCH_RECEIVE, 0, R, CLOCK=0)
    try:
        status.check()
    except sync._C.CommTimeoutError as error:
        print("TIMEOUT", error)
    print("POISON", int(regions[1][:8].view(torch.int64)[0]), int(regions[2][:8].view(torch.int64)[0]) != 0)
    # Rank 2 then stops at once, naming rank 0's failure as the cause (a bound it could not reach in time).
    other = sync.StatusWord(torch.device("cpu"))
    sync.wait_all_kernel[(1,)](table, table, other.words, 64, 1, 10**9, sync.PHASE_COMBINE_RECEIVE, 2, R, CLOCK=0)
    try:
        other.check()
    except sync._C.CommTimeoutError as error:
        print("STOPPED", error)
    # A flag that is set: no wait, no error.
    regions[0][64:72].view(torch.int64)[0] = 5
    ok = sync.StatusWord(torch.device("cpu"))
    regions[0][:8].zero_()
    sync.wait_all_kernel[(1,)](table, table, ok.words, 64, 5, 20, sync.PHASE_BARRIER, 0, 1, CLOCK=0)
    ok.check()
    print("OK")
    """
)


@pytest.mark.parametrize("form", ["cas", "rmw"])
def test_wait_times_out_naming_the_rank_and_poisons_the_others(form):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT, form], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        "TIMEOUT mtdeepep: rank 0 timed out waiting for rank 1 in phase 'dispatch: rows received': rank(s) [1] did "
        "not arrive" in lines
    ), out.stdout
    assert "POISON 0 True" in lines, out.stdout
    assert any(
        line.startswith("STOPPED mtdeepep: rank 2 stopped in phase 'combine: rows received' because rank 0 timed out")
        for line in lines
    ), out.stdout
    assert "OK" in lines


REPORT_SCRIPT = textwrap.dedent(
    """
    import torch
    from mtdeepep.kernels import sync
    codes = torch.tensor([sync.encode_error(1, 3, 1, 0), sync.encode_error(3, 0, 0, 0), sync.encode_error(2, 4, 2, 0)])
    for cas in (True, False):
        status = sync.StatusWord(torch.device("cpu"))
        poison = torch.zeros(1, dtype=torch.int64)
        sync.report_kernel[(1,)](status.words, poison, codes, 3, CAS=cas)
        print("CAS" if cas else "RMW", *status.words.tolist(), int(poison[0]))
    """
)


def test_first_failure_claim_with_and_without_compare_and_swap():
    """Both forms keep the first code in the status word; the ticket form counts every report, and its poison word
    keeps the largest code (the CAS form the first)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", REPORT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from mtdeepep.kernels.sync import encode_error

    first, abort, third = encode_error(1, 3, 1, 0), encode_error(3, 0, 0, 0), encode_error(2, 4, 2, 0)
    lines = out.stdout.splitlines()
    assert f"CAS {first} 0 0 {first}" in lines, out.stdout
    assert f"RMW {first} 0 3 {max(first, abort, third)}" in lines, out.stdout


def test_engine_names(monkeypatch):
    monkeypatch.setenv("MTDEEPEP_ENGINE", "tritonn")
    with pytest.raises(ValueError, match="must be one of cpu, cuda, triton"):
        engine_name()
    monkeypatch.setenv("MTDEEPEP_ENGINE", " Triton ")
    assert engine_name() == "triton"
    monkeypatch.delenv("MTDEEPEP_ENGINE")
    assert engine_name() is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        named_engine_class("triton", "cpu")
    with pytest.raises(ValueError, match="cannot serve a group on cpu"):
        named_engine_class("cuda", "cpu")
