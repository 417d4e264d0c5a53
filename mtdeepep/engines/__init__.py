"""The engines: the executors under the DeepEP facades, and the one place that chooses them.

- `base`: the seam (`Engine`), what an executor implements; `handles`: the dispatch identity a handle carries;
  `setup`: the bounded set-up exchange every engine goes through.
- `CpuEngine` (`cpu`): the ranks of one host through shared memory (the CPU executor).
- `TritonEngine` (`triton`): the Triton kernels of `mtdeepep.kernels` over a table of the peers' regions
  (`peer_table`): the default on GPUs (CUDA, ROCm, MUSA), and on CPU tensors under Triton's interpreter by name.
- `CudaEngine` (`cuda`): the ranks of one node through GPU buffers opened with CUDA IPC, with the hand-written CUDA
  kernels (the same sources built for MUSA), by name (`MTDEEPEP_ENGINE=cuda`).
- `InternodeEngine` (`internode`): several nodes; composes one node engine (any executor) with a network stage over
  torch.distributed. It never goes through a facade.

`create_engine` chooses the node engine once, from the device (`default_engine_name`) or `MTDEEPEP_ENGINE`, by name in
the registry below (`NODE_ENGINES`, `GPU_ENGINE_MODULES`, `NAMED_ENGINE_MODULES`). The modules form a layered
graph: `handles` <- `base` <- executors <- this registry; no executor imports the registry, so none needs a deferred
import (tests/test_import_layers.py checks it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import _C
from .base import Engine
from .cpu import CpuEngine
from .internode import InternodeEngine
from .setup import (
    SetupRendezvous,
    buffer_uid,
    check_nodes_share_hosts,
    group_key,
    group_ranks,
    resolve_num_ranks_per_node,
)

__all__ = [
    "ENGINE_NAMES",
    "GPU_ENGINE_MODULES",
    "NODE_ENGINES",
    "Engine",
    "create_engine",
    "default_engine_name",
    "engine_device",
    "engine_name",
    "node_engine_class",
]


# The registry: the node engine of each device type, the executor that moves rows between the ranks of one node.
# Adding an executor is one entry here and one module. The CPU executor is always built.
NODE_ENGINES: dict[str, Callable[..., Engine]] = {"cpu": CpuEngine}

# GPU executors: device type -> the module of this package that holds its engine, imported by name when a group
# first runs on such a device. Not at `import mtdeepep`: the module reads the GPU build's platform from the device's
# torch module (`torch.musa` exists only once torch_musa is imported, which a MUSA program does before its first
# group). One module serves CUDA and MUSA (the same sources built with MTDEEPEP_MUSA; torch_musa maps the names).
GPU_ENGINE_MODULES: dict[str, str] = {"cuda": f"{__name__}.cuda", "musa": f"{__name__}.cuda"}


# Executors chosen by name (`MTDEEPEP_ENGINE`), whatever the device: name -> the module of this package holding
# `TritonEngine`-like classes, imported on first use (the Triton executor imports Triton, which must see
# TRITON_INTERPRET before its import on a machine without a GPU).
NAMED_ENGINE_MODULES: dict[str, tuple[str, str]] = {"triton": (f"{__name__}.triton", "TritonEngine")}
ENGINE_NAMES = ("cpu", "cuda", "triton")


def engine_name() -> str | None:
    """The executor `MTDEEPEP_ENGINE` asks for (None: the device's default, `NODE_ENGINES`). ValueError, naming the
    choices, for an unknown name."""
    name = os.environ.get("MTDEEPEP_ENGINE", "").strip().lower()
    if not name:
        return None
    if name not in ENGINE_NAMES:
        raise ValueError(f"mtdeepep: MTDEEPEP_ENGINE must be one of {', '.join(ENGINE_NAMES)}, got {name!r}")
    return name


def default_engine_name(device_type: str) -> str:
    """The executor a group on `device_type` gets without `MTDEEPEP_ENGINE`: the CPU executor on CPU tensors; on a GPU
    (torch's `cuda` device, which ROCm builds report too, or `musa` with torch_musa) the Triton executor when Triton
    is installed, else the CUDA executor (its kernels are built from csrc/ when nvcc or MUSA's toolkit was there)."""
    if device_type == "cpu":
        return "cpu"
    return "triton" if importlib.util.find_spec("triton") is not None else "cuda"


def named_engine_class(name: str, device_type: str) -> Callable[..., Engine]:
    """The engine class of executor `name` for a group on `device_type`: the Triton executor on any device (on the
    CPU it needs TRITON_INTERPRET=1; on a GPU it runs on the process's current device), the CPU executor on CPU
    tensors only, the CUDA executor on GPUs only."""
    if name == "triton":
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                "mtdeepep: MTDEEPEP_ENGINE=triton on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
                "as well (Triton cannot compile for the CPU)"
            )
        module_name, class_name = NAMED_ENGINE_MODULES[name]
        engine_type = getattr(importlib.import_module(module_name), class_name)
        # The device type as a name: `torch.device("musa")` exists only once torch_musa is imported.
        return functools.partial(engine_type, device=device_type)
    if (name == "cpu") != (device_type == "cpu"):
        raise ValueError(f"mtdeepep: MTDEEPEP_ENGINE={name} cannot serve a group on {device_type} tensors")
    engine_type = node_engine_class(device_type)
    if engine_type is None:
        raise _C.CommError(f"mtdeepep: this build has no {device_type} executor (mtdeepep._C_cuda is missing)")
    return engine_type


def node_engine_class(device_type: str) -> Callable[..., Engine] | None:
    """The node engine registered for `device_type` (a GPU executor's module is loaded on first use), or None when
    this build has none (`mtdeepep._C_cuda` is missing)."""
    if device_type not in NODE_ENGINES and device_type in GPU_ENGINE_MODULES:
        module = importlib.import_module(GPU_ENGINE_MODULES[device_type])
        if module.built():
            NODE_ENGINES[device_type] = module.CudaEngine
    return NODE_ENGINES.get(device_type)


def engine_device(group: dist.ProcessGroup) -> torch.device:
    """The device whose executor serves `group`, chosen once at set-up:

    - `MTDEEPEP_DEVICE` (`cpu`, `cuda` or `musa`), when set: e.g. several processes sharing one GPU, whose control
      group is gloo (NCCL refuses two ranks on one GPU) while the data moves through CUDA IPC;
    - else the group's backend: NCCL means the ranks' tensors live on their current CUDA device, MCCL on their MUSA
      device (torch_musa); gloo (or anything else) means CPU tensors, the CPU executor.
    """
    choice = os.environ.get("MTDEEPEP_DEVICE", "").strip().lower()
    if not choice:
        backend = str(dist.get_backend(group)).lower()
        choice = "cuda" if "nccl" in backend else "musa" if "mccl" in backend else "cpu"
    if choice not in ("cpu", "cuda", "musa"):
        raise ValueError(f"mtdeepep: MTDEEPEP_DEVICE must be cpu, cuda or musa, got {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    module = getattr(torch, choice, None)
    if module is None or not module.is_available():
        raise _C.CommError(f"mtdeepep: the {choice} executor was chosen but no {choice} device is available")
    return torch.device(choice, module.current_device())


# How long a rank whose set-up met an error after the exchange (a peer's segment already gone) waits for that peer's
# published reason: the peer publishes before it releases anything, so it is there at once in practice.
_PEER_FAILURE_GRACE_S = 2.0


def create_engine(
    group: dist.ProcessGroup, *, num_nvl_bytes: int, num_ll_bytes: int, low_latency: bool,
    num_ranks_per_node: int | None, timeout_s: float, phase: str = "Buffer set-up",
) -> Engine:  # fmt: skip
    """Set-up (collective over `group`): the node engine for this device, the exchange of every rank's set-up string
    (bounded by `timeout_s`, naming the ranks that did not arrive), and, when the group spans several nodes, the
    internode engine over it. A rank whose set-up fails publishes why (`SetupRendezvous.fail`): its peers name it
    and its reason ("group rank 0 failed its set-up: ...") at once, instead of a timeout or of a symptom such as a
    segment that no longer exists; a rank whose process is gone is named with its pid at once."""
    device = engine_device(group)
    name = engine_name() or default_engine_name(device.type)
    node_engine_type = named_engine_class(name, device.type)
    if device.type != "cpu" and resolve_num_ranks_per_node(num_ranks_per_node, group.size()) < group.size():
        raise ValueError(
            f"mtdeepep: the {name} executor serves the ranks of one node; groups spanning several nodes "
            "run on CPU tensors only for now (the internode engine composes the CPU or the triton executor)"
        )
    num_ranks = group.size()
    per_node = resolve_num_ranks_per_node(num_ranks_per_node, num_ranks)
    node, local_rank = divmod(group.rank(), per_node)
    internode = per_node < num_ranks
    setup = SetupRendezvous(group, timeout_s, phase)  # first, on every rank, whatever fails next
    try:
        node_engine = node_engine_type(
            rank=local_rank, num_ranks=per_node, num_nvl_bytes=num_nvl_bytes,
            num_ll_bytes=num_ll_bytes if low_latency else 0, timeout_s=timeout_s,
        )  # fmt: skip
    except BaseException as error:
        setup.fail(error)
        raise
    try:
        entries = setup.exchange(f"{socket.gethostname()}\n{node_engine.setup_entry()}")
        check_nodes_share_hosts([e.split("\n", 1)[0] for e in entries], per_node)
        uid = buffer_uid(entries)
        node_entries = [e.split("\n", 1)[1] for e in entries[node * per_node : (node + 1) * per_node]]
        ranks = group_ranks(group)
        node_group = (ranks[node * per_node : (node + 1) * per_node], local_rank)
        # Several nodes: low-latency mode uses the collective transport, which the internode engine sets up.
        try:
            node_engine.connect(node_entries, uid, node_group if internode else group_key(group),
                                low_latency=low_latency and not internode)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - a peer's published failure or its exit explains it better
            culprit = setup.peer_failure(grace_s=_PEER_FAILURE_GRACE_S)
            if culprit is None:
                raise
            raise _C.CommError(f"{culprit} (here: {error})") from error
        if not internode:
            return node_engine
        return InternodeEngine(group, node_engine, per_node, timeout_s, uid, low_latency=low_latency)
    except BaseException as error:
        setup.fail(error)
        node_engine.destroy()
        raise
