"""What a training checkpoint holds of a rank, and how a rank of any layout takes its part back: the state list.

The state is a list of components (`TrainState`), each with `state_dict()` (its part of a checkpoint, a
`StatePart`) and `load_state_dict(source)` (its part back from a checkpoint being resumed): the trainer's counters
(`TrainProgress`: step, seed, layout), the data position (`DataPosition`), the learning-rate schedule
(`LRSchedule`), the model (`ModelState`), the optimizer (`OptimizerState`) and the rank-local state
(`RankLocalState`). The same list gives the rewind snapshot (moe/trainer/train/rewind.py) the live tensors and host-side
state it copies (`snapshot_tensors`, `host_state` / `load_host_state`), and the last checkpoint's model-directory
export its whole model (`TrainState.export_model`, from the model component).

Sharded (each tensor a box of a layout-independent global tensor, see moe/trainer/io/boxes.py; resharded on load):
- "model": every entry of the model's `state_dict()` (parameters and buffers: the routers' expert biases among
  them) but the transient expert-bias token counts; global keys = the full state dict's keys.
- "optimizer": `<param>.exp_avg`, `.exp_avg_sq` and, for non-FP32 parameters, the FP32 `.master` (MasterAdamW: this
  rank's parameters; ZeRO-1: this rank's flat shards of them).
Each box is stored by one replica, so a checkpoint holds every element once (its commit checks it:
`check_tiling`): a ZeRO-1 shard by its owner; a tensor replicated over the data-parallel ranks (dense) or the
expert-data-parallel ranks (experts) by one of them, chosen so that the replicas share the bytes evenly (greedy,
largest first, the same choice on every replica); a TP-replicated tensor by TP rank 0 only. Each rank copies and
writes only what it stores: the copy a checkpoint costs the step shrinks with the data-parallel size.

Rank-local (not resharded): torch's CPU generator (and CUDA's when in use), Python's and NumPy's global generators,
and the FP8 delayed-scaling amax histories of the rank's GEMM sites. Loaded exactly in the same layout; after a
layout change the generators are left alone (the trainer reseeds every step from `(seed, step)`, so they do not
enter the maths) and each site's history becomes the element-wise maximum of the histories the old ranks kept for
that site (the scale a global amax reduction would give: no overflow, possibly a coarser scale for a few steps).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moe.layer.balancing import ExpertBias
from moe.layer.fp8.amax_history import ROLES, delayed_states
from moe.layer.moe_layer import MoELayer
from moe.layer.parallel.sharding import tp_shard_of
from moe.trainer.io.boxes import Placement
from moe.trainer.io.shard_files import CheckpointReader
from moe.trainer.train.optim import StateTensor
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.schedule import lr_at


@dataclass
class Entry:
    """One tensor of a rank's checkpoint: `tensor` (live) is `placement` of the global tensor `key` of `section`;
    `write`: this rank is the replica that stores it."""

    section: str
    key: str
    tensor: torch.Tensor
    placement: Placement
    write: bool


def _placement(param: torch.Tensor, shape: tuple[int, ...], dim0_offset: int | None, ep: int,
               flat: tuple[int, int] | None = None) -> Placement:  # fmt: skip
    """`dim0_offset`: the first local expert's global index (expert tensors, `ep` ranks), None for dense."""
    global_shape = list(shape)
    if dim0_offset is not None:
        global_shape[0] *= ep
    tp = tp_shard_of(param)
    if tp is not None and tp.size > 1:
        global_shape = list(tp.full_shape(torch.Size(global_shape)))
    else:
        tp = None
    return Placement(tuple(global_shape), tuple(shape), dim0_offset or 0, tp, flat)


Replicas = tuple[str, int, int]  # (the group: "dense" / "expert" / "own", its size, this rank's index in it)


def _replicas(expert: bool, tp_sharded: bool, zero_shard: bool, parallel: ParallelState) -> Replicas | None:
    """The replicas that hold the same box; None when this rank never stores it (a TP-replicated tensor on a TP
    rank other than 0)."""
    if not expert and not tp_sharded and parallel.tp_rank != 0:
        return None
    if zero_shard:
        return "own", 1, 0
    if expert:
        return "expert", parallel.layout.expert_dp, parallel.expert_dp_rank
    return "dense", parallel.layout.dp, parallel.dp_rank


def _assign(entries: list[Entry], replicas: list[Replicas | None]) -> None:
    """Set `Entry.write`: of the entries replicated over a group of n ranks, each goes to the replica with the fewest
    bytes so far, largest first (ties by key: every replica computes the same assignment from the same entries)."""
    loads: dict[str, list[int]] = {}
    order = sorted(range(len(entries)), key=lambda i: (-_nbytes(entries[i]), entries[i].section, entries[i].key, i))
    for i in order:
        if replicas[i] is None:
            entries[i].write = False
            continue
        group, n, mine = replicas[i]
        load = loads.setdefault(group, [0] * n)
        owner = min(range(n), key=lambda r: (load[r], r))
        load[owner] += _nbytes(entries[i])
        entries[i].write = owner == mine


def _nbytes(e: Entry) -> int:
    return e.placement.numel * e.tensor.element_size()


def model_entries(model: nn.Module, parallel: ParallelState) -> list[Entry]:
    """The model's state (see the module docstring) as entries of section "model"."""
    transient = {f"{n}.counts" if n else "counts" for n, m in model.named_modules() if isinstance(m, ExpertBias)}
    experts: dict[str, MoELayer] = {}
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            for pname, _ in module.experts.named_parameters():
                experts[f"{name}.experts.{pname}" if name else f"experts.{pname}"] = module
    out, replicas = [], []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key in transient:
            continue
        layer = experts.get(key)
        ep = layer.ep_size if layer is not None else 1
        start = layer.local_expert_start if layer is not None else None
        p = _placement(tensor, tuple(tensor.shape), start, ep)
        out.append(Entry("model", key, tensor.detach(), p, False))
        replicas.append(_replicas(layer is not None, p.tp is not None, False, parallel))
    _assign(out, replicas)
    return out


def optimizer_entries(optimizer, parallel: ParallelState, *, create: bool = False) -> list[Entry]:
    """The optimizer's tensors (`MasterAdamW` or ZeRO-1's `DistributedAdamW`: `state_tensors`) as entries of
    section "optimizer"; `create`: make the moments of an optimizer that has not stepped, for a load."""
    out, replicas = [], []
    st: StateTensor
    for st in optimizer.state_tensors(create=create):
        ep = parallel.layout.ep
        shape = tuple(st.param.shape)
        start = parallel.ep_rank * shape[0] if st.expert and ep > 1 else (0 if st.expert else None)
        p = _placement(st.param, shape, start, ep if st.expert else 1, st.flat)
        out.append(Entry("optimizer", st.key, st.tensor, p, False))
        replicas.append(_replicas(st.expert, p.tp is not None, st.flat is not None, parallel))
    _assign(out, replicas)
    return out


def load_entries(reader: CheckpointReader, entries: list[Entry]) -> None:
    """Fill every entry (written by this rank or not) from the checkpoint."""
    for e in entries:
        reader.read_into(e.section, e.key, e.placement, e.tensor)


# -- rank-local state


def rank_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's generator states and FP8 amax histories: `(tensors, JSON)` (copies)."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    info: dict[str, Any] = {
        "rng": {"python": [version, list(mt), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]},
        "fp8_delayed": {},
    }
    for site, state in delayed_states(model).items():
        counts = {}
        for role in ROLES:
            history, counts[role] = getattr(state, role).state()
            tensors[f"fp8.{site}.{role}"] = history
        info["fp8_delayed"][site] = counts
    return tensors, info


def load_rank_state(reader: CheckpointReader, model: nn.Module, parallel: ParallelState, same_layout: bool) -> str:
    """Restore the rank-local state (see the module docstring); returns a line saying what was restored."""
    sites = delayed_states(model)
    if same_layout:
        index = reader.rank_index(parallel.rank)["state"]
        torch.set_rng_state(reader.rank_tensor(parallel.rank, "rng.torch"))
        cuda = [reader.rank_tensor(parallel.rank, f"rng.cuda.{i}") for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() and all(t is not None for t in cuda) and cuda:
            torch.cuda.set_rng_state_all(cuda)
        version, mt, gauss = index["rng"]["python"]
        random.setstate((version, tuple(mt), gauss))
        name, keys, pos, has_gauss, cached = index["rng"]["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        saved = index["fp8_delayed"]
        if saved and set(saved) != set(sites):
            raise ValueError(
                f"the checkpoint's FP8 delayed-scaling sites of rank {parallel.rank} differ from this model's: "
                f"{sorted(set(saved) ^ set(sites))[:5]}"
            )
        for site, state in sites.items():
            if site in saved:
                for role in ROLES:
                    getattr(state, role).load_state(
                        reader.rank_tensor(parallel.rank, f"fp8.{site}.{role}"), saved[site][role]
                    )
        restored = len(saved)
        how = "this rank's"
    else:
        # Another layout: the old ranks that ran each site; their histories' element-wise maximum.
        indexes = [reader.rank_index(r)["state"]["fp8_delayed"] for r in range(reader.world)]
        restored = 0
        for site, state in sites.items():
            holders = [r for r, saved in enumerate(indexes) if site in saved]
            if not holders:
                continue
            for role in ROLES:
                histories = torch.stack([reader.rank_tensor(r, f"fp8.{site}.{role}") for r in holders])
                count = max(indexes[r][site][role] for r in holders)
                getattr(state, role).load_state(histories.amax(0), count)
            restored += 1
        how = "the maximum over the old ranks'"
    if not sites:
        return "no FP8 delayed-scaling state"
    return f"FP8 delayed-scaling amax histories of {restored} of {len(sites)} sites from {how}"


# -- the components


@dataclass
class StatePart:
    """A component's part of one rank's checkpoint.

    entries: sharded tensors (section "model" or "optimizer"; resharded on load).
    tensors: rank-local tensors (`rank_R/state.safetensors`).
    info: rank-local JSON (`rank_R/index.json`'s "state").
    trainer: keys of `trainer_state.json` (rank 0 writes it).
    """

    entries: list[Entry] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)

    def merge(self, other: StatePart) -> StatePart:
        self.entries += other.entries
        self.tensors.update(other.tensors)
        self.info.update(other.info)
        self.trainer.update(other.trainer)
        return self


@dataclass
class LoadSource:
    """A checkpoint being resumed: its directory, its verified `trainer_state.json`, the open reader and whether it
    was saved in this run's layout."""

    path: Path
    trainer_state: dict[str, Any]
    reader: CheckpointReader
    same_layout: bool


class Component:
    """One piece of the training state. `state_dict` / `load_state_dict`: its part of a checkpoint (the latter
    returns a note for the resume line, or None); `snapshot_tensors` / `host_state` / `load_host_state`: what the
    in-memory rewind snapshot copies (tensors storage by storage; host state as returned)."""

    def state_dict(self) -> StatePart:
        return StatePart()

    def load_state_dict(self, source: LoadSource) -> str | None:
        return None

    def snapshot_tensors(self) -> list[torch.Tensor]:
        return []

    def host_state(self) -> Any:
        return None

    def load_host_state(self, state: Any) -> None:
        pass


class TrainProgress(Component):
    """The trainer's counters: `step` (the last optimizer step done), the seed it checks on resume, the layout and
    the run's description (`run_info`)."""

    def __init__(self, seed: int, parallel: ParallelState, run_info: dict[str, Any]) -> None:
        self.step = 0
        self.seed = seed
        self.parallel = parallel
        self.run_info = run_info

    def state_dict(self) -> StatePart:
        return StatePart(trainer={"step": self.step, "seed": self.seed, "layout": self.parallel.layout.to_dict(),
                                  **self.run_info})  # fmt: skip

    def load_state_dict(self, source: LoadSource) -> None:
        state = source.trainer_state
        if state["seed"] != self.seed:
            raise ValueError(f"{source.path} was trained with seed={state['seed']}, this run has {self.seed}")
        self.step = int(state["step"])


class DataPosition(Component):
    """Where the data stands: batch = step (every `DataSource` is a function of the step), recorded with what it
    depends on, which a resumed run must share: the batch shape, the training windows and the data's identity
    (`DataSource.identity()`: its fingerprint, the blend's prefixes and weights)."""

    def __init__(self, config, batches, progress: TrainProgress) -> None:
        self.config, self.batches, self.progress = config, batches, progress

    def _identity(self) -> dict[str, Any]:
        identity = getattr(self.batches, "identity", None)
        return identity() if identity is not None else {}

    def state_dict(self) -> StatePart:
        step, cfg = self.progress.step, self.config
        return StatePart(trainer={"data": {
            "next_step": step + 1,
            "consumed_sequences": step * cfg.global_batch,
            "epoch": (step * cfg.global_batch) // self.batches.num_train,
            "global_batch": cfg.global_batch,
            "seq_len": cfg.seq_len,
            "num_train_windows": self.batches.num_train,
            **self._identity(),
        }})  # fmt: skip

    def load_state_dict(self, source: LoadSource) -> None:
        saved = source.trainer_state["data"]
        data = dict(saved, num_train_windows=saved.get("num_train_windows", self.batches.num_train))
        for key, mine in (("global_batch", self.config.global_batch), ("seq_len", self.config.seq_len),
                          ("num_train_windows", self.batches.num_train)):  # fmt: skip
            if data[key] != mine:
                raise ValueError(
                    f"{source.path} was trained with {key}={data[key]}, this run has {mine}: the data position would "
                    "not carry over"
                )
        check_same_data(saved, self._identity(), source.path)


def check_same_data(saved: dict[str, Any], identity: dict[str, Any], path) -> None:
    """ValueError unless the checkpoint at `path`, whose trainer state's "data" is `saved`, was trained on the data
    of `identity` (`DataSource.identity()`). Checkpoints from before the fingerprint was recorded carry none:
    nothing to compare."""
    if "fingerprint" in saved and "fingerprint" in identity and saved["fingerprint"] != identity["fingerprint"]:
        theirs = {k: saved[k] for k in ("source", "prefixes", "weights") if k in saved}
        mine = {k: identity[k] for k in ("source", "prefixes", "weights") if k in identity}
        raise ValueError(
            f"{path} was trained on other data (fingerprint {saved['fingerprint'][:12]} {theirs}, this run "
            f"{identity['fingerprint'][:12]} {mine}): its data position would not carry over; resume with the "
            "same data and weights, or start a new run (--init)"
        )


class LRSchedule(Component):
    """The learning-rate schedule (a function of the step): recorded; a resumed run may change it (noted)."""

    def __init__(self, config, total_steps: int, progress: TrainProgress, is_main: bool) -> None:
        self.config, self.total_steps, self.progress, self.is_main = config, total_steps, progress, is_main

    def _settings(self) -> dict[str, Any]:
        cfg = self.config  # [optimizer]
        return {"lr": cfg.lr, "min_lr": cfg.min_lr, "warmup_steps": cfg.warmup_steps, "total_steps": self.total_steps}

    def state_dict(self) -> StatePart:
        cfg = self.config
        last = lr_at(self.progress.step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
                     total_steps=self.total_steps)  # fmt: skip
        return StatePart(trainer={"schedule": {**self._settings(), "last_lr": last}})

    def load_state_dict(self, source: LoadSource) -> None:
        sched = source.trainer_state["schedule"]
        changed = {k: (sched[k], v) for k, v in self._settings().items() if sched[k] != v}
        if changed and self.is_main:
            print(f"note: the learning-rate schedule changed since {source.path.name} (checkpoint, now): {changed}")


class ModelState(Component):
    """The model's parameters and buffers (sharded, `model_entries`), and the whole model for a model-directory
    export (`export`: `full_state_dict`, the model's own gather, merged over the pipeline stages)."""

    def __init__(self, model: nn.Module, parallel: ParallelState,
                 full_state_dict: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:  # fmt: skip
        self.model, self.parallel = model, parallel
        self.full_state_dict = full_state_dict

    def export(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict (copies; collective over the ranks), None without `full_state_dict`."""
        if self.full_state_dict is None:
            return None
        state = {k: v.detach().clone() for k, v in self.full_state_dict().items()}
        group = self.parallel.pp_group
        if group is None:
            return state
        # Pipeline parallelism: every pipeline rank's part in one (disjoint keys: each rank holds other layers).
        parts: list[dict] = [{} for _ in range(self.parallel.layout.pp)]
        dist.all_gather_object(parts, state, group=group)
        return {k: v for part in parts for k, v in part.items()}

    def state_dict(self) -> StatePart:
        return StatePart(entries=model_entries(self.model, self.parallel))

    def load_state_dict(self, source: LoadSource) -> None:
        load_entries(source.reader, model_entries(self.model, self.parallel))

    def snapshot_tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]


class OptimizerState(Component):
    """The optimizer: its tensors (sharded, `optimizer_entries`) and its step count (`trainer_state.json`)."""

    def __init__(self, optimizer, parallel: ParallelState) -> None:
        self.optimizer, self.parallel = optimizer, parallel

    def state_dict(self) -> StatePart:
        return StatePart(entries=optimizer_entries(self.optimizer, self.parallel),
                         trainer={"optimizer": {"kind": type(self.optimizer).__name__,
                                                "steps": self.optimizer.steps}})  # fmt: skip

    def load_state_dict(self, source: LoadSource) -> None:
        steps = int(source.trainer_state["optimizer"]["steps"])
        load_entries(source.reader, optimizer_entries(self.optimizer, self.parallel, create=steps > 0))
        self.optimizer.set_steps(steps)

    def snapshot_tensors(self) -> list[torch.Tensor]:
        adamw = self.optimizer.adamw
        out = [p for group in adamw.param_groups for p in group["params"]]
        return out + [t for state in adamw.state.values() for t in state.values() if isinstance(t, torch.Tensor)]

    def host_state(self) -> tuple[dict, int | None]:
        """AdamW's per-parameter state dicts (the same tensor objects) and the step count."""
        adamw = self.optimizer.adamw
        return {p: dict(s) for p, s in adamw.state.items()}, getattr(self.optimizer, "steps", None)

    def load_host_state(self, state: tuple[dict, int | None]) -> None:
        adamw_state, steps = state
        adamw = self.optimizer.adamw
        adamw.state.clear()  # states created after the snapshot (e.g. MasterAdamW's first step) go
        for p, s in adamw_state.items():
            adamw.state[p] = dict(s)
        if steps is not None:  # both optimizers count their steps (moe/trainer/train/optim.py, zero.py)
            self.optimizer.set_steps(steps)


class RankLocalState(Component):
    """The rank-local state: generators and FP8 delayed-scaling amax histories (`rank_state`, `load_rank_state`;
    the rewind snapshot keeps the histories' host-side objects)."""

    RNG_POLICY = ("torch.manual_seed(step_seed(seed, step)) at the start of every step; the generator states of "
                  "every rank are in its rank_*/state.safetensors")  # fmt: skip

    def __init__(self, model: nn.Module, parallel: ParallelState) -> None:
        self.model, self.parallel = model, parallel
        self.histories = amax_histories(model)

    def state_dict(self) -> StatePart:
        tensors, info = rank_state(self.model)
        return StatePart(tensors=tensors, info=info, trainer={"rng": {"policy": self.RNG_POLICY}})

    def load_state_dict(self, source: LoadSource) -> str:
        return load_rank_state(source.reader, self.model, self.parallel, same_layout=source.same_layout)

    def host_state(self) -> list:
        return [(h, h.history.clone(), h.num_recorded) for h in self.histories]

    def load_host_state(self, state: list) -> None:
        for h, history, num_recorded in state:
            h.history = history.clone()
            h.num_recorded = num_recorded


def amax_histories(model: nn.Module) -> list:
    """The FP8 delayed-scaling `AmaxHistory` objects of `model` (three per GEMM site, each once); empty without FP8
    or with the blockwise recipe."""
    found = {}
    for state in delayed_states(model).values():
        for role in ROLES:
            h = getattr(state, role)
            found[id(h)] = h
    return list(found.values())


class TrainState:
    """The state list of a rank (see the module docstring): `components` in load order (the counters' checks come
    before any tensor is read)."""

    def __init__(self, components: list[Component]) -> None:
        self.components = list(components)

    @classmethod
    def of_trainer(cls, model: nn.Module, optimizer, training, optimizer_config, parallel: ParallelState, batches, *,
                   seed: int,
                   run_info: dict[str, Any],
                   full_state_dict: Callable[[], dict[str, torch.Tensor]] | None = None) -> TrainState:  # fmt: skip
        """The trainer's state list (`training`: the [training] config, `optimizer_config` the [optimizer] one;
        `full_state_dict`: the model's gather, for the model-directory export)."""
        progress = TrainProgress(seed, parallel, run_info)
        return cls([progress, DataPosition(training, batches, progress),
                    LRSchedule(optimizer_config, training.steps, progress, parallel.is_main),
                    ModelState(model, parallel, full_state_dict), OptimizerState(optimizer, parallel),
                    RankLocalState(model, parallel)])  # fmt: skip

    def _component(self, kind: type) -> Any:
        found = [c for c in self.components if isinstance(c, kind)]
        return found[0] if found else None

    @property
    def progress(self) -> TrainProgress:
        return self._component(TrainProgress)

    def export_model(self) -> dict[str, torch.Tensor] | None:
        """The whole model for a model-directory export (collective), None when the list cannot give one."""
        model = self._component(ModelState)
        return model.export() if model is not None else None

    def state_dict(self) -> StatePart:
        """Every component's part of this rank's checkpoint, merged."""
        out = StatePart()
        for c in self.components:
            out.merge(c.state_dict())
        return out

    def load_state_dict(self, source: LoadSource) -> list[str]:
        """Load every component in order; returns their notes."""
        return [note for c in self.components if (note := c.load_state_dict(source))]

    def snapshot_tensors(self) -> list[torch.Tensor]:
        return [t for c in self.components for t in c.snapshot_tensors()]

    def host_state(self) -> list:
        return [c.host_state() for c in self.components]

    def load_host_state(self, states: list) -> None:
        for c, state in zip(self.components, states):
            c.load_host_state(state)
