"""Several machines for real: namespace hosts on this machine (`mtdeepep.utils.hosts`: own network, `/dev/shm` and
hostname each, on a private bridge), one `torchrun --nnodes N --rdzv-backend c10d` agent per host, as users launch on
real machines; the internode engine's network stage goes over TCP between the hosts' veth addresses.

Needs root and namespaces: skipped with the reason otherwise. Slow (a torchrun start per test).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtdeepep.utils.hosts import Hosts, HostsUnavailable, check_available

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "hosts" / "host_worker.py"
PORT = 29411
TMP = "tmp"  # a launch's TMPDIR, under its report directory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def hosts_or_skip(num_hosts: int) -> Hosts:
    """`num_hosts` namespace hosts (the caller tears them down), or the test skipped with the reason this machine
    cannot make them (not root, no namespaces)."""
    try:
        check_available()
        return Hosts(num_hosts)
    except HostsUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture
def make_hosts():
    """`make_hosts(n)`: n namespace hosts, torn down after the test (skips when this machine cannot make them)."""
    made = []

    def make(num_hosts: int) -> Hosts:
        made.append(hosts_or_skip(num_hosts))
        return made[-1]

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()


@pytest.fixture
def hosts2(make_hosts):
    return make_hosts(2)


def torchrun(hosts: Hosts, index: int, ranks_per_host: int, args: list[str], report_dir: Path, timeout_s: float,
             delay_s: float = 0.0, *, script: Path = WORKER, nnodes: int | None = None, port: int = PORT,
             env: dict[str, str] | None = None) -> subprocess.Popen:  # fmt: skip
    """One agent of the run of `script` in host `index` (of `nnodes`, default every host), c10d rendezvous on host 0's
    address; its output in `report_dir/agent{index}.log`."""
    run_env = hosts.env(index)
    # TMPDIR: the run's temporary files (torchrun's log directories, which it keeps) in the test's own directory.
    run_env.update(PYTHONPATH=str(ROOT), REPORT_DIR=str(report_dir), MTDEEPEP_TIMEOUT_S=str(timeout_s),
                   OMP_NUM_THREADS="1", TMPDIR=str(report_dir / TMP), **(env or {}))  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes or len(hosts)}",
        f"--nproc-per-node={ranks_per_host}", "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts.hosts[0].address}:{port}",
        "--rdzv-id=mtdeepep-hosts", "--max-restarts=0", "--rdzv-conf=read_timeout=10", str(script), *args,
    ]  # fmt: skip
    if delay_s:
        cmd = ["sh", "-c", f'sleep {delay_s} && exec "$@"', "--", *cmd]
    (report_dir / TMP).mkdir(parents=True, exist_ok=True)
    log = open(report_dir / f"agent{index}.log", "w")  # noqa: SIM115 - closed with the process
    return hosts.run(index, cmd, env=run_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_all(procs: list[subprocess.Popen], report_dir: Path, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for i, proc in enumerate(procs):
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            logs = "\n".join((report_dir / f"agent{j}.log").read_text()[-3000:] for j in range(len(procs)))
            raise AssertionError(f"agent {i} still running after {timeout_s} s:\n{logs}") from None
    return codes


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def logs(report_dir: Path, num: int) -> str:
    return "\n".join(f"--- agent {j} ---\n" + (report_dir / f"agent{j}.log").read_text()[-4000:] for j in range(num))


LAYOUTS = {"2x2": (2, 2), "4x1": (4, 1)}  # hosts x ranks per host
CASES = [
    "normal:dispatch_matches_reference", "normal:combine_matches_reference", "normal:fp8_dispatch_passes_through",
    "normal:cached_dispatch_matches", "low_latency:dispatch_matches_upstream_checks",
    "low_latency:combine_matches_reference", "v2:elastic_dispatch_matches_reference",
]  # fmt: skip
LATE_S = 20  # the 4x1 run's last host starts this long after the others (the rendezvous waits for it)


@pytest.fixture(scope="module")
def conformance_runs(tmp_path_factory):
    """The conformance cases in both layouts, launched side by side (each on hosts of its own): the 2x2 run works
    while the 4x1 run waits for its late host. {layout: (report directory, exit codes, the root /dev/shm before)}."""
    made, procs, dirs = {}, {}, {}
    shm_before = set(os.listdir("/dev/shm"))
    try:
        for name, (num_hosts, ranks_per_host) in LAYOUTS.items():
            made[name] = hosts_or_skip(num_hosts)
            dirs[name] = tmp_path_factory.mktemp(f"conformance_{name}")
            delays = [0.0] * (num_hosts - 1) + [LATE_S if name == "4x1" else 0.0]
            procs[name] = [torchrun(made[name], i, ranks_per_host, CASES, dirs[name], 30, delay_s=delays[i])
                           for i in range(num_hosts)]  # fmt: skip
        codes = {name: wait_all(procs[name], dirs[name], 300) for name in LAYOUTS}
    finally:
        for hosts in made.values():
            hosts.close()
    return {name: (dirs[name], codes[name], shm_before) for name in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conformance_across_hosts(conformance_runs, layout):
    """Normal mode (BF16, FP8, cached), low latency and V2 on 2 hosts x 2 ranks and on 4 hosts x 1 rank (there the
    last host starts 20 s after the others: the rendezvous waits for it): right results; each host's segments are
    in its own /dev/shm only (the root namespace's gains none), and the rows crossed the hosts' network
    interfaces."""
    num_hosts, ranks_per_host = LAYOUTS[layout]
    tmp_path, codes, shm_before = conformance_runs[layout]
    assert codes == [0] * num_hosts, logs(tmp_path, num_hosts)
    world = num_hosts * ranks_per_host
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    by_host: dict[str, list[dict]] = {}
    for report in reports:
        by_host.setdefault(report["hostname"], []).append(report)
    assert sorted(by_host) == [f"host{i}" for i in range(num_hosts)], by_host
    assert all(len(v) == ranks_per_host for v in by_host.values()), by_host
    root_device = os.stat("/dev/shm").st_dev
    root_device = f"{os.major(root_device):02x}:{os.minor(root_device):02x}"
    devices = {host: {r["shm_device"] for r in ranks} for host, ranks in by_host.items()}
    assert all(len(d) == 1 for d in devices.values()), f"one /dev/shm per host: {devices}"
    assert len(set().union(*devices.values(), {root_device})) == num_hosts + 1, f"each host its own /dev/shm: {devices}"
    for host, ranks in by_host.items():
        for r in ranks:
            # The node stage maps segments, all on its own host's /dev/shm: none of another host's (or the root's).
            assert r["shm_mappings"], f"rank {r['rank']} on {host} mapped no /dev/shm segment"
            assert {dev for dev, _ in r["shm_mappings"]} == {r["shm_device"]}, (host, r["shm_mappings"], devices)
            # Its rows to the other hosts crossed its network interface.
            assert r["interface_bytes"] > 1_000_000, (host, r["interface_bytes"])
    # None of them in the machine's own /dev/shm (other programs may add their own there meanwhile).
    mapped = {Path(path.removesuffix(" (deleted)")).name for r in reports for _, path in r["shm_mappings"]}
    assert not mapped & (set(os.listdir("/dev/shm")) - shm_before), "a host's segment in the root /dev/shm"


@pytest.mark.parametrize("fault", ["link_down", "sigkill"])
def test_lost_host_is_named_and_nothing_hangs(hosts2, tmp_path, fault):
    """2 hosts x 2 ranks in a dispatch/combine loop (timeout 10 s); host 1 drops off the network (its link set down)
    or all its processes are SIGKILLed. The surviving ranks raise within the timeout (+ slack), naming the lost
    ranks, their host and the phase (a rank whose host peer raised first may be ended by torchrun instead); with
    the link down, host 1's own ranks raise too, saying they are cut off; every rank has exited and host 0's launch
    exits non-zero within timeout + 30 s."""
    timeout_s = 10
    procs = [torchrun(hosts2, i, 2, ["loop:150"], tmp_path, timeout_s) for i in range(2)]
    deadline = time.monotonic() + 150
    while len(list(tmp_path.glob("started-rank*.json"))) < 4:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(tmp_path, 2)
        time.sleep(0.2)
    started = dict(json.loads(f.read_text()) for f in tmp_path.glob("started-rank*.json"))
    lost = sorted(r for r, host in started.items() if host == "host1")
    survivors = sorted(r for r, host in started.items() if host == "host0")
    assert len(lost) == 2 and len(survivors) == 2, started
    time.sleep(1.0)  # in the middle of the loop
    cut = time.monotonic()
    if fault == "link_down":
        hosts2.set_link(1, up=False)
    else:
        hosts2.kill(1)
    # Host 0's launch ends; the cut-off host's ranks end too (below), but its torchrun agent (torch's code, not
    # mtdeepep's) then blocks on the rendezvous store it cannot reach: the fixture's teardown kills it.
    codes = wait_all(procs[:1], tmp_path, timeout_s + 30)
    elapsed = time.monotonic() - cut
    assert all(code != 0 for code in codes), (codes, logs(tmp_path, 2))
    assert elapsed < timeout_s + 30, elapsed
    # Each survivor raised, or was ended by its agent once its host peer raised (torchrun ends a failed run's
    # other local ranks): at least one raised, and every one that did names the lost ranks and host.
    raised = [r for r in survivors if (tmp_path / f"error-rank{r}.txt").exists()]
    assert raised, f"no surviving rank raised:\n{logs(tmp_path, 2)}"
    for r in raised:
        waited, message = (tmp_path / f"error-rank{r}.txt").read_text().split("\n", 1)
        assert float(waited) < 2 * timeout_s + 5, (r, waited, message)
        assert "host host1" in message and all(str(x) in message for x in lost), message
        assert "internode" in message and ("dispatch" in message or "combine" in message), message
    if fault == "link_down":
        while any("host_worker.py" in _cmdline(pid) and "torch.distributed.run" not in _cmdline(pid)
                  for pid in hosts2.pids(1)):  # fmt: skip
            assert time.monotonic() - cut < timeout_s + 30, "a cut-off rank is still running"
            time.sleep(0.5)
        cut_off = [r for r in lost if (tmp_path / f"error-rank{r}.txt").exists()]
        assert cut_off, f"no cut-off rank raised:\n{logs(tmp_path, 2)}"
        for r in cut_off:
            message = (tmp_path / f"error-rank{r}.txt").read_text().split("\n", 1)[1]
            assert "cut off" in message or "host host0" in message, message


def test_link_down_in_the_middle_of_a_combine(hosts2, tmp_path):
    """2 hosts x 2 ranks, one dispatch; host 0's ranks enter the combine and wait for host 1's, whose ranks hold
    before theirs; host 1's link goes down then. Host 0's ranks raise within their timeout (10 s) naming the lost
    ranks, their host and the combine; host 0's launch exits non-zero within timeout + 30 s; host 1's ranks, once
    they enter their combine, find themselves cut off and exit too."""
    timeout_s = 10
    procs = [torchrun(hosts2, i, 2, ["combine_cut:3"], tmp_path, timeout_s) for i in range(2)]
    deadline = time.monotonic() + 150
    while len(list(tmp_path.glob("held-rank*.json"))) < 2 or len(list(tmp_path.glob("started-rank*.json"))) < 4:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(tmp_path, 2)
        time.sleep(0.1)
    started = dict(json.loads(f.read_text()) for f in tmp_path.glob("started-rank*.json"))
    lost = sorted(json.loads(f.read_text())[0] for f in tmp_path.glob("held-rank*.json"))
    survivors = sorted(r for r, host in started.items() if host == "host0")
    assert lost == [2, 3] and survivors == [0, 1], started  # c10d ranks the agents by hostname
    time.sleep(0.5)  # host 0's ranks are inside their combine
    cut = time.monotonic()
    hosts2.set_link(1, up=False)
    codes = wait_all(procs[:1], tmp_path, timeout_s + 30)
    assert codes[0] != 0 and time.monotonic() - cut < timeout_s + 30, (codes, logs(tmp_path, 2))
    raised = [r for r in survivors if (tmp_path / f"error-rank{r}.txt").exists()]
    assert raised, f"no surviving rank raised:\n{logs(tmp_path, 2)}"
    for r in raised:
        waited, message = (tmp_path / f"error-rank{r}.txt").read_text().split("\n", 1)
        assert float(waited) < timeout_s + 5, (r, waited, message)
        assert "internode combine" in message and "host host1" in message, message
        assert re.search(r"ranks? 2, 3\b", message), message
    # Host 1's ranks enter their combine 3 s after the cut and raise, cut off; its torchrun agent then blocks on the
    # rendezvous store it cannot reach (torch's code): the fixture's teardown kills it.
    while any("host_worker.py" in _cmdline(pid) and "torch.distributed.run" not in _cmdline(pid)
              for pid in hosts2.pids(1)):  # fmt: skip
        assert time.monotonic() - cut < timeout_s + 30, "a cut-off rank is still running"
        time.sleep(0.5)
    for r in lost:
        message = (tmp_path / f"error-rank{r}.txt").read_text().split("\n", 1)[1]
        assert "cut off" in message or "host host0" in message, message


def test_internode_bench_across_hosts(hosts2, tmp_path):
    """bench/internode.py --torchrun on 2 hosts x 2 ranks at tiny shapes: mtdeepep's dispatch and combine and the
    all_to_all_single baseline in the same processes, the network stage over the hosts' veths; rank 0 prints the
    table with each op's ratio and writes the JSON: the baseline's results equal mtdeepep's, bytes left each host,
    and mtdeepep sends a token across once per node where the baseline sends it once per rank."""
    result = tmp_path / "internode.json"
    args = ["--torchrun", "--num-tokens", "64", "--hidden", "256", "--num-experts", "16", "--iters", "2", "--warmup",
            "0", "--timeout", "120", "--json", str(result)]  # fmt: skip
    bench = ROOT / "bench" / "internode.py"
    procs = [torchrun(hosts2, i, 2, args, tmp_path, 30, script=bench) for i in range(2)]
    assert wait_all(procs, tmp_path, 300) == [0, 0], logs(tmp_path, 2)
    text = (tmp_path / "agent0.log").read_text()
    assert "2 nodes x 2 ranks on separate hosts (torchrun)" in text and "gloo over eth0" in text, text
    for op in ("dispatch bf16", "dispatch fp8", "combine bf16"):
        assert re.search(rf"^{op} .* \d+\.\d\dx$", text, re.MULTILINE), (op, text)
    rows = json.loads(result.read_text())["rows"]
    assert [row["op"] for row in rows] == ["dispatch bf16", "dispatch fp8", "combine bf16"]
    for row in rows:
        assert row["speedup"] > 0 and row["mtdeepep"]["net_gbps"] > 0 and row["all-to-all"]["net_gbps"] > 0, row
        for counted in row["bytes_per_rank"]:
            assert 0 < counted["rdma_leaving_node"] <= counted["a2a_leaving_node"], counted
    assert "bit-exact" in text, text
