"""Separate hosts on one Linux machine, for multi-machine tests: each host is a network namespace (its own loopback
and one veth interface `eth0` with an address on a private /24), a mount namespace with its own tmpfs on `/dev/shm`
(no shared-memory segment crosses hosts) and a UTS namespace with its own hostname. The hosts' veths meet on a bridge
that lives in a namespace of its own, so the machine's own network, hostname and `/dev/shm` are never touched, and
the addresses exist only inside these namespaces.

A host is kept alive by a holder process (`sleep`) that owns its mount and UTS namespaces; `run` starts a command
inside all three (`nsenter`). `close` kills every process in the hosts' namespaces, then deletes the namespaces
(their links go with them; the tmpfs goes with the last process of its mount namespace).

    with Hosts(2) as hosts:
        procs = [hosts.run(i, ["torchrun", ...], env=hosts.env(i)) for i in range(2)]
        hosts.set_link(1, up=False)  # host 1 drops off the network

Needs root and namespace support: `Hosts(...)` raises `HostsUnavailable` saying what is missing (tests skip with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.77.0"  # the hosts' /24; exists only inside the namespaces made here
INTERFACE = "eth0"  # each host's network interface (GLOO_SOCKET_IFNAME)
_STATE_DIR = Path("/run/mtdeepep-hosts")  # the command line's record of the hosts it brought up


class HostsUnavailable(RuntimeError):
    """This machine cannot make namespace hosts (not root, no `ip`/`nsenter`, namespaces refused)."""


@dataclass(frozen=True)
class Host:
    index: int
    name: str  # hostname inside the host
    netns: str
    address: str
    holder_pid: int


def _sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=timeout)


def check_available() -> None:
    """Raises `HostsUnavailable` naming what is missing."""
    if os.geteuid() != 0:
        raise HostsUnavailable(f"namespace hosts need root (this process runs as uid {os.geteuid()})")
    missing = [tool for tool in ("ip", "unshare", "nsenter", "mount") if shutil.which(tool) is None]
    if missing:
        raise HostsUnavailable(f"namespace hosts need {', '.join(missing)} on PATH")


class Hosts:
    """`num_hosts` namespace hosts (see the module docstring); a context manager that always tears them down."""

    def __init__(self, num_hosts: int, *, tag: str | None = None, shm_mib: int = 4096) -> None:
        check_available()
        if not 1 <= num_hosts <= 200:
            raise ValueError(f"num_hosts must be in [1, 200], got {num_hosts}")
        self.tag = tag or f"mth{uuid.uuid4().hex[:6]}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: list[Host] = []
        self._hosts_file: Path | None = None
        self._procs: list[subprocess.Popen] = []
        try:
            self._up(num_hosts, shm_mib)
        except BaseException as error:
            self.close()
            if isinstance(error, subprocess.CalledProcessError):
                raise HostsUnavailable(
                    f"namespace hosts could not be made ({' '.join(error.cmd)}: {error.stderr.strip()})"
                ) from error
            raise

    def _up(self, num_hosts: int, shm_mib: int) -> None:
        # Every host resolves every host's name (torchrun's rendezvous does), through an /etc/hosts of their own,
        # bind-mounted in their mount namespaces.
        self._hosts_file = Path(tempfile.mkstemp(prefix=f"{self.tag}-", suffix=".hosts")[1])
        names = "".join(f"{SUBNET}.{i + 1} host{i}\n" for i in range(num_hosts))
        self._hosts_file.write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
        _sh("ip", "netns", "add", self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for i in range(num_hosts):
            netns, name, address = f"{self.tag}-h{i}", f"host{i}", f"{SUBNET}.{i + 1}"
            _sh("ip", "netns", "add", netns)
            # Created inside the host's namespace, its peer straight in the bridge's: nothing in the root namespace.
            _sh("ip", "-n", netns, "link", "add", INTERFACE, "type", "veth", "peer", "name", f"p{i}", "netns",
                self.bridge_ns)  # fmt: skip
            _sh("ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0", "up")
            _sh("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _sh("ip", "-n", netns, "link", "set", INTERFACE, "up")
            _sh("ip", "-n", netns, "link", "set", "lo", "up")
            # The holder: a private mount namespace with its own /dev/shm, and its own hostname.
            script = (
                f"mount -t tmpfs -o size={shm_mib}m,mode=1777 tmpfs /dev/shm && "
                f"mount --bind {self._hosts_file} /etc/hosts && "
                f"hostname {name} && echo ready && "
                "exec sleep infinity"
            )
            holder = subprocess.Popen(
                ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation", "private",
                 "sh", "-c", script],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            )  # fmt: skip
            self._procs.append(holder)
            line = holder.stdout.readline().strip()
            if line != "ready":
                holder.kill()
                _, err = holder.communicate(timeout=10)
                raise HostsUnavailable(f"host {i}: its mount/UTS namespace could not be made: {err.strip()}")
            self.hosts.append(Host(i, name, netns, address, holder.pid))

    # ---- use ----

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def env(self, index: int, base: dict | None = None) -> dict[str, str]:
        """An environment for host `index`: gloo on its interface, host 0's address as MASTER_ADDR."""
        env = dict(os.environ if base is None else base)
        env.update(GLOO_SOCKET_IFNAME=INTERFACE, MASTER_ADDR=self.hosts[0].address)
        return env

    def command(self, index: int, argv: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
        """`argv` wrapped to run inside host `index` (network, mount and UTS namespaces), in `cwd` (default: this
        process's working directory; entering a mount namespace would otherwise start it in `/`)."""
        wd = os.fspath(cwd) if cwd is not None else os.getcwd()
        return ["nsenter", "-t", str(self.hosts[index].holder_pid), "-n", "-m", "-u", f"--wd={wd}", "--", *argv]

    def run(self, index: int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Starts `argv` in host `index` (its own session, so that `close` can end its whole tree)."""
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(index, argv, popen_kwargs.get("cwd")), **popen_kwargs)
        self._procs.append(proc)
        return proc

    def set_link(self, index: int, up: bool) -> None:
        """Host `index`'s interface up or down (down: it is off the network, its processes keep running)."""
        _sh("ip", "-n", self.hosts[index].netns, "link", "set", INTERFACE, "up" if up else "down")

    def pids(self, index: int) -> list[int]:
        """Every process in host `index`'s network namespace (its holder included)."""
        out = _sh("ip", "netns", "pids", self.hosts[index].netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, *indices: int, timeout_s: float = 10.0) -> None:
        """SIGKILL every process of the hosts `indices` (none given: every host) but their holders: the hosts stay,
        their programs die. One sweep over all of them, as a crash of those machines would (no process gets to act on
        another's death), repeated until none is left (a process forked during a sweep dies in the next); raises
        `RuntimeError` naming the survivors after `timeout_s`."""
        indices = indices or tuple(range(len(self.hosts)))
        holders = {self.hosts[i].holder_pid for i in indices}
        deadline = time.monotonic() + timeout_s
        while alive := [(i, pid) for i in indices for pid in self.pids(i) if pid not in holders]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes still alive after SIGKILL: {alive} (host, pid)")
            for _, pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def close(self) -> None:
        """Kills every process in the hosts' namespaces and deletes the namespaces (idempotent)."""
        namespaces = [f"{self.tag}-h{i}" for i in range(len(self.hosts) + 1)] + [self.bridge_ns]
        listed = set(_sh("ip", "netns", "list", check=False).stdout.split())
        for netns in namespaces:
            if netns not in listed:
                continue
            for pid in _sh("ip", "netns", "pids", netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()
        for netns in namespaces:
            if netns in listed:
                _sh("ip", "netns", "del", netns, check=False)
        self.hosts = []
        if self._hosts_file is not None:
            self._hosts_file.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------------
# Command line: scripts/hosts.sh


def _state_file(tag: str) -> Path:
    return _STATE_DIR / f"{tag}.json"


def main(argv: list[str]) -> int:
    """`up N [TAG]` (prints TAG; the hosts stay until `down TAG`), `run TAG HOST -- CMD...` (inside host HOST, with
    GLOO_SOCKET_IFNAME and MASTER_ADDR set), `down TAG`, `link TAG HOST up|down`, `each N -- CMD...` (N hosts, CMD in
    each with HOST_INDEX set, then torn down; the worst exit status)."""
    usage = "usage: hosts.sh up N [TAG] | run TAG HOST -- CMD... | link TAG HOST up|down | down TAG | each N -- CMD..."
    if not argv:
        print(usage, file=sys.stderr)
        return 2
    try:
        action = argv[0]
        if action == "each":
            num, cmd = int(argv[1]), argv[argv.index("--") + 1 :]
            with Hosts(num) as hosts:
                procs = [hosts.run(i, cmd, env={**hosts.env(i), "HOST_INDEX": str(i)}) for i in range(num)]
                return max(proc.wait() for proc in procs)
        if action == "up":
            hosts = Hosts(int(argv[1]), tag=argv[2] if len(argv) > 2 else None)
            hosts._procs.clear()  # the holders outlive this command
            _STATE_DIR.mkdir(parents=True, exist_ok=True)
            _state_file(hosts.tag).write_text(json.dumps([h.__dict__ for h in hosts.hosts]))
            print(hosts.tag)
            return 0
        hosts = object.__new__(Hosts)
        hosts.tag, hosts._procs, hosts._hosts_file = argv[1], [], None
        hosts.bridge_ns = f"{hosts.tag}-br"
        state = _state_file(hosts.tag)
        hosts.hosts = [Host(**h) for h in json.loads(state.read_text())] if state.exists() else []
        if action == "down":
            hosts.close()
            state.unlink(missing_ok=True)
            return 0
        if action == "link":
            hosts.set_link(int(argv[2]), argv[3] == "up")
            return 0
        if action == "run":
            index, cmd = int(argv[2]), argv[argv.index("--") + 1 :]
            return subprocess.run(hosts.command(index, cmd), env=hosts.env(index)).returncode
    except HostsUnavailable as error:
        print(f"hosts.sh: {error}", file=sys.stderr)
        return 3
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
