"""One rank of a multi-host run, started by `torchrun --nnodes N --rdzv-backend c10d` inside a namespace host
(test_hosts.py): joins the group torchrun set up, runs the named conformance cases on the internode topology of
`LOCAL_WORLD_SIZE` ranks per host, and writes a JSON report to `$REPORT_DIR/rank{r}.json`: the hostname, the bytes
that crossed this host's network interface during the cases, its `/dev/shm`'s device and the /dev/shm files it has
mapped while the buffers live.

    python tests/hosts/host_worker.py CASE [CASE...]

CASE: normal:NAME | low_latency:NAME | v2:NAME | loop:SECONDS | combine_cut:SECONDS
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtdeepep.utils.hosts import INTERFACE  # noqa: E402
from mtdeepep.utils.testing import RankContext  # noqa: E402
from tests.clients import client_cases  # noqa: E402
from tests.conformance import low_latency_cases, normal_cases  # noqa: E402
from tests.conformance.topology import Topology  # noqa: E402


def _interface_bytes() -> int:
    stats = Path(f"/sys/class/net/{INTERFACE}/statistics")
    return sum(int((stats / name).read_text()) for name in ("tx_bytes", "rx_bytes")) if stats.exists() else -1


def _device_of(path: str) -> str:
    """`major:minor` of the filesystem holding `path`, as /proc/PID/maps writes it."""
    dev = os.stat(path).st_dev
    return f"{os.major(dev):02x}:{os.minor(dev):02x}"


def _shm_mappings() -> list[tuple[str, str]]:
    """(device, path) of this process's mappings of /dev/shm files (the segments are unlinked once mapped, so the
    directory lists none: the mappings, with their filesystem's device, say where they live)."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
            found.add((fields[3], fields[5]))
    return sorted(found)


def _loop(ctx: RankContext, topo: Topology, seconds: float) -> None:
    """Dispatch and combine for `seconds`, after writing `started-rank{r}.json` (rank, hostname); an error is written
    to `error-rank{r}.txt` with the seconds it took from the last successful step, and ends the process (exit 1)."""
    report_dir = Path(os.environ["REPORT_DIR"])
    buffer = topo.buffer(ctx, 16 << 20)
    x, topk_idx, topk_weights = normal_cases.make_inputs(ctx, 512, 1024, 16, 4, seed=7)
    (report_dir / f"started-rank{ctx.rank}.json").write_text(json.dumps([ctx.rank, socket.gethostname()]))
    end = time.monotonic() + seconds
    last = time.monotonic()
    try:
        while time.monotonic() < end:
            recv_x, _, recv_w, _, handle, _ = normal_cases.layout_and_dispatch(buffer, x, topk_idx, topk_weights, 16)
            buffer.combine(recv_x, handle, topk_weights=recv_w)
            last = time.monotonic()
    except Exception as error:  # noqa: BLE001 - reported to the test
        (report_dir / f"error-rank{ctx.rank}.txt").write_text(f"{time.monotonic() - last:.1f}\n{error}")
        os._exit(1)


def _combine_cut(ctx: RankContext, topo: Topology, hold_s: float) -> None:
    """One dispatch; then host0's ranks go straight into the combine and wait there for the others, while every
    other host's ranks write `held-rank{r}.json` and hold for `hold_s` before theirs: the fault test cuts a holding
    host off the network meanwhile, in the middle of host0's combine. An error is written to `error-rank{r}.txt`
    with the seconds since the rank entered the combine, and ends the process (exit 1)."""
    report_dir = Path(os.environ["REPORT_DIR"])
    buffer = topo.buffer(ctx, 16 << 20)
    x, topk_idx, topk_weights = normal_cases.make_inputs(ctx, 512, 1024, 16, 4, seed=7)
    recv_x, _, recv_w, _, handle, _ = normal_cases.layout_and_dispatch(buffer, x, topk_idx, topk_weights, 16)
    (report_dir / f"started-rank{ctx.rank}.json").write_text(json.dumps([ctx.rank, socket.gethostname()]))
    if socket.gethostname() != "host0":
        (report_dir / f"held-rank{ctx.rank}.json").write_text(json.dumps([ctx.rank, socket.gethostname()]))
        time.sleep(hold_s)
    entered = time.monotonic()
    try:
        buffer.combine(recv_x, handle, topk_weights=recv_w)
    except Exception as error:  # noqa: BLE001 - reported to the test
        (report_dir / f"error-rank{ctx.rank}.txt").write_text(f"{time.monotonic() - entered:.1f}\n{error}")
        os._exit(1)
    raise AssertionError(f"rank {ctx.rank}: the combine finished although a host was cut off")


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    # The group's own set-up gets its time under a loaded machine (the ranks start seconds apart); the buffers'
    # waits, what the fault tests time, are bounded by MTDEEPEP_TIMEOUT_S.
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = RankContext(rank, world, dist.group.WORLD)
    topo = Topology(world, ranks_per_node=int(os.environ["LOCAL_WORLD_SIZE"]))
    before = _interface_bytes()
    for name in names:
        kind, _, case = name.partition(":")
        if kind == "loop":  # dispatch + combine until an error (the fault tests cut a host off meanwhile)
            _loop(ctx, topo, float(case))
        elif kind == "combine_cut":  # host0 waits inside a combine while the test cuts another host off
            _combine_cut(ctx, topo, float(case))
        elif kind == "normal":
            getattr(normal_cases, case)(ctx, topo)
        elif kind == "low_latency":
            getattr(low_latency_cases, case)(ctx, topo)
        elif kind == "v2":
            getattr(client_cases, case)(ctx, topo.ranks_per_node)
        else:
            raise ValueError(f"unknown case {name!r}")
    report = {
        "rank": rank,
        "hostname": socket.gethostname(),
        "interface_bytes": _interface_bytes() - before,
        "shm_device": _device_of("/dev/shm"),
        "shm_mappings": _shm_mappings(),
    }
    Path(os.environ["REPORT_DIR"], f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    ctx.cache.clear()  # the buffers are released here, on every rank alike
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
