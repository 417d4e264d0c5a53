"""`mtdeepep.utils.hosts` itself: refuses clearly without root; makes hosts with their own hostname, /dev/shm and
address, and leaves nothing behind (namespaces, processes, the hosts file)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from mtdeepep.utils import hosts as hosts_module
from mtdeepep.utils.hosts import Hosts, HostsUnavailable
from tests.hosts.test_hosts import hosts_or_skip


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HostsUnavailable, match="need root"):
        Hosts(2)


def test_hosts_are_separate_and_torn_down():
    hosts = hosts_or_skip(2)
    tag = hosts.tag
    try:
        with open("/dev/shm/mtdeepep-hosts-probe", "w"):
            pass
        seen = []
        for i in range(2):
            out = subprocess.run(hosts.command(i, ["sh", "-c", "hostname; ls /dev/shm; ip -4 -o addr show eth0"]),
                                 capture_output=True, text=True, check=True, timeout=30).stdout  # fmt: skip
            seen.append(out)
        assert seen[0].startswith("host0\n") and seen[1].startswith("host1\n"), seen
        assert all("mtdeepep-hosts-probe" not in out for out in seen), "a host sees the machine's /dev/shm"
        assert f"{hosts_module.SUBNET}.1/24" in seen[0] and f"{hosts_module.SUBNET}.2/24" in seen[1], seen
        assert socket.gethostname() not in ("host0", "host1")
    finally:
        os.unlink("/dev/shm/mtdeepep-hosts-probe")
        hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in listed, listed


def test_kill_ends_every_process_of_every_host_but_the_holders():
    """`kill()`: one sweep over every host ends their processes, also those in sessions of their own (as torchrun
    starts its ranks) and those a killed parent leaves behind; the hosts stay usable."""
    hosts = hosts_or_skip(2)
    try:
        # Each host: a shell in its own session that starts a child in another session of its own, then waits.
        procs = [hosts.run(i, ["sh", "-c", "setsid sleep 300 & sleep 300"]) for i in range(2)]
        deadline = time.monotonic() + 30
        for i in range(2):
            while len(hosts.pids(i)) < 4:  # holder, sh, its two sleeps
                assert time.monotonic() < deadline, hosts.pids(i)
                time.sleep(0.05)
        hosts.kill()
        assert [p.wait(timeout=30) for p in procs] == [-signal.SIGKILL] * 2
        for i in range(2):
            assert hosts.pids(i) == [hosts.hosts[i].holder_pid], hosts.pids(i)
        out = subprocess.run(hosts.command(1, ["hostname"]), capture_output=True, text=True, check=True, timeout=30)
        assert out.stdout.strip() == "host1"
    finally:
        hosts.close()
