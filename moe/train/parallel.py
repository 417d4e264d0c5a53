"""The parallel layout of a run: `Layout` (checked before any process group exists) and `ParallelState` (the
process groups, built once from torch.distributed and passed explicitly: no module globals).

Megatron's MoE parallel folding: the attention and dense layers use the ranks as PP x DP x TP, the MoE layers refold
the same ranks as PP x EDP x EP (x ETP), with EP x EDP = DP x TP, so expert parallelism spans data-parallel ranks.
This release runs TP = PP = 1 (tensor and pipeline parallelism and FP8 arrive with the next issues; `Layout` refuses
them with a message that says so). With W ranks:
- dense parameters are replicated over the DP group (all W ranks) and their gradients are summed over it;
- each EP group (`ep` consecutive ranks) holds one copy of all experts, rank i of the group the experts
  `[i*E/ep, (i+1)*E/ep)`; the ranks holding the same experts form the expert-data-parallel group (EDP,
  W / ep ranks, strided), over which the expert gradients are summed;
- every rank sees different sequences, so batch statistics (token counts, router load) are summed over DP.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

PP_SCHEDULES = ("1f1b", "zbh1", "dualpipev")
FP8_RECIPES = ("none", "delayed", "blockwise")


@dataclass(frozen=True)
class Layout:
    """How `world` ranks are split. `dp = world / (tp * pp)`, `expert_dp = dp * tp / ep`.

    Raises ValueError (from `check`) for an impossible split, and for values that later issues bring
    (tp > 1, pp > 1, fp8 other than 'none').
    """

    world: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    fp8: str = "none"

    def __post_init__(self) -> None:
        for name in ("world", "tp", "pp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}")
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {FP8_RECIPES}, got {self.fp8!r}")
        if self.tp > 1:
            raise ValueError(f"--tp {self.tp}: tensor parallelism arrives with the next issue; only --tp 1 runs now")
        if self.pp > 1:
            raise ValueError(f"--pp {self.pp}: pipeline parallelism arrives with the next issue; only --pp 1 runs now")
        if self.fp8 != "none":
            raise ValueError(f"--fp8 {self.fp8}: FP8 training arrives with the next issue; only --fp8 none runs now")
        if self.world % (self.tp * self.pp):
            raise ValueError(f"world size {self.world} is not divisible by tp * pp = {self.tp * self.pp}")
        if (self.dp * self.tp) % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide dp * tp = {self.dp * self.tp} (the ranks of one pipeline stage; "
                f"world {self.world}, tp {self.tp}, pp {self.pp})"
            )

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.dp * self.tp // self.ep

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
        """The resolved layout for run.json: world, dp, tp, pp, ep, expert_dp, schedule, fp8."""
        d = asdict(self)
        schedule = d.pop("pp_schedule")
        return {**d, "dp": self.dp, "expert_dp": self.expert_dp, "schedule": schedule}


def env_world_size() -> int:
    """The world size torchrun announces (WORLD_SIZE), 1 outside torchrun; read before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


@dataclass
class ParallelState:
    """The process groups of one rank. Groups of one rank are None (no communication), so the MoE layers and
    the collectives here take the single-process paths.

    mesh: the dense mesh `("pp", "dp", "tp")`; expert_mesh: `("pp", "edp", "ep")` over the same ranks (None in a
        single process).
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
        process otherwise. The process group's own waits are bounded by `timeout_s`."""
        if layout.world == 1:
            return cls.single()
        if not dist.is_initialized():
            if env_world_size() != layout.world:
                raise ValueError(f"layout for {layout.world} ranks, but WORLD_SIZE={env_world_size()}")
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        elif dist.get_world_size() != layout.world:
            raise ValueError(f"layout for {layout.world} ranks, but the process group has {dist.get_world_size()}")
        return cls.from_process_group(layout)

    @classmethod
    def from_process_group(cls, layout: Layout) -> ParallelState:
        """The meshes over the initialised default process group (collective: every rank calls it)."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(layout.world)
        mesh = DeviceMesh("cpu", ranks.view(layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
        expert_mesh = DeviceMesh(
            "cpu", ranks.view(layout.pp, layout.expert_dp, layout.ep), mesh_dim_names=("pp", "edp", "ep")
        )
        state = cls(layout, dist.get_rank(), mesh, expert_mesh)
        state._groups = {
            "dp": _group(mesh, "dp"),
            "ep": _group(expert_mesh, "ep"),
            "edp": _group(expert_mesh, "edp"),
        }
        return state

    # -- groups (None = this rank alone)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Ranks whose routers see different sequences and hold the same dense weights: gradients of the dense
        parameters, token counts and expert loads are summed over it."""
        return self._groups.get("dp")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """Ranks that share the experts of one MoE layer (the mtdeepep dispatcher's group)."""
        return self._groups.get("ep")

    @property
    def expert_dp_group(self) -> dist.ProcessGroup | None:
        """Ranks holding the same experts: the expert gradients are summed over it."""
        return self._groups.get("edp")

    @property
    def dp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank("dp")

    @property
    def ep_rank(self) -> int:
        return 0 if self.expert_mesh is None else self.expert_mesh.get_local_rank("ep")

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


def _group(mesh, name: str) -> dist.ProcessGroup | None:
    return mesh.get_group(name) if mesh.size(mesh.mesh_dim_names.index(name)) > 1 else None


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over `group` (no-op for None); returns `t`."""
    if group is not None:
        dist.all_reduce(t, group=group)
    return t
