"""Device specifications for the planner: peak rates, memory, links, and where every figure comes from.

A `DeviceSpec` describes ONE device (a GPU, or for 'cpu' one rank process of this machine) and the links between
devices of a node and between nodes. Rates are peak figures from public datasheets; what a training step achieves
is lower, which the `*_efficiency` fields state (measured where this project measured it, estimates otherwise).
`SOURCES` below cites every figure; `ESTIMATED` lists the ones that are estimates rather than published or measured.

Units: TFLOP/s dense (no 2:4 sparsity), GB/s = 1e9 bytes/s per direction per device, memory in GiB (2**30 bytes).

The 'cpu' spec models this machine, where the "devices" are single-threaded rank processes sharing its
`shared_cores` cores (`shared_cores` > 0 marks such a spec): its rates are the whole machine's, a rank gets
`1 / max(world, cores)` of them (one core, or a turn at one when there are more ranks than cores), and `1 / world`
of the RAM. Single-threaded ranks because on this machine, shared with other work, one process running two intra-op
threads was measured up to 7x slower than two single-threaded processes (its threads wait for each other at every
parallel region). Its figures are measured here (`moe/trainer/plan/calibrate.py`; `--calibrate` measures them again).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# Dtype names of the rate table: the training dtypes of [training] dtype, and 'fp8' for the FP8 GEMMs.
RATE_DTYPES = ("float32", "bfloat16", "fp8")
# The collectives `DeviceSpec.collective_efficiency` may name.
COLLECTIVES = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One device and its links (see the module docstring for units).

    name: the `--device-spec` name. title: a human description.
    memory_gib: usable device memory per device (for 'cpu': the machine's RAM, shared by the ranks).
    tflops: peak dense GEMM TFLOP/s per dtype: 'float32' (plain FP32, as torch's default matmul runs it), 'bfloat16',
        and 'fp8' (E4M3 GEMMs; None: the device has no FP8 unit, FP8 layouts are rejected).
    memory_gbps: memory bandwidth, GB/s.
    intra_node_gbps / inter_node_gbps: per-device per-direction bandwidth to a peer inside a node (NVLink, MTLink,
        loopback for 'cpu') and across nodes (the device's NIC share).
    devices_per_node: how many devices share the fast intra-node links.
    gemm_efficiency: achieved / peak GEMM rate for training-sized GEMMs (per dtype as `tflops`; a missing dtype
        uses 'bfloat16''s). memory_efficiency: achieved / peak memory bandwidth. comm_efficiency: achieved / peak
        link bandwidth of a collective (bus bandwidth). comm_latency_us: fixed cost of one collective call.
    runtime_gib: memory a process holds before the model (CUDA/MUSA context, communication buffers, workspaces;
        for 'cpu' the Python + torch + trainer process baseline).
    allocator_overhead: fraction added to the dynamic memory (activations, transients) for allocator caching and
        fragmentation.
    shared_cores: 'cpu' only: the cores the single-threaded rank processes share (0 for a GPU).
    reduce_scatter_as_all_reduce: the backend implements reduce-scatter as an all-reduce (torch 2.13's gloo; see
        moe/trainer/train/zero.py), so it moves twice the bytes.
    ep_intra_node_gbps: the EP dispatch / combine bandwidth inside a node when it is not the collectives' link (on
        'cpu' mtdeepep copies through shared memory, not gloo); None: `intra_node_gbps`.
    all_gather_extra: memory the backend allocates inside an all-gather, per byte of its output (gloo copies it;
        NCCL / MCCL gather in place: 0).
    fresh_memory_gbps: the rate at which a rank touches newly mapped memory (page faults), for the large tensors
        a micro-batch allocates afresh (the allocator maps them and returns them to the system); None: free, as
        with the caching allocators of CUDA / MUSA. On 'cpu' a machine-wide rate that the ranks share.
    grouped_gemm_efficiency / grouped_gemm_half_rows: the routed experts' grouped GEMM (one small GEMM per local
        expert) reaches `grouped_gemm_efficiency * rows / (rows + grouped_gemm_half_rows)` of the peak, `rows` the
        rows one expert receives per micro-batch (a wave-quantisation ramp: half the asymptote at `half_rows`);
        None: the dense GEMMs' `gemm_efficiency`, no ramp.
    attention_efficiency: the fused causal attention's forward FLOP/s over the model dtype's peak (FLOPs counted
        causally, as moe/trainer/models/deepseek_v3/flops.py does); None: `gemm_efficiency` x
        timing.ATTENTION_EFFICIENCY.
    collective_efficiency: achieved / peak link bandwidth per collective ('all_to_all', 'all_reduce', 'all_gather',
        'reduce_scatter', 'p2p'), optionally per group size ('all_to_all@8'); a missing key: `comm_efficiency`.
    sources: field name -> where the figure comes from. estimated: the fields that are estimates.
    """

    name: str
    title: str
    memory_gib: float
    tflops: dict[str, float | None]
    memory_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    devices_per_node: int
    gemm_efficiency: dict[str, float]
    memory_efficiency: float
    comm_efficiency: float
    comm_latency_us: float
    runtime_gib: float
    allocator_overhead: float
    shared_cores: int = 0
    reduce_scatter_as_all_reduce: bool = False
    ep_intra_node_gbps: float | None = None
    all_gather_extra: float = 0.0
    fresh_memory_gbps: float | None = None
    grouped_gemm_efficiency: float | None = None
    grouped_gemm_half_rows: float = 0.0
    attention_efficiency: float | None = None
    collective_efficiency: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    estimated: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "estimated", frozenset(self.estimated))
        for name in ("memory_gib", "memory_gbps", "intra_node_gbps", "inter_node_gbps", "memory_efficiency",
                     "comm_efficiency"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"device spec {self.name!r}: {name} must be a positive number, got {value!r}")
        for name in ("comm_latency_us", "runtime_gib", "allocator_overhead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"device spec {self.name!r}: {name} must be a number >= 0, got {value!r}")
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int):
            raise ValueError(
                f"device spec {self.name!r}: devices_per_node must be an int, got {self.devices_per_node!r}"
            )
        if self.devices_per_node < 1 or self.shared_cores < 0:
            raise ValueError(f"device spec {self.name!r}: devices_per_node must be >= 1 and shared_cores >= 0")
        missing = [d for d in ("float32", "bfloat16") if not self.tflops.get(d)]
        if missing:
            raise ValueError(f"device spec {self.name!r}: tflops needs positive 'float32' and 'bfloat16' rates")
        unknown = sorted(set(self.tflops) - set(RATE_DTYPES)) + sorted(set(self.gemm_efficiency) - set(RATE_DTYPES))
        if unknown:
            raise ValueError(f"device spec {self.name!r}: unknown dtypes {unknown}; use {RATE_DTYPES}")
        for dtype, rate in self.tflops.items():
            if rate is not None and (not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0):
                raise ValueError(f"device spec {self.name!r}: tflops[{dtype!r}] must be positive or None, got {rate!r}")
        for dtype, eff in self.gemm_efficiency.items():
            if not isinstance(eff, (int, float)) or not 0 < eff <= 1:
                raise ValueError(
                    f"device spec {self.name!r}: gemm_efficiency[{dtype!r}] must be in (0, 1], got {eff!r}"
                )
        for name in ("memory_efficiency", "comm_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"device spec {self.name!r}: {name} must be in (0, 1]")
        if "bfloat16" not in self.gemm_efficiency:
            raise ValueError(f"device spec {self.name!r}: gemm_efficiency needs a 'bfloat16' entry")
        for name in ("grouped_gemm_efficiency", "attention_efficiency"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not 0 < value <= 1):
                raise ValueError(f"device spec {self.name!r}: {name} must be in (0, 1] or None, got {value!r}")
        half = self.grouped_gemm_half_rows
        if isinstance(half, bool) or not isinstance(half, (int, float)) or not math.isfinite(half) or half < 0:
            raise ValueError(f"device spec {self.name!r}: grouped_gemm_half_rows must be a number >= 0, got {half!r}")
        for key, eff in self.collective_efficiency.items():
            op, _, size = key.partition("@")
            if op not in COLLECTIVES or (size and not size.isdigit()):
                raise ValueError(
                    f"device spec {self.name!r}: collective_efficiency key {key!r} is not one of {COLLECTIVES} "
                    "(optionally '@<group size>')"
                )
            if not isinstance(eff, (int, float)) or not 0 < eff <= 1:
                raise ValueError(f"device spec {self.name!r}: collective_efficiency[{key!r}] must be in (0, 1]")

    # -- what one rank of a `world`-rank job gets

    def share(self, world: int) -> float:
        """The fraction of one device's compute and memory bandwidth a rank gets: 1 on a GPU; on 'cpu', whose rates
        are the whole machine's, `1 / max(world, cores)` (single-threaded ranks: one core each, taking turns when
        there are more ranks than cores)."""
        return 1.0 / max(world, self.shared_cores) if self.shared_cores else 1.0

    def has_fp8(self) -> bool:
        return self.tflops.get("fp8") is not None

    def gemm_flops(self, dtype: str, world: int) -> float:
        """Achieved GEMM FLOP/s of one rank for `dtype` ('float32', 'bfloat16', 'fp8')."""
        rate = self.tflops.get(dtype)
        if rate is None:
            raise ValueError(f"device {self.name!r} has no {dtype} GEMM rate")
        eff = self.gemm_efficiency.get(dtype, self.gemm_efficiency["bfloat16"])
        return rate * 1e12 * eff * self.share(world)

    def grouped_gemm_flops(self, dtype: str, world: int, rows: float) -> float:
        """Achieved FLOP/s of the routed experts' grouped GEMM in `dtype` when each expert receives `rows` rows."""
        if self.grouped_gemm_efficiency is None:
            return self.gemm_flops(dtype, world)
        rate = self.tflops.get(dtype)
        if rate is None:
            raise ValueError(f"device {self.name!r} has no {dtype} GEMM rate")
        ramp = rows / (rows + self.grouped_gemm_half_rows) if rows > 0 else 1.0
        return rate * 1e12 * self.grouped_gemm_efficiency * ramp * self.share(world)

    def attention_flops_per_s(self, dtype: str, world: int, fallback_efficiency: float) -> float:
        """Achieved forward FLOP/s of the fused causal attention (`fallback_efficiency` x the GEMM rate without an
        `attention_efficiency`)."""
        if self.attention_efficiency is None:
            return self.gemm_flops(dtype, world) * fallback_efficiency
        return self.tflops[dtype] * 1e12 * self.attention_efficiency * self.share(world)

    def fresh_bytes_per_s(self, world: int) -> float | None:
        """A rank's rate of touching fresh memory: a machine-wide rate split by the ranks on 'cpu' (two processes
        were measured to get half each: page faults do not scale with the cores here), the device's own on a GPU."""
        if self.fresh_memory_gbps is None:
            return None
        return self.fresh_memory_gbps * 1e9 / (world if self.shared_cores else 1)

    def memory_bytes_per_s(self, world: int) -> float:
        return self.memory_gbps * 1e9 * self.memory_efficiency * self.share(world)

    def memory_capacity_bytes(self, world: int) -> float:
        """Memory one rank may use: the device's, or on 'cpu' the machine's RAM divided by the ranks."""
        total = self.memory_gib * 2**30
        return total / world if self.shared_cores else total

    def link_bytes_per_s(
        self, intra_node: bool, *, expert_parallel: bool = False, op: str | None = None, group: int | None = None
    ) -> float:
        """Achieved bytes/s of one rank's link for collective `op` over `group` ranks (`collective_efficiency`)."""
        gbps = self.intra_node_gbps if intra_node else self.inter_node_gbps
        if expert_parallel and intra_node and self.ep_intra_node_gbps is not None:
            gbps = self.ep_intra_node_gbps
        return gbps * 1e9 * self.collective_efficiency_of(op, group)

    def collective_efficiency_of(self, op: str | None, group: int | None) -> float:
        if op is None:
            return self.comm_efficiency
        for key in (f"{op}@{group}", op):
            if key in self.collective_efficiency:
                return self.collective_efficiency[key]
        return self.comm_efficiency

    def replace(self, **changes) -> DeviceSpec:
        """A copy with `changes` (e.g. calibrated figures); their sources should be given in `sources` too."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["estimated"] = sorted(self.estimated)
        return d


# ---------------------------------------------------------------------------------------------------------------
# The built-in specs. Every figure has its source; estimates are listed in `estimated`.

_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column), nvidia.com/en-us/data-center/h100"
_NVIDIA_H200 = (
    "NVIDIA H200 Tensor Core GPU product page / datasheet (H200 SXM column), nvidia.com/en-us/data-center/h200"
)
_DGX_H100 = "NVIDIA DGX H100 datasheet: 8 GPUs, 8x ConnectX-7 400 Gb/s (= 50 GB/s per GPU per direction)"
_DGX_H200 = "NVIDIA DGX H200 datasheet: 8 GPUs, 8x ConnectX-7 400 Gb/s (= 50 GB/s per GPU per direction)"
_H100_MEASURED = (
    "measured by this project on a lent H100 (trainer_notes.md): 8192^3 BF16 matmul ~798 of 989 TFLOP/s; "
    "device-to-device copy ~3.0 of 3.35 TB/s"
)
_S4000 = "Moore Threads MTT S4000 launch, Dec 2023 (as reported by Tom's Hardware, TechPowerUp, tweakpc.de)"
_S5000 = "Moore Threads MTT S5000 announcement (as reported by ldeepai.com)"
_GPU_ESTIMATES = {
    "gemm_efficiency.fp8": "estimate: 0.70 (DeepGEMM reports ~1500 FP8 TFLOP/s on H800 for large GEMMs, ~0.76)",
    "comm_efficiency": "estimate: 0.80 of the link peak as collective bus bandwidth (NCCL-tests typical)",
    "comm_latency_us": "estimate: ~10 us per collective call (launch + synchronisation)",
    "runtime_gib": "estimate: CUDA context, NCCL and DeepEP buffers, cuBLAS workspaces (~3 GiB)",
    "allocator_overhead": "estimate: 10% of the dynamic memory for caching-allocator fragmentation",
}

H100 = DeviceSpec(
    name="h100",
    title="NVIDIA H100 SXM5 80GB (8 per node, NVLink 4 + 400 Gb/s InfiniBand)",
    memory_gib=80 * 1e9 / 2**30,
    tflops={"float32": 67.0, "bfloat16": 989.0, "fp8": 1979.0},
    memory_gbps=3350.0,
    intra_node_gbps=450.0,
    inter_node_gbps=50.0,
    devices_per_node=8,
    gemm_efficiency={"float32": 0.80, "bfloat16": 0.807, "fp8": 0.70},
    memory_efficiency=0.90,
    comm_efficiency=0.80,
    comm_latency_us=10.0,
    runtime_gib=3.0,
    allocator_overhead=0.10,
    sources={
        "memory_gib": _NVIDIA_H100 + ": 80 GB HBM3 (taken as 80e9 bytes)",
        "tflops.float32": _NVIDIA_H100 + ": FP32 67 TFLOPS (non-tensor; torch's default FP32 matmul, no TF32)",
        "tflops.bfloat16": _NVIDIA_H100 + ": BF16 Tensor Core 1,979 TFLOPS with sparsity = 989 dense",
        "tflops.fp8": _NVIDIA_H100 + ": FP8 Tensor Core 3,958 TFLOPS with sparsity = 1,979 dense",
        "memory_gbps": _NVIDIA_H100 + ": 3.35 TB/s",
        "intra_node_gbps": _NVIDIA_H100 + ": NVLink 900 GB/s (both directions) = 450 per direction",
        "inter_node_gbps": _DGX_H100,
        "devices_per_node": _DGX_H100,
        "gemm_efficiency.bfloat16": _H100_MEASURED,
        "gemm_efficiency.float32": "estimate: 0.80 (as BF16)",
        "memory_efficiency": _H100_MEASURED,
        **_GPU_ESTIMATES,
    },
    estimated={
        "gemm_efficiency.float32",
        "gemm_efficiency.fp8",
        "comm_efficiency",
        "comm_latency_us",
        "runtime_gib",
        "allocator_overhead",
    },  # fmt: skip
)

H200 = H100.replace(
    name="h200",
    title="NVIDIA H200 SXM 141GB (8 per node, NVLink 4 + 400 Gb/s InfiniBand)",
    memory_gib=141 * 1e9 / 2**30,
    memory_gbps=4800.0,
    sources={
        **H100.sources,
        "memory_gib": _NVIDIA_H200 + ": 141 GB HBM3e (taken as 141e9 bytes)",
        "tflops.float32": _NVIDIA_H200 + ": FP32 67 TFLOPS",
        "tflops.bfloat16": _NVIDIA_H200 + ": BF16 1,979 TFLOPS with sparsity = 989 dense (same compute as H100)",
        "tflops.fp8": _NVIDIA_H200 + ": FP8 3,958 TFLOPS with sparsity = 1,979 dense",
        "memory_gbps": _NVIDIA_H200 + ": 4.8 TB/s",
        "intra_node_gbps": _NVIDIA_H200 + ": NVLink 900 GB/s (both directions) = 450 per direction",
        "inter_node_gbps": _DGX_H200,
        "devices_per_node": _DGX_H200,
        "gemm_efficiency.bfloat16": "estimate: the H100's measured 0.807 (same SMs and clocks)",
        "memory_efficiency": "estimate: the H100's measured 0.90",
    },
    estimated=H100.estimated | {"gemm_efficiency.bfloat16", "memory_efficiency"},
)

# The public SimuMax repository (MooreThreads/SimuMax, commit 4dcaae513ba7) publishes measurements of its B200 and
# A100-PCIe machines in configs/system/*.json: GEMM, grouped-GEMM and attention efficiencies per shape and NCCL
# collective efficiencies per group size. The figures below cite them (read as data; summarised, not copied).
_SIMUMAX = "SimuMax (MooreThreads/SimuMax@4dcaae513ba7)"
_SIMUMAX_B200 = _SIMUMAX + " configs/system/b200_bf16_ceperm.json, measured on their 8x B200 node"
_SIMUMAX_A100 = _SIMUMAX + " configs/system/a100_pcie.json, measured on their 8x A100-PCIe node"
_NVIDIA_B200 = (
    "NVIDIA DGX B200 / HGX B200 datasheet (8 GPUs: FP16/BF16 36 PFLOPS, FP8 72 PFLOPS, FP32 600 TFLOPS with "
    "sparsity where it applies; 1,440 GB HBM3e, 64 TB/s; NVLink 5 1.8 TB/s per GPU; 8x ConnectX-7 400 Gb/s)"
)
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe column), nvidia.com/en-us/data-center/a100"
_DEEPSEEK_V3_REPORT = "DeepSeek-V3 technical report (arXiv 2412.19437), section 3.2.2: H800 nodes"
_CAUSAL_NOTE = (
    "(SimuMax counts attention FLOPs without the causal half: its A100 figures exceed 1; halved here, as "
    "moe/trainer/models/deepseek_v3/flops.py counts causally)"
)

B200 = DeviceSpec(
    name="b200",
    title="NVIDIA B200 SXM 180GB (8 per HGX node, NVLink 5 + 400 Gb/s InfiniBand)",
    memory_gib=180 * 1e9 / 2**30,
    tflops={"float32": 75.0, "bfloat16": 2250.0, "fp8": 4500.0},
    memory_gbps=8000.0,
    intra_node_gbps=900.0,
    inter_node_gbps=50.0,
    devices_per_node=8,
    gemm_efficiency={"float32": 0.47, "bfloat16": 0.47, "fp8": 0.47},
    memory_efficiency=0.666,
    comm_efficiency=0.67,
    comm_latency_us=25.0,
    runtime_gib=3.0,
    allocator_overhead=0.10,
    grouped_gemm_efficiency=0.489,
    grouped_gemm_half_rows=352.0,
    attention_efficiency=0.415,
    collective_efficiency={"all_to_all": 0.597, "all_reduce": 0.742, "all_gather": 0.674, "reduce_scatter": 0.673},
    sources={
        "memory_gib": _NVIDIA_B200 + ": 1,440 GB / 8 = 180 GB per GPU (taken as 180e9 bytes)",
        "tflops.float32": _NVIDIA_B200 + ": 600 TFLOPS / 8",
        "tflops.bfloat16": _NVIDIA_B200 + ": 36 PFLOPS with sparsity / 8 / 2 = 2,250 dense",
        "tflops.fp8": _NVIDIA_B200 + ": 72 PFLOPS with sparsity / 8 / 2 = 4,500 dense",
        "memory_gbps": _NVIDIA_B200 + ": 64 TB/s / 8 = 8 TB/s",
        "intra_node_gbps": _NVIDIA_B200 + ": 1.8 TB/s both directions = 900 per direction",
        "inter_node_gbps": _NVIDIA_B200 + ": one 400 Gb/s ConnectX-7 per GPU = 50 GB/s",
        "devices_per_node": _NVIDIA_B200,
        "gemm_efficiency.bfloat16": _SIMUMAX_B200 + ": BF16 matmuls (forward, data and weight gradients) of 4K "
        "tokens with one dimension the DeepSeek hidden size, FLOP-weighted: 0.476 (5120), 0.464 (7168); 0.488 over "
        "all its shapes",
        "gemm_efficiency.float32": "estimate: as BF16",
        "gemm_efficiency.fp8": "estimate: as BF16 (SimuMax publishes no B200 FP8 measurement)",
        "memory_efficiency": _SIMUMAX_B200 + ": memory-bound kernels at 0.666 of 8 TB/s",
        "comm_efficiency": _SIMUMAX_B200 + ": NCCL all-gather / reduce-scatter bus bandwidth ~0.67 of 900 GB/s",
        "comm_latency_us": _SIMUMAX_B200 + ": fixed NCCL costs of 5-25 us per call",
        "runtime_gib": _GPU_ESTIMATES["runtime_gib"],
        "allocator_overhead": _GPU_ESTIMATES["allocator_overhead"],
        "grouped_gemm_efficiency": _SIMUMAX_B200 + ": BF16 grouped GEMMs of 20-256 experts x 128-9832 rows, FP32 "
        "main grads (forward, data and weight gradients, harmonic mean: their times add): 0.13 at 128 rows, 0.30 at "
        "512-616, 0.36-0.39 at 1024-1232, 0.45 at 2460-9832; least-squares fit of eff * rows / (rows + half_rows): "
        "eff 0.489",
        "grouped_gemm_half_rows": "the same fit: half_rows 352",
        "attention_efficiency": _SIMUMAX_B200 + ": flash attention forward at 0.83 of 2,250 for 128 MLA heads "
        "(qk 192, v 128, 4K tokens) " + _CAUSAL_NOTE,
        "collective_efficiency.all_to_all": _SIMUMAX_B200 + ": NCCL all-to-all 0.597 of 900 GB/s",
        "collective_efficiency.all_reduce": _SIMUMAX_B200 + ": NCCL all-reduce bus bandwidth 0.742 of 900 GB/s",
        "collective_efficiency.all_gather": _SIMUMAX_B200 + ": NCCL all-gather 0.674 of 900 GB/s",
        "collective_efficiency.reduce_scatter": _SIMUMAX_B200 + ": NCCL reduce-scatter 0.673 of 900 GB/s",
    },
    estimated={"gemm_efficiency.float32", "gemm_efficiency.fp8", "runtime_gib", "allocator_overhead"},
)

H800 = H100.replace(
    name="h800",
    title="NVIDIA H800 SXM5 80GB (8 per node, NVLink 4 at 400 GB/s + 400 Gb/s InfiniBand)",
    intra_node_gbps=200.0,
    sources={
        **H100.sources,
        "tflops.float32": "as the H100 SXM (the H800 is the H100 SXM with a narrower NVLink): " + _NVIDIA_H100,
        "tflops.bfloat16": "as the H100 SXM: 989 dense BF16 TFLOPS",
        "tflops.fp8": "as the H100 SXM: 1,979 dense FP8 TFLOPS",
        "memory_gbps": "as the H100 SXM: 3.35 TB/s",
        "intra_node_gbps": "NVIDIA H800 SXM5 product brief: NVLink 400 GB/s both directions = 200 per direction; "
        + _DEEPSEEK_V3_REPORT
        + " reach ~160 GB/s over NVLink",
        "inter_node_gbps": _DEEPSEEK_V3_REPORT + ": one 400 Gb/s InfiniBand NIC per GPU (50 GB/s)",
        "devices_per_node": _DEEPSEEK_V3_REPORT + ": 8 GPUs per node",
        "gemm_efficiency.bfloat16": "estimate: the H100's measured 0.807 (same SMs and clocks)",
        "memory_efficiency": "estimate: the H100's measured 0.90",
    },
    estimated=H100.estimated | {"gemm_efficiency.bfloat16", "memory_efficiency"},
)

A100_PCIE = DeviceSpec(
    name="a100-pcie",
    title="NVIDIA A100 80GB PCIe (8 per node over PCIe Gen4, no NVLink; 200 Gb/s network)",
    memory_gib=80 * 1e9 / 2**30,
    tflops={"float32": 19.5, "bfloat16": 312.0, "fp8": None},
    memory_gbps=1935.0,
    intra_node_gbps=32.0,
    inter_node_gbps=25.0,
    devices_per_node=8,
    gemm_efficiency={"float32": 0.74, "bfloat16": 0.74},
    memory_efficiency=0.75,
    comm_efficiency=0.64,
    comm_latency_us=20.0,
    runtime_gib=3.0,
    allocator_overhead=0.10,
    grouped_gemm_efficiency=0.739,
    grouped_gemm_half_rows=144.0,
    attention_efficiency=0.537,
    collective_efficiency={
        "all_to_all@8": 0.258,
        "all_to_all": 0.60,
        "all_reduce@8": 0.392,
        "all_reduce": 0.65,
        "all_gather@8": 0.422,
        "all_gather": 0.648,
        "reduce_scatter@8": 0.346,
        "reduce_scatter": 0.642,
        "p2p": 0.47,
    },  # fmt: skip
    sources={
        "memory_gib": _NVIDIA_A100 + ": 80 GB HBM2e (taken as 80e9 bytes)",
        "tflops.float32": _NVIDIA_A100 + ": FP32 19.5 TFLOPS",
        "tflops.bfloat16": _NVIDIA_A100 + ": BF16 Tensor Core 624 TFLOPS with sparsity = 312 dense",
        "tflops.fp8": _NVIDIA_A100 + ": no FP8 (Ampere): FP8 layouts rejected",
        "memory_gbps": _NVIDIA_A100 + ": 1,935 GB/s",
        "intra_node_gbps": _NVIDIA_A100 + ": PCIe Gen4 64 GB/s both directions = 32 per direction (no NVLink "
        "bridges in " + _SIMUMAX_A100 + ")",
        "inter_node_gbps": _SIMUMAX_A100 + ": 25 GB/s inter-node",
        "devices_per_node": _SIMUMAX_A100,
        "gemm_efficiency.bfloat16": _SIMUMAX_A100 + ": BF16 matmuls (forward, data and weight gradients) of 4K "
        "tokens with one dimension the DeepSeek hidden size, FLOP-weighted: 0.741 (5120), 0.738 (7168)",
        "gemm_efficiency.float32": "estimate: as BF16",
        "memory_efficiency": _SIMUMAX_A100 + ": 0.91 of 1,600 GB/s = 1,456 GB/s, 0.75 of the datasheet's 1,935",
        "comm_efficiency": _SIMUMAX_A100 + ": NCCL collectives over 2-4 GPUs at ~0.69 of 30 GB/s = 0.64 of 32",
        "comm_latency_us": _SIMUMAX_A100 + ": 4-30 us per NCCL call",
        "runtime_gib": _GPU_ESTIMATES["runtime_gib"],
        "allocator_overhead": _GPU_ESTIMATES["allocator_overhead"],
        "grouped_gemm_efficiency": _SIMUMAX_A100 + ": BF16 grouped GEMMs of 20 and 40 experts (1232 and 616 rows; "
        "forward, data and weight gradients, harmonic mean: 0.662 and 0.599); eff * rows / (rows + half_rows) "
        "through both: eff 0.739",
        "grouped_gemm_half_rows": "the same fit: half_rows 144",
        "attention_efficiency": _SIMUMAX_A100
        + ": flash attention forward at 1.073 of 312 for 128 MLA heads "
        + _CAUSAL_NOTE,
        "collective_efficiency.all_to_all@8": _SIMUMAX_A100 + ": NCCL all-to-all over 8 GPUs 0.2754 x 30 GB/s "
        "(8.3 GB/s) = 0.258 of 32",
        "collective_efficiency.all_to_all": _SIMUMAX_A100 + ": over 2-4 GPUs 0.638-0.697 x 30 GB/s = ~0.60 of 32",
        "collective_efficiency.all_reduce@8": _SIMUMAX_A100 + ": 0.4176 x 30 GB/s = 0.392 of 32",
        "collective_efficiency.all_reduce": _SIMUMAX_A100 + ": over 2-4 GPUs ~0.69 x 30 GB/s = 0.65 of 32",
        "collective_efficiency.all_gather@8": _SIMUMAX_A100 + ": 0.4497 x 30 GB/s = 0.422 of 32",
        "collective_efficiency.all_gather": _SIMUMAX_A100 + ": over 2-4 GPUs ~0.69 x 30 GB/s = 0.648 of 32",
        "collective_efficiency.reduce_scatter@8": _SIMUMAX_A100 + ": 0.3688 x 30 GB/s = 0.346 of 32",
        "collective_efficiency.reduce_scatter": _SIMUMAX_A100 + ": over 2-4 GPUs ~0.68 x 30 GB/s = 0.642 of 32",
        "collective_efficiency.p2p": _SIMUMAX_A100 + ": PCIe link efficiency 0.5 x 30 GB/s = 0.47 of 32",
    },
    estimated={"gemm_efficiency.float32", "runtime_gib", "allocator_overhead"},
)

MTT_S4000 = DeviceSpec(
    name="mtt-s4000",
    title="Moore Threads MTT S4000 48GB (MUSA, 8 per KUAE node, MTLink 1.0)",
    memory_gib=48 * 1e9 / 2**30,
    tflops={"float32": 25.0, "bfloat16": 100.0, "fp8": None},
    memory_gbps=768.0,
    intra_node_gbps=120.0,
    inter_node_gbps=25.0,
    devices_per_node=8,
    gemm_efficiency={"float32": 0.70, "bfloat16": 0.70},
    memory_efficiency=0.85,
    comm_efficiency=0.80,
    comm_latency_us=15.0,
    runtime_gib=3.0,
    allocator_overhead=0.10,
    sources={
        "memory_gib": _S4000 + ": 48 GB GDDR6 (taken as 48e9 bytes)",
        "tflops.float32": _S4000 + ": FP32 25 TFLOPS",
        "tflops.bfloat16": _S4000 + ": FP16/BF16 100 TFLOPS (INT8 200 TOPS)",
        "tflops.fp8": _S4000 + ": no FP8 rate (FP8 units arrive with the S5000): FP8 layouts rejected",
        "memory_gbps": _S4000 + ": 768 GB/s (384-bit GDDR6)",
        "intra_node_gbps": "estimate: MTLink 1.0 card-to-card bandwidth is not in the sources above; 240 GB/s "
        "(both directions) is the commonly quoted figure -> 120 per direction",
        "inter_node_gbps": "estimate: one 200 Gb/s NIC per card (25 GB/s); KUAE's network is not published",
        "devices_per_node": _S4000 + ": KUAE MCCX D800 servers hold 8 cards",
        "gemm_efficiency.float32": "estimate: 0.70",
        "gemm_efficiency.bfloat16": "estimate: 0.70 (no public GEMM benchmark)",
        "memory_efficiency": "estimate: 0.85",
        "comm_efficiency": _GPU_ESTIMATES["comm_efficiency"],
        "comm_latency_us": "estimate: ~15 us per collective call",
        "runtime_gib": "estimate: MUSA context, MCCL and mtdeepep buffers (~3 GiB)",
        "allocator_overhead": _GPU_ESTIMATES["allocator_overhead"],
    },
    estimated={
        "intra_node_gbps",
        "inter_node_gbps",
        "gemm_efficiency.float32",
        "gemm_efficiency.bfloat16",
        "memory_efficiency",
        "comm_efficiency",
        "comm_latency_us",
        "runtime_gib",
        "allocator_overhead",
    },  # fmt: skip
)

MTT_S5000 = DeviceSpec(
    name="mtt-s5000",
    title="Moore Threads MTT S5000 80GB (MUSA 4th generation, native FP8)",
    memory_gib=80 * 1e9 / 2**30,
    tflops={"float32": 62.5, "bfloat16": 500.0, "fp8": 1000.0},
    memory_gbps=1600.0,
    intra_node_gbps=392.0,
    inter_node_gbps=50.0,
    devices_per_node=8,
    gemm_efficiency={"float32": 0.70, "bfloat16": 0.70, "fp8": 0.65},
    memory_efficiency=0.85,
    comm_efficiency=0.80,
    comm_latency_us=10.0,
    runtime_gib=3.0,
    allocator_overhead=0.10,
    sources={
        "memory_gib": _S5000 + ": 80 GB (taken as 80e9 bytes)",
        "tflops.fp8": _S5000 + ": 1000 TFLOPS per card with native FP8, taken as the dense FP8 rate",
        "tflops.bfloat16": "estimate: half the FP8 rate (as on H100), not published in the sources above",
        "tflops.float32": "estimate: an eighth of BF16 (H100's FP32/BF16 ratio is ~1/15; S4000's 1/4)",
        "memory_gbps": _S5000 + ": 1.6 TB/s",
        "intra_node_gbps": _S5000 + ": 784 GB/s inter-card, taken as both directions -> 392 per direction",
        "inter_node_gbps": "estimate: one 400 Gb/s NIC per card (50 GB/s)",
        "devices_per_node": "estimate: 8 cards per server, as KUAE S4000 servers",
        "gemm_efficiency.fp8": "estimate: 0.65 (Moore Threads report ~60% MFU for dense training on S5000 clusters)",
        "gemm_efficiency.bfloat16": "estimate: 0.70",
        "gemm_efficiency.float32": "estimate: 0.70",
        "memory_efficiency": "estimate: 0.85",
        "comm_efficiency": _GPU_ESTIMATES["comm_efficiency"],
        "comm_latency_us": _GPU_ESTIMATES["comm_latency_us"],
        "runtime_gib": "estimate: MUSA context, MCCL and mtdeepep buffers (~3 GiB)",
        "allocator_overhead": _GPU_ESTIMATES["allocator_overhead"],
    },
    estimated={
        "tflops.bfloat16",
        "tflops.float32",
        "intra_node_gbps",
        "inter_node_gbps",
        "devices_per_node",
        "gemm_efficiency.fp8",
        "gemm_efficiency.bfloat16",
        "gemm_efficiency.float32",
        "memory_efficiency",
        "comm_efficiency",
        "comm_latency_us",
        "runtime_gib",
        "allocator_overhead",
    },  # fmt: skip
)

# This machine (2 cores, 24 GiB), measured with moe/trainer/plan/calibrate.py on an otherwise busy machine (other agents
# share the cores): the figures are what a rank saw, not the cores' peak. `--calibrate` measures them again.
_CPU_MEASURED = "measured here by moe/trainer/plan/calibrate.py (2 cores shared with other work)"
CPU = DeviceSpec(
    name="cpu",
    title="this machine's CPU: rank processes sharing its cores (gloo over loopback)",
    memory_gib=24.0,
    tflops={"float32": 0.12, "bfloat16": 0.28, "fp8": 0.05},
    memory_gbps=27.0,
    intra_node_gbps=0.9,
    inter_node_gbps=0.9,
    devices_per_node=1024,
    gemm_efficiency={"float32": 1.0, "bfloat16": 1.0, "fp8": 1.0},
    memory_efficiency=1.0,
    comm_efficiency=1.0,
    comm_latency_us=180.0,
    runtime_gib=0.33,
    allocator_overhead=0.30,
    shared_cores=2,
    reduce_scatter_as_all_reduce=True,
    ep_intra_node_gbps=6.7,
    all_gather_extra=0.9,
    fresh_memory_gbps=1.4,
    sources={
        "memory_gib": "this machine's RAM (24 GiB), shared by the ranks",
        "tflops.float32": _CPU_MEASURED + ": 1024^3 FP32 matmul on one thread, x cores (achieved: efficiency 1)",
        "tflops.bfloat16": _CPU_MEASURED + ": the same in BF16 (oneDNN)",
        "tflops.fp8": _CPU_MEASURED + ": the FP8 recipes' emulated GEMM (casts + FP32 matmul), one thread, x cores",
        "memory_gbps": _CPU_MEASURED + ": a 256 MiB tensor copy on one thread (bytes read + written), x cores",
        "intra_node_gbps": _CPU_MEASURED + ": gloo all-reduce bus bandwidth between 2 processes",
        "inter_node_gbps": "the same (one machine)",
        "all_gather_extra": "measured here: a gloo all_gather_into_tensor of a 200 MB output from 2 processes raised "
        "the resident-set peak by ~0.9x the output beyond its input and output (a gloo all-reduce: by nothing)",
        "fresh_memory_gbps": _CPU_MEASURED + ": filling newly allocated 64 MiB tensors (page faults of this VM: "
        "0.7 to 2.0 GB/s from one process as the load varies; two processes together get the same in all)",
        "ep_intra_node_gbps": "half the copy rate: mtdeepep's CPU executor writes each row into shared memory and "
        "the receiver copies it out",
        "comm_latency_us": _CPU_MEASURED + ": a small gloo all-reduce",
        "runtime_gib": "measured by bench/plan_check.py: peak of a 2-rank train.py run of a ~0.6M-parameter model "
        "minus the estimate of its state and activations (calibrate.py's import-only figure is 0.29)",
        "allocator_overhead": "measured once here: glibc keeps ~0.3 of a step's freed activations resident (a small "
        "model's forward + backward with and without `moe.layer.peak_memory`'s exact accounting)",
        "shared_cores": "os.sched_getaffinity",
    },
    estimated=frozenset(),
)

SPECS: dict[str, DeviceSpec] = {
    spec.name: spec for spec in (H100, H200, H800, B200, A100_PCIE, MTT_S4000, MTT_S5000, CPU)
}


def load_device_spec(name_or_path: str) -> DeviceSpec:
    """A built-in spec by name (`SPECS`), or a JSON file of `DeviceSpec` fields (a custom device).

    ValueError naming the known specs for an unknown name, and the problem for a bad file.
    """
    if name_or_path in SPECS:
        return SPECS[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"device spec file {path} does not exist")
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"device spec file {path}: not JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"device spec file {path}: expected a JSON object of DeviceSpec fields")
        known = {f.name for f in dataclasses.fields(DeviceSpec)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"device spec file {path}: unknown fields {unknown} (known: {sorted(known)})")
        fields.setdefault("sources", {"*": f"user file {path}"})
        try:
            return DeviceSpec(**fields)
        except TypeError as exc:
            raise ValueError(f"device spec file {path}: {exc}") from None
    raise ValueError(f"unknown device spec {name_or_path!r}; built-in: {', '.join(SPECS)} (or a JSON file)")


def source_rows(spec: DeviceSpec) -> list[tuple[str, str, str]]:
    """`(figure, value, source)` rows of a spec's cited figures, estimates marked '(est.)'."""
    rows = []
    for key, source in spec.sources.items():
        if key == "*":
            continue
        name, _, sub = key.partition(".")
        value = getattr(spec, name)
        if sub:
            value = value.get(sub)
        text = "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        rows.append((key + (" (est.)" if key in spec.estimated else ""), text, source))
    return rows
