"""`mtdeepep.utils.hosts` itself: refuses clearly without root; makes hosts with their own hostname, /dev/shm and
address, and leaves nothing behind (namespaces, processes, the hosts file)."""

from __future__ import annotations

import os
import socket
import subprocess

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
