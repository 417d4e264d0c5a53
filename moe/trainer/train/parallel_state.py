"""The parallel layout of a run: `Layout` (checked before any process group exists) and `ParallelState` (the
process groups, built once from torch.distributed and passed explicitly: no module globals).

Megatron-core's MoE parallel folding. The attention and dense layers see the W ranks as PP x DP x TP (TP fastest,
so a tensor-parallel group is consecutive ranks); the MoE layers refold the same ranks of one pipeline stage as
EDP x EP x ETP (ETP fastest), with EDP x EP x ETP = DP x TP. Expert parallelism may therefore span tensor-parallel
ranks (W = 4, TP 2, EP 4: every rank holds a quarter of the experts). With W ranks:
- a dense parameter is sharded over its TP group (column / row parallel) or replicated there (norms, router), and
  replicated over the DP group, over which its gradient is summed;
- each EP group holds one copy of all experts, rank i of the group the experts `[i*E/ep, (i+1)*E/ep)`, each split
  over ETP ranks along the FFN dimension; the ranks holding the same expert shard form the expert-data-parallel
  group (EDP), over which the expert gradients are summed;
- with TP > 1 sequence parallelism is on (as Megatron-core requires for MoE with TP): outside the TP regions every
  TP rank holds 1/TP of the sequence, and the MoE layer routes and dispatches those local tokens.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from moe.layer.fp8.recipe import FP8_RECIPES

PP_SCHEDULES = ("1f1b", "zbh1", "dualpipev")
BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda", "mccl": "musa"}


@dataclass(frozen=True)
class Layout:
    """How `world` ranks are split: `dp = world / (tp * pp)`, `expert_dp = dp * tp / (ep * etp)`. `vpp`: the
    virtual pipeline stages each pipeline rank holds (Megatron's `--num-virtual-stages-per-pipeline-rank`; 1: one
    stage per rank, or DualPipeV's two), for 1f1b (interleaved 1F1B) and zbh1 (interleaved zero bubble).

    Construction raises one ValueError listing the sizes and every rule the split breaks.
    """

    world: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    pp_schedule: str = "1f1b"
    fp8: str = "none"
    vpp: int = 1

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp", "ep", "etp", "vpp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {FP8_RECIPES}, got {self.fp8!r}")
        broken = []
        if self.vpp > 1 and self.pp == 1:
            broken.append(f"vpp {self.vpp} (--num-virtual-stages-per-pipeline-rank) needs pp > 1")
        if self.vpp > 1 and self.pp_schedule == "dualpipev":
            broken.append(
                f"vpp {self.vpp} (--num-virtual-stages-per-pipeline-rank) with dualpipev: DualPipeV already holds "
                "2 stages per rank in a V; virtual stages are for 1f1b (interleaved 1F1B) and zbh1 (interleaved zero "
                "bubble)"
            )
        if self.world % (self.tp * self.pp):
            broken.append(f"world must be divisible by tp * pp = {self.tp * self.pp}")
        else:
            stage_ranks = self.world // self.pp  # = dp * tp
            if stage_ranks % (self.ep * self.etp):
                broken.append(
                    f"ep * etp = {self.ep * self.etp} must divide dp * tp = {stage_ranks} (MoE parallel folding: the "
                    f"expert layers refold the dp x tp ranks of a pipeline stage as edp x ep x etp)"
                )
        if broken:
            sizes = f"world {self.world}, tp {self.tp}, pp {self.pp}, ep {self.ep}, etp {self.etp}" + (
                f", vpp {self.vpp}" if self.vpp > 1 else ""
            )
            raise ValueError(f"invalid parallel layout ({sizes}): " + "; ".join(broken))

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.dp * self.tp // (self.ep * self.etp)

    @property
    def sequence_parallel(self) -> bool:
        """On whenever tp > 1 (see the module docstring)."""
        return self.tp > 1

    def check_batch(self, global_batch: int, micro_batches: int) -> None:
        """The global batch must split into `micro_batches` equal micro-batches on each of the dp ranks."""
        if global_batch % (self.dp * micro_batches):
            raise ValueError(
                f"global_batch={global_batch} is not divisible by dp * micro_batches = {self.dp} * {micro_batches} "
                f"(every data-parallel rank runs {micro_batches} equal micro-batches)"
            )

    def check_experts(self, num_experts: int) -> None:
        if num_experts % self.ep:
            raise ValueError(f"n_routed_experts={num_experts} is not divisible by --ep {self.ep}")

    def to_dict(self) -> dict[str, object]:
        """The resolved layout for run.json and the checkpoint manifests: world, dp, tp, pp, ep, etp, expert_dp,
        schedule, fp8, and vpp where it is above 1 (a layout of one stage per rank reads as it did before virtual
        stages existed, so its checkpoints still resume as the same layout)."""
        d = asdict(self)
        schedule = d.pop("pp_schedule")
        if d["vpp"] == 1:
            del d["vpp"]
        return {**d, "dp": self.dp, "expert_dp": self.expert_dp, "schedule": schedule}


def env_world_size() -> int:
    """The world size torchrun announces (WORLD_SIZE), 1 outside torchrun; read before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


@dataclass
class ParallelState:
    """The process groups of one rank. Groups of one rank are None (no communication), so the layers and the
    collectives take their single-process paths.

    mesh: the dense mesh `("pp", "dp", "tp")`; expert_mesh: `("pp", "edp", "ep", "etp")` over the same ranks (both
        None in a single process).
    """

    layout: Layout
    rank: int = 0
    mesh: object | None = None
    expert_mesh: object | None = None
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)

    @classmethod
    def single(cls) -> ParallelState:
        """One process, no process group."""
        return cls(Layout(world=1))

    @classmethod
    def initialize(cls, layout: Layout, *, backend: str = "gloo", timeout_s: float = 600.0) -> ParallelState:
        """Joins the torchrun job (env:// rendezvous) when `layout.world > 1` and builds the meshes; a single
        process otherwise. The process group's own waits are bounded by `timeout_s`. Backends: gloo (CPU), nccl
        (CUDA), mccl (MUSA)."""
        if backend not in BACKEND_DEVICES:
            raise ValueError(f"backend must be one of {sorted(BACKEND_DEVICES)}, got {backend!r}")
        if layout.world == 1:
            return cls.single()
        if not dist.is_initialized():
            if env_world_size() != layout.world:
                raise ValueError(f"layout for {layout.world} ranks, but WORLD_SIZE={env_world_size()}")
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        elif dist.get_world_size() != layout.world:
            raise ValueError(f"layout for {layout.world} ranks, but the process group has {dist.get_world_size()}")
        return cls.from_process_group(layout, device_type=BACKEND_DEVICES[backend])

    @classmethod
    def from_process_group(cls, layout: Layout, device_type: str = "cpu") -> ParallelState:
        """The meshes over the initialised default process group (collective: every rank calls it)."""
        from torch.distributed.device_mesh import DeviceMesh

        if dist.get_world_size() != layout.world:
            raise ValueError(f"layout for {layout.world} ranks, but the process group has {dist.get_world_size()}")
        ranks = torch.arange(layout.world)
        mesh = DeviceMesh(device_type, ranks.view(layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
        expert_mesh = DeviceMesh(
            device_type,
            ranks.view(layout.pp, layout.expert_dp, layout.ep, layout.etp),
            mesh_dim_names=("pp", "edp", "ep", "etp"),
        )
        state = cls(layout, dist.get_rank(), mesh, expert_mesh)
        state._groups = {
            "pp": _group(mesh, "pp"),
            "dp": _group(mesh, "dp"),
            "tp": _group(mesh, "tp"),
            "ep": _group(expert_mesh, "ep"),
            "etp": _group(expert_mesh, "etp"),
            "edp": _group(expert_mesh, "edp"),
            "dp_tp": _stage_group(layout),
            "ep_etp": _expert_model_group(layout, _group(expert_mesh, "ep")),
        }
        return state

    # -- groups (None = this rank alone)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the pipeline stages of one model replica (same dp and tp coordinates): activations and
        gradients move between them point to point."""
        return self._groups.get("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Ranks that see different sequences and hold the same dense weights (the same TP shard): gradients of
        the dense parameters, token counts and expert loads are summed over it."""
        return self._groups.get("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """Ranks that split the dense layers' weights (column / row parallel) and, with sequence parallelism, the
        sequence outside those layers."""
        return self._groups.get("tp")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """Ranks that share the experts of one MoE layer (the mtdeepep dispatcher's group)."""
        return self._groups.get("ep")

    @property
    def etp_group(self) -> dist.ProcessGroup | None:
        """Ranks that split each local expert along its FFN dimension."""
        return self._groups.get("etp")

    @property
    def expert_model_group(self) -> dist.ProcessGroup | None:
        """The ep x etp ranks that hold one copy of every expert between them (ETP fastest: rank `i * etp + j` of
        it holds shard j of the experts of EP rank i). The MoE layers dispatch their tokens over it (Megatron's
        expert-tensor-and-model-parallel group, the flex dispatcher's `tp_ep_group`); with etp 1 it is the EP
        group itself."""
        return self._groups.get("ep_etp")

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the same expert shard: the expert gradients are summed over it."""
        return self._groups.get("edp")

    @property
    def token_group(self) -> dist.ProcessGroup | None:
        """The dp x tp ranks of this pipeline stage: every rank's router sees different tokens (other sequences,
        or with sequence parallelism another part of the sequence), so expert loads and token counts are summed
        over it (e.g. for the expert-bias update)."""
        return self._groups.get("dp_tp")

    def _local_rank(self, mesh, name: str) -> int:
        return 0 if mesh is None else mesh.get_local_rank(name)

    @property
    def pp_rank(self) -> int:
        return self._local_rank(self.mesh, "pp")

    @property
    def dp_rank(self) -> int:
        return self._local_rank(self.mesh, "dp")

    @property
    def tp_rank(self) -> int:
        return self._local_rank(self.mesh, "tp")

    @property
    def ep_rank(self) -> int:
        return self._local_rank(self.expert_mesh, "ep")

    @property
    def etp_rank(self) -> int:
        return self._local_rank(self.expert_mesh, "etp")

    @property
    def expert_dp_rank(self) -> int:
        return self._local_rank(self.expert_mesh, "edp")

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and draws the progress bar."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.layout.world > 1:
            dist.barrier()

    def destroy(self) -> None:
        if self.layout.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _stage_group(layout: Layout) -> dist.ProcessGroup | None:
    """The group of this rank's pipeline stage (dp x tp ranks); `new_group` is collective: every rank creates
    every stage's group."""
    stage_size = layout.dp * layout.tp
    if stage_size == 1:
        return None
    if layout.pp == 1:
        return dist.group.WORLD
    mine = None
    for stage in range(layout.pp):
        group = dist.new_group(list(range(stage * stage_size, (stage + 1) * stage_size)))
        if dist.get_rank() // stage_size == stage:
            mine = group
    return mine


def _expert_model_group(layout: Layout, ep_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The folded ep x etp group of this rank: `ep * etp` consecutive ranks (ETP, then EP, are the expert mesh's
    fastest dimensions). The EP group itself when etp is 1; `new_group` is collective: every rank creates every
    block's group."""
    size = layout.ep * layout.etp
    if layout.etp == 1 or size == 1:
        return ep_group
    mine = None
    for start in range(0, layout.world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = group
    return mine


def _group(mesh, name: str) -> dist.ProcessGroup | None:
    return mesh.get_group(name) if mesh.size(mesh.mesh_dim_names.index(name)) > 1 else None


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over `group` (no-op for None); returns `t`."""
    if group is not None:
        dist.all_reduce(t, group=group)
    return t
