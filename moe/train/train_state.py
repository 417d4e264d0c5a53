"""What a training checkpoint holds of a rank, and how a rank of any layout takes its part back.

Sharded (each tensor a box of a layout-independent global tensor, see moe/train/sharded.py; resharded on load):
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moe.balancing import ExpertBias
from moe.fp8.state import ROLES, delayed_states
from moe.layer import MoELayer
from moe.parallel.sharding import tp_shard_of
from moe.train.optim import StateTensor
from moe.train.parallel import ParallelState
from moe.train.shard_files import CheckpointReader
from moe.train.sharded import Placement


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
