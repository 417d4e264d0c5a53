"""The Triton executor's choice by device and its peer table, on the CPU (what runs on a GPU is run by
scripts/gpu_check.sh): the default executor per device type as torch reports it, `MTDEEPEP_ENGINE` overriding it, and
the table layout the kernels index."""

from __future__ import annotations

import functools
import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: as the other modules of tests/triton

import pytest  # noqa: E402
import torch  # noqa: E402

from mtdeepep import _C, engines  # noqa: E402
from mtdeepep.engines import default_engine_name, named_engine_class  # noqa: E402
from mtdeepep.engines.peer_table import IpcRegions, PeerTable, open_regions  # noqa: E402
from mtdeepep.kernels.intranode import ALIGNMENT, NormalLayout  # noqa: E402


def test_default_executor_per_device(monkeypatch):
    assert default_engine_name("cpu") == "cpu"
    # A GPU (CUDA, or ROCm which torch reports as "cuda", or MUSA) runs the Triton executor when Triton is there...
    assert default_engine_name("cuda") == "triton"
    assert default_engine_name("musa") == "triton"
    # ... and the CUDA executor when it is not.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    assert default_engine_name("cuda") == "cuda"


def test_triton_on_a_gpu_device_is_the_triton_engine_on_that_device(monkeypatch):
    from mtdeepep.engines.triton import TritonEngine

    chosen = named_engine_class("triton", "cuda")
    assert isinstance(chosen, functools.partial) and chosen.func is TritonEngine
    assert chosen.keywords == {"device": "cuda"}
    assert named_engine_class("triton", "musa").keywords == {"device": "musa"}  # a name: torch_musa makes the type
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert named_engine_class("triton", "cpu").keywords == {"device": "cpu"}


def test_create_engine_takes_the_default_for_the_reported_device(monkeypatch):
    """`create_engine` asks `default_engine_name` for the device the group reports (mocked as CUDA here: the chosen
    class is recorded, nothing is built)."""
    chosen = []

    class Stop(Exception):
        pass

    def record(name, device_type):
        chosen.append((name, device_type))
        raise Stop

    monkeypatch.setattr(engines, "engine_device", lambda group: torch.device("cuda", 0))
    monkeypatch.setattr(engines, "named_engine_class", record)
    monkeypatch.delenv("MTDEEPEP_ENGINE", raising=False)
    with pytest.raises(Stop):
        engines.create_engine(None, num_nvl_bytes=1, num_ll_bytes=0, low_latency=False, num_ranks_per_node=None,
                              timeout_s=1.0)  # fmt: skip
    monkeypatch.setenv("MTDEEPEP_ENGINE", "cuda")
    with pytest.raises(Stop):
        engines.create_engine(None, num_nvl_bytes=1, num_ll_bytes=0, low_latency=False, num_ranks_per_node=None,
                              timeout_s=1.0)  # fmt: skip
    assert chosen == [("triton", "cuda"), ("cuda", "cuda")]


def test_peer_table_layout():
    layout = NormalLayout.of(4)
    region_bytes = layout.control_bytes + 3 * ALIGNMENT + 100
    bases = [1 << 40, 2 << 40, 3 << 40, 4 << 40]
    ll = [5 << 40, 6 << 40, 7 << 40, 8 << 40]
    table = PeerTable.of(bases, ll, region_bytes, layout, torch.device("cpu"))
    # The control area: the region's last whole ALIGNMENT blocks that hold it; the data area before it.
    assert table.control_base == 3 * ALIGNMENT
    assert table.control_base + layout.control_bytes <= region_bytes
    assert table.regions.tolist() == bases and table.regions.dtype == torch.int64
    assert table.control.tolist() == [b + 3 * ALIGNMENT for b in bases]
    assert table.poison.tolist() == [b + 3 * ALIGNMENT + layout.poison for b in bases]
    assert table.low_latency.tolist() == ll
    assert PeerTable.of(bases, None, region_bytes, layout, torch.device("cpu")).low_latency is None
    with pytest.raises(ValueError, match="3 region addresses for 4 ranks"):
        PeerTable.of(bases[:3], None, region_bytes, layout, torch.device("cpu"))


def test_ipc_regions_refuse_devices_without_torch_ipc():
    with pytest.raises(_C.CommError, match="MTDEEPEP_ENGINE=cuda"):
        IpcRegions(0, 2, 1 << 20, 0, 1.0, torch.device("xpu"))
    with pytest.raises(_C.CommError, match="MTDEEPEP_ENGINE=cuda"):
        open_regions(0, 2, 1 << 20, 0, 1.0, torch.device("xpu"))
