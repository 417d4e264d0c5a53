"""Issue 39: a peer killed between two buffer set-ups is reported at once (within a second, naming its rank, pid and
host), not at the set-up timeout; and the liveness records a dead process leaves in the store do not mislead a job
restarted in the same store (cases in liveness_cases.py).

Before the fix, liveness was looked up per set-up generation: a peer killed after finishing set-up n and before
starting set-up n + 1 had published nothing for n + 1, and the survivor waited for the whole timeout.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from mtdeepep.utils.testing import run_processes

from . import liveness_cases as cases
from .liveness_cases import Trial

TIMEOUT_S = 20.0  # the set-up timeout: a report at it is the defect
REPORT_WITHIN_S = 1.0


def _run(trials: list[Trial]) -> list[tuple[tuple, tuple]]:
    """(survivor's report, victim's kill) per trial."""
    finished = run_processes(cases.forked_trials, 2, (trials, TIMEOUT_S),
                             timeout_s=30 + len(trials) * (TIMEOUT_S + 10))  # fmt: skip
    assert finished.exitcodes == [0, 0], finished.exitcodes
    reports, kills = finished.values[0][0], finished.values[1][0]
    return list(zip(reports, kills, strict=True))


def _named_at_once(report, kill) -> float:
    """Seconds from the kill to the survivor's error, which must name the dead rank, its pid and host: the set-up
    exchange's words (`group rank 1 (global 1, pid N, host H) exited`) or, for a kill inside the set-up's segment
    mapping, the shared-memory peer group's (`rank 1 (pid N, host H) exited`)."""
    kind, message, at = report
    killed_at, pid, host = kill
    assert kind == "CommError", (kind, message)
    named = (f"group rank 1 (global 1, pid {pid}, host {host}) exited", f": rank 1 (pid {pid}, host {host}) exited")
    assert any(words in message for words in named), message
    return at - killed_at


POSITIONS = ["after_setup", "after_destroy"]


@pytest.mark.timeout(120)
@pytest.mark.slow  # forks and kills rank pairs: ~20 s
def test_a_peer_killed_between_setups_is_named_at_once():
    """Rank 1 SIGKILLed right after a completed set-up (before any call on the buffer) or right after its destroy()
    (before its next set-up): after the 3rd round's set-up (a low-latency buffer), after the 2nd round's destroy()."""
    trials = [Trial("intranode", "after_setup", 2), Trial("intranode", "after_destroy", 1)]
    for trial, (report, kill) in zip(trials, _run(trials), strict=True):
        assert _named_at_once(report, kill) < REPORT_WITHIN_S, (trial, report)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_killed_between_setups_is_named_at_once_internode_and_elastic():
    """The same window for the internode engine's set-up (two nodes of one rank: the network stage's groups too) and
    for `ElasticBuffer`: both go through `create_engine`'s `SetupRendezvous`."""
    trials = [Trial(kind, position) for kind in ("internode", "elastic") for position in POSITIONS]
    for trial, (report, kill) in zip(trials, _run(trials), strict=True):
        assert _named_at_once(report, kill) < REPORT_WITHIN_S, (trial, report)


RANDOM_TRIALS = 200


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_randomised_kill_times_never_wait_for_the_timeout():
    """Hundreds of kill times drawn at random over the loop (set-ups, destroys and the gaps between them: a round
    takes about 10 ms, so 0.25 s spans some 25 rounds)."""
    rng = random.Random(39)
    trials = [Trial("intranode", "random", delay_s=rng.uniform(0.0, 0.25)) for _ in range(RANDOM_TRIALS)]
    start = time.monotonic()
    results = _run(trials)
    latencies = sorted(_named_at_once(report, kill) for report, kill in results)
    print(f"{len(results)} randomised kills in {time.monotonic() - start:.0f} s: report latency median "
          f"{latencies[len(latencies) // 2]:.3f} s, max {latencies[-1]:.3f} s")  # fmt: skip
    assert latencies[-1] < REPORT_WITHIN_S, latencies[-5:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_restarted_in_the_same_store_is_not_misled_by_the_records_of_the_killed_one():
    """Job A's ranks leave a live record (rank 1) and a published set-up failure (rank 0, its 2nd buffer) and are
    killed; job B, in the same store, has the rank whose old records remain arrive late at the same set-up: the
    stale records are cleared, not reported (a dead rank 1, rank 0's failure of A), and B's set-ups succeed, reading
    none of A's set-up exchange entries (before: B's rank 0 read A's rank 1's entry of the same generation, or took
    A's rank 1's live record for a peer already at A's buffer #2)."""
    big = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize * 4  # more than /dev/shm holds
    late_s = 1.0
    finished = run_processes(cases.restarted_job_in_the_same_store, 2, (late_s, big), timeout_s=120)
    assert finished.exitcodes == [0, 0], finished.exitcodes
    (job_a0, job_b0), live0 = finished.values[0][0]
    (job_a1, job_b1), live1 = finished.values[1][0]
    assert [kind for kind, _, _ in job_a0[1]] == ["ok", "CommError"], job_a0
    assert [kind for kind, _, _ in job_a1[1]] == ["ok", "CommError"], job_a1  # rank 0's published failure
    for outcomes in (job_b0[1], job_b1[1]):
        assert [kind for kind, _, _ in outcomes] == ["ok", "ok"], outcomes
    # The waiting rank waited for the late one (it did not stop at the stale record).
    assert job_b0[1][0][2] >= late_s * 0.9 and job_b1[1][1][2] >= late_s * 0.9, (job_b0, job_b1)
    # Each rank's live record is now job B's.
    assert f" {job_b0[0]} " in live0 and f" {job_b1[0]} " in live1, (live0, live1)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_ranks_at_different_buffer_generations_are_told_so_with_the_current_failure():
    """Issue 38, item 3 (before: rank 1 reported rank 0's timeout of the first round, "group rank 0 (global 0)
    failed its set-up: CommTimeoutError: ... rank 0 timed out after 3.0 s", as if it were the current failure)."""
    big = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize * 4  # more than /dev/shm holds
    finished = run_processes(cases.diverged_generations, 2, (big, 3.0), timeout_s=90)
    assert finished.exitcodes == [0, 0], finished.exitcodes
    (first0, second0), (only1,) = finished.values[0][0], finished.values[1][0]
    assert first0[0] == "CommTimeoutError" and "group rank(s) [1]" in first0[1], first0
    assert second0[0] == "CommError" and "/dev/shm" in second0[1], second0
    kind, message = only1
    assert kind == "CommError", only1
    assert "different buffer generations" in message, message
    assert "building the group's buffer #1" in message and "is building #2" in message, message
    assert "its set-up of #2 failed" in message and "/dev/shm" in message, message  # the current failure
