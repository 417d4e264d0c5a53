"""The trainer across namespace hosts (see test_hosts.py): scripts/train.sh's job (tiny's model, EP 4, a short
batch and 5 steps, a checkpoint after every step) on 2 hosts x 2 ranks, one `torchrun --rdzv-backend c10d` agent per
host, the run directory shared (the hosts share this machine's file system, as machines share a network one).

- Across hosts, the per-step losses are the one-process run's within the layout tolerance (test_train.py's).
- A checkpoint written across hosts resumes on 1 host x 4 ranks, and one written on 1 host x 4 ranks resumes across
  hosts: the losses continue bit for bit (the internode and the node-local paths sum in the same order).
- Host 1's link goes down while its ranks write their shards of a checkpoint: host 0's ranks raise within their
  timeout naming the lost ranks, host and phase; the launch exits non-zero within timeout + 30 s; every checkpoint
  left is complete; with the link back, the run resumes from the newest one and ends bit for bit as the
  uninterrupted run.
- Host 1 SIGKILLed mid-run (its agent and ranks): host 0's ranks raise naming ranks 2, 3, host 1 and the phase; the
  launch exits non-zero within timeout + 30 s, leaving no process, segment, temporary file or namespace.
- A machine-wide crash: every process on both hosts SIGKILLed while a checkpoint is half-written; the same command
  again resumes from the newest complete checkpoint and ends bit for bit as the uninterrupted run, leaving no
  process, segment, partial checkpoint, temporary file or namespace behind.

Needs root and namespaces: skipped with the reason otherwise. Slow (a torchrun start per run).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from moe.trainer.io.shard_files import read_full_section
from moe.trainer.train import checkpoint as ckpt
from moe.trainer.train.faults import ENV as FAULTS_ENV
from moe.trainer.train.metrics import read_metrics
from mtdeepep.utils.hosts import Hosts
from mtdeepep.utils.testing import run_processes
from tests.hosts.test_hosts import ROOT, TMP, hosts_or_skip, logs, torchrun, wait_all
from tests.train import train_cases as tc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN = ROOT / "examples" / "deepseek_v3" / "train.py"
STEPS = 5
# train.py --timeout of the fault run: every collective wait (the group's set-up included, so not shorter: the ranks
# of a loaded machine start seconds apart) and rank 0's wait for the shards of a checkpoint. The other runs: 120 s.
TIMEOUT_S = 15
_ports = iter(range(29431, 29499))  # one rendezvous port per launch (a fresh store each)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """tiny's model, 5 steps of 8 x 32 tokens in 2 micro-batches per rank, a checkpoint after every step, AdamW eps
    1e-6 (the layout tolerance of test_train.py needs it)."""
    root = tmp_path_factory.mktemp("data")
    training = {"eps": 1e-6, "steps": STEPS, "checkpoint_every": 1, "log_every": 1}
    return tc.make_config(root / "test.toml", tc.write_corpus(root / "corpus"), root / "cache", training=training)


def _argv(config: Path, run_dir: Path, *extra: str, timeout_s: float = 120) -> list[str]:
    return ["--config", str(config), "--out", str(run_dir), "--seed", "7", "--ep", "4", "--timeout", str(timeout_s),
            *extra]  # fmt: skip


def launch(hosts: Hosts, ranks_per_host: int, argv: list[str], log_dir: Path, *, num_hosts: int | None = None,
           env: dict[int, dict[str, str]] | None = None) -> list:  # fmt: skip
    """train.py on the first `num_hosts` hosts (default all), one agent each; `env[i]`: host i's extra variables."""
    num_hosts = num_hosts or len(hosts)
    port = next(_ports)
    return [
        torchrun(
            hosts,
            i,
            ranks_per_host,
            argv,
            log_dir,
            TIMEOUT_S,
            script=TRAIN,
            nnodes=num_hosts,
            port=port,
            env=(env or {}).get(i),
        )  # fmt: skip
        for i in range(num_hosts)
    ]


def _run_ok(hosts: Hosts, ranks_per_host: int, argv: list[str], log_dir: Path, num_hosts: int | None = None) -> None:
    procs = launch(hosts, ranks_per_host, argv, log_dir, num_hosts=num_hosts)
    assert wait_all(procs, log_dir, 400) == [0] * len(procs), logs(log_dir, len(procs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, config):
    """The one-process run; the run on 2 hosts x 2 ranks; the run on 1 host x 4 ranks resumed from the 2-host run's
    step_2 (the checkpoints of steps 3-5 are written by 1 host x 4 ranks)."""
    root = tmp_path_factory.mktemp("runs")
    one, two_hosts, one_host = root / "one", root / "two_hosts", root / "one_host"
    hosts = hosts_or_skip(2)
    # The one-process run beside the host runs (it needs nothing of theirs): it fills their waits (start-up,
    # rendezvous, the checkpoint writes).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        one_argv = ["--config", str(config), "--out", str(one), "--seed", "7"]
        one_process = pool.submit(run_processes, tc.torchrun_rank, 1, (one_argv,), timeout_s=300)
        try:
            _run_ok(hosts, 2, _argv(config, two_hosts), root / "logs_two_hosts")
            _copy_up_to(two_hosts, one_host, 2)
            _run_ok(hosts, 4, _argv(config, one_host, "--resume"), root / "logs_one_host", num_hosts=1)
        finally:
            hosts.close()
        one_process.result()
    return {"one": one, "two_hosts": two_hosts, "one_host": one_host}


def _copy_up_to(src: Path, dst: Path, step: int) -> None:
    """`src` as it stood after the checkpoint of `step`: the later checkpoints removed, `latest` on step `step`."""
    shutil.copytree(src, dst)
    for path in (dst / "checkpoints").glob("step_*"):
        if int(path.name.removeprefix("step_")) > step:
            shutil.rmtree(path)
    (dst / "checkpoints" / "latest").write_text(f"step_{step}")


def _losses(run_dir: Path) -> list[tuple[int, float, float, float]]:
    return [(r["step"], r["loss"], r["mtp_loss"], r["grad_norm"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def _same_states(a: Path, b: Path) -> None:
    for section in ("model", "optimizer"):
        ref, got = read_full_section(a, section), read_full_section(b, section)
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), section


def test_trainer_across_hosts(runs):
    """2 hosts x 2 ranks (experts 0-3 on host 0, 4-7 on host 1) reproduce the one-process losses within the layout
    tolerance; its step-2 checkpoint, resumed on 1 host x 4 ranks, continues bit for bit."""
    ref, got = _losses(runs["one"]), _losses(runs["two_hosts"])
    assert [s for s, *_ in got] == [s for s, *_ in ref] == list(range(1, STEPS + 1))
    # FP32; the layouts differ only in the order of reductions (test_train.py: held to 1e-5 with eps 1e-6).
    for (step, *a), (_, *b) in zip(ref, got):
        assert b == pytest.approx(a, rel=1e-5), (step, a, b)
    layout = json.loads((runs["two_hosts"] / "run.json").read_text())["layout"]
    assert (layout["world"], layout["ep"]) == (4, 4)
    # Across hosts -> one host: every record of the resumed steps, and the final state, bit for bit.
    assert _losses(runs["one_host"]) == got
    _same_states(
        runs["two_hosts"] / "checkpoints" / f"step_{STEPS}", runs["one_host"] / "checkpoints" / f"step_{STEPS}"
    )


def _wait_for_the_pause(procs, log_dir) -> None:
    """Until host 1's ranks report their injected pause (every launch still running, 300 s at most)."""
    deadline = time.monotonic() + 300
    while "fault injection: pause rank" not in (log_dir / "agent1.log").read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(log_dir, 2)
        time.sleep(0.05)


def _survivors_name_host1(log_dir, step: str) -> dict[str, str]:
    """Checks that a survivor on host 0 named the phase (mtdeepep's internode operation, or train.py's `step`
    pattern for the trainer's own collectives: gloo alone names an address), ranks 2, 3 and host 1; returns each
    survivor's last exception line (the one it raised: a chained cause comes before it), by rank."""
    text = (log_dir / "agent0.log").read_text()
    named = re.findall(rf"rank [01]: (?:internode \w+|{step}, \w+ > \w+)[^\n]*ranks 2, 3 on host host1", text)
    assert named, logs(log_dir, 2)
    final = {}
    for line in text.splitlines():
        if match := re.match(r"\[rank([01])\]: [\w.]*(?:Error|Exception): ", line):
            final[match.group(1)] = line
    return final


def test_link_down_in_a_checkpoint_write_then_resume(tmp_path, config, runs):
    """From the step-3 checkpoint written on 1 host x 4 ranks, 2 hosts x 2 ranks train step 4 (its loss: the
    uninterrupted run's, bit for bit) and write its checkpoint; host 1's ranks pause halfway through their shards
    and host 1's link goes down. Host 0's ranks raise in step 5 within their timeout, naming ranks 2, 3, host 1 and
    the phase; host 0's launch exits non-zero within timeout + 30 s; no checkpoint a resume would trust is
    incomplete. With the link back, --resume continues from the newest complete checkpoint, and the run ends bit
    for bit as the uninterrupted one."""
    ref = _losses(runs["two_hosts"])
    run_dir = tmp_path / "run"
    _copy_up_to(runs["one_host"], run_dir, 3)
    hosts = hosts_or_skip(2)
    try:
        pause = [{"kind": "pause_in_write", "step": 4, "rank": r, "seconds": 3 * TIMEOUT_S} for r in (2, 3)]
        log_dir = tmp_path / "logs_cut"
        argv = _argv(config, run_dir, "--resume", timeout_s=TIMEOUT_S)
        procs = launch(hosts, 2, argv, log_dir, env={1: {FAULTS_ENV: json.dumps(pause)}})
        _wait_for_the_pause(procs, log_dir)
        cut = time.monotonic()
        hosts.set_link(1, up=False)
        codes = wait_all(procs[:1], log_dir, TIMEOUT_S + 30)
        assert codes[0] != 0 and time.monotonic() - cut < TIMEOUT_S + 30, (codes, logs(log_dir, 2))
        final = _survivors_name_host1(log_dir, step=r"step 5")
        assert all("ranks 2, 3 on host host1" in line for line in final.values()), final
        # Step 4 ran across hosts from the checkpoint written on one host: its record is the uninterrupted run's.
        assert _losses(run_dir)[3] == ref[3]
        # Every checkpoint a resume could pick is complete (its files verified); any partial directory is hidden.
        root = run_dir / "checkpoints"
        for path in root.glob("step_*"):
            assert ckpt.is_complete(path, verify_checksums=True), path
        # Host 1's shards of step 4 never came (paused past rank 0's deadline, then cut off): step_4 was not
        # published, and the newest checkpoint is step 3's.
        assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_2", "step_3"]
        assert ckpt.latest_checkpoint(run_dir).name == "step_3"
        # Host 1's torchrun agent blocks on the rendezvous store it cannot reach (torch's code): kill its host's
        # processes (agent and any rank still alive: they run in their own sessions) before the relaunch.
        hosts.kill(1)
        hosts.set_link(1, up=True)
        _run_ok(hosts, 2, _argv(config, run_dir, "--resume"), tmp_path / "logs_resume")
    finally:
        hosts.close()
    assert _losses(run_dir) == ref
    _same_states(runs["two_hosts"] / "checkpoints" / f"step_{STEPS}", run_dir / "checkpoints" / f"step_{STEPS}")


def test_host_sigkilled_mid_run_is_named_and_nothing_leaks(tmp_path, config):
    """2 hosts x 2 ranks start the run; while host 1's ranks are halfway through their shards of step 1's checkpoint
    (host 0's ranks train on into step 2, waiting on them), every process of host 1 (its torchrun agent and both
    ranks) is SIGKILLed. Host 0's ranks raise naming the lost ranks 2, 3, their host and the phase (not gloo's
    connection reset and an address alone), and host 0's launch exits non-zero within timeout + 30 s, leaving no
    process on either host, no segment in either host's /dev/shm, no temporary file and, once the hosts close, no
    namespace."""
    run_dir = tmp_path / "run"
    hosts = hosts_or_skip(2)
    tag = hosts.tag
    try:
        pause = [{"kind": "pause_in_write", "step": 1, "rank": r, "seconds": 300} for r in (2, 3)]
        log_dir = tmp_path / "logs"
        argv = _argv(config, run_dir, timeout_s=TIMEOUT_S)
        procs = launch(hosts, 2, argv, log_dir, env={1: {FAULTS_ENV: json.dumps(pause)}})
        _wait_for_the_pause(procs, log_dir)
        assert len(set(hosts.pids(1)) - {hosts.hosts[1].holder_pid}) >= 3, hosts.pids(1)  # the agent and its ranks
        killed = time.monotonic()
        hosts.kill(1)
        assert procs[1].wait(timeout=30) == -signal.SIGKILL
        codes = wait_all(procs[:1], log_dir, TIMEOUT_S + 30)
        assert codes[0] != 0 and time.monotonic() - killed < TIMEOUT_S + 30, (codes, logs(log_dir, 2))
        final = _survivors_name_host1(log_dir, step=r"step \d+")
        assert final and all("ranks 2, 3 on host host1" in line for line in final.values()), final
        # Nothing hangs or is left: host 0's agent ended its ranks; no segment in either host's /dev/shm.
        for i in range(2):
            assert hosts.pids(i) == [hosts.hosts[i].holder_pid], (i, hosts.pids(i))
            assert _host_shm(hosts, i) == [], (i, _host_shm(hosts, i))
    finally:
        hosts.close()
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not _processes_naming(str(run_dir)), _processes_naming(str(run_dir))
    assert not _files_under(log_dir / TMP), _files_under(log_dir / TMP)


def _files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if not p.is_dir())


def _host_shm(hosts: Hosts, index: int) -> list[str]:
    """The names in host `index`'s own /dev/shm."""
    out = subprocess.run(hosts.command(index, ["ls", "-A", "/dev/shm"]), capture_output=True, text=True, check=True,
                         timeout=30).stdout  # fmt: skip
    return out.split()


def _processes_naming(text: str) -> list[str]:
    """The command lines of this machine's processes that contain `text` (any namespace)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if text in cmdline:
                    found.append(f"{entry.name}: {cmdline}")
    return found


def test_every_process_sigkilled_in_a_checkpoint_write_then_relaunched(tmp_path, config, runs):
    """A machine-wide crash: 2 hosts x 2 ranks resume the run from its step-2 checkpoint (`--resume`) and train step
    3; while host 1's ranks are halfway through their shards of step 3's checkpoint, every process on both hosts
    (both torchrun agents and all four ranks, each rank in a session of its own) is SIGKILLed in one sweep. The
    half-written checkpoint is never trusted: the newest complete one is step 2's. The same command, launched
    again, resumes from step 2 and ends bit for bit as the uninterrupted run (per-step records and final model and
    optimizer state). Nothing is left behind: no process (on the hosts or anywhere on the machine), no segment in
    either host's /dev/shm, no hidden partial checkpoint, no temporary file, and, once the hosts close, no
    namespace."""
    ref = _losses(runs["two_hosts"])
    run_dir = tmp_path / "run"
    _copy_up_to(runs["two_hosts"], run_dir, 2)
    argv = _argv(config, run_dir, "--resume")  # both launches: the same command
    hosts = hosts_or_skip(2)
    tag = hosts.tag
    try:
        # Host 1's ranks hold halfway through their shards long enough for the kill (they never wake up from it).
        pause = [{"kind": "pause_in_write", "step": 3, "rank": r, "seconds": 300} for r in (2, 3)]
        log_dir = tmp_path / "logs_killed"
        procs = launch(hosts, 2, argv, log_dir, env={1: {FAULTS_ENV: json.dumps(pause)}})
        root = run_dir / "checkpoints"
        deadline = time.monotonic() + 300
        # In the middle of the write: host 1 paused in its shards, and the hidden directory of step 3 holds files.
        while "fault injection: pause rank" not in (log_dir / "agent1.log").read_text() or not any(
            _files_under(p) for p in root.glob(".step_3.partial-*")
        ):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(log_dir, 2)
            time.sleep(0.05)
        pids = {i: sorted(set(hosts.pids(i)) - {hosts.hosts[i].holder_pid}) for i in range(2)}
        assert all(len(p) >= 3 for p in pids.values()), pids  # an agent and its two ranks on each host (at least)
        # torchrun starts each rank in a session of its own: ending the agents' process groups would leave them.
        sessions = {i: {os.getsid(pid) for pid in p} for i, p in pids.items()}
        assert all(len(s) >= 3 for s in sessions.values()), sessions
        hosts.kill()
        assert [p.wait(timeout=30) for p in procs] == [-signal.SIGKILL] * 2
        for i in range(2):
            assert hosts.pids(i) == [hosts.hosts[i].holder_pid], (i, hosts.pids(i))
        assert not _processes_naming(str(run_dir)), _processes_naming(str(run_dir))
        # What the crash left: step 3's checkpoint half-written (hidden, never published), the ones before complete.
        assert [p.name for p in root.glob(".step_3.partial-*")], list(root.iterdir())
        assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_2"]
        assert all(ckpt.is_complete(p, verify_checksums=True) for p in root.glob("step_*"))
        assert ckpt.latest_checkpoint(run_dir).name == "step_2"
        left_in_shm = {i: _host_shm(hosts, i) for i in range(2)}  # segments are unlinked once mapped: expect none

        log_dir = tmp_path / "logs_relaunch"
        _run_ok(hosts, 2, argv, log_dir)
        assert f"from step 2 to {STEPS}" in (log_dir / "agent0.log").read_text(), logs(log_dir, 2)
        for i in range(2):
            assert hosts.pids(i) == [hosts.hosts[i].holder_pid], (i, hosts.pids(i))
            assert _host_shm(hosts, i) == [], (i, _host_shm(hosts, i), left_in_shm)
    finally:
        hosts.close()
    assert _losses(run_dir) == ref
    _same_states(runs["two_hosts"] / "checkpoints" / f"step_{STEPS}", run_dir / "checkpoints" / f"step_{STEPS}")
    assert sorted(p.name for p in root.iterdir()) == ["latest", *(f"step_{s}" for s in range(1, STEPS + 1))]
    # Temporary files: none (torchrun keeps an empty log directory per launch; the launches' TMPDIR holds them).
    for launch_dir in (tmp_path / "logs_killed", tmp_path / "logs_relaunch"):
        assert not _files_under(launch_dir / TMP), _files_under(launch_dir / TMP)
    assert tag not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not _processes_naming(str(run_dir)), _processes_naming(str(run_dir))
