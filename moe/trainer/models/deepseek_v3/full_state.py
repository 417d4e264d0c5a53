"""Full (layout-independent) state dicts of a model whose routed experts are sharded over an expert-parallel group.

The full state dict is the model's `state_dict()` with:
- routed expert weights (`*.mlp.experts.w13` `[E, H, 2F]`, `*.mlp.experts.w2` `[E, F, H]`) holding every expert,
  in global expert order (gathered over the EP group: rank r holds experts `[r*L, (r+1)*L)`; with expert tensor
  parallelism over the folded EP x ETP group, the ETP shards of each expert joined along F);
- tensor-parallel shards (parameters tagged `tensor_parallel_shard`, see moe/layer/parallel/sharding.py: the vocabulary
  rows of the embedding and head, MLA's up projections by heads and `o_proj` by input columns, the dense MLP's FFN
  columns) gathered whole over the TP group;
- the expert-bias token counts (`*.expert_bias.counts`) left out: they only live between two bias updates.
Everything else is replicated on every rank and taken from this rank. Tensors keep their dtype (the router weight
and the expert bias are float32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe.layer.balancing import group_size
from moe.layer.moe_layer import MoELayer
from moe.layer.parallel.sharding import gather_shards, tp_shard_of

EXPERT_PARAMS = ("w13", "w2")
TRANSIENT_SUFFIXES = (".expert_bias.counts",)


def _expert_tensors(model: nn.Module) -> dict[str, tuple[MoELayer, torch.Tensor]]:
    """Full key -> (MoE layer, local parameter) of every routed expert weight."""
    found = {}
    for name, mod in model.named_modules():
        if isinstance(mod, MoELayer):
            for pname in EXPERT_PARAMS:
                found[f"{name}.experts.{pname}"] = (mod, getattr(mod.experts, pname))
    return found


def full_state_dict(model: nn.Module, tp_group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The full state dict (see the module docstring). Collective over the MoE layers' dispatch group (EP, or the
    folded EP x ETP group) and `tp_group` when they have more than one rank: every rank must call it, and every
    rank gets the whole dict. Replicated tensors are detached
    views of the parameters (clone them to keep a snapshot while training goes on); gathered weights are new
    tensors."""
    experts = _expert_tensors(model)
    out = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key.endswith(TRANSIENT_SUFFIXES):
            continue
        shard = tp_shard_of(tensor)
        if key in experts and group_size(experts[key][0].dispatcher.ep_group) > 1:
            out[key] = _gather_experts(experts[key][0], tensor)
        elif shard is not None and shard.size > 1:
            out[key] = gather_shards(tensor, shard, tp_group)
        else:
            out[key] = tensor.detach()
    return out


def _gather_experts(layer: MoELayer, local: torch.Tensor) -> torch.Tensor:
    """Every expert of `local` (this rank's experts, or with ETP their shards), gathered over the layer's dispatch
    group: rank `i * etp + j` holds shard j of EP rank i's experts. Gathered as bytes: any dtype crosses any
    backend (gloo has no float8, for instance)."""
    group = layer.dispatcher.ep_group
    raw = local.detach().contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(group_size(group))]
    dist.all_gather(parts, raw, group=group)
    parts = [p.view(local.dtype).view(local.shape) for p in parts]
    shard = tp_shard_of(local)
    if shard is not None and shard.size > 1:  # the ETP shards of each EP rank's experts, made whole
        parts = [shard.unshard(parts[i : i + shard.size]) for i in range(0, len(parts), shard.size)]
    return torch.cat(parts)


def full_state_dict_shapes(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Key -> (full shape, dtype) of the full state dict, without communication."""
    experts = _expert_tensors(model)
    shapes = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key.endswith(TRANSIENT_SUFFIXES):
            continue
        shape = tensor.shape
        shard = tp_shard_of(tensor)
        if shard is not None:
            shape = shard.full_shape(shape)
        if key in experts:
            layer = experts[key][0]
            shape = torch.Size((layer.config.num_moe_experts, *shape[1:]))
        shapes[key] = (shape, tensor.dtype)
    return shapes


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full state dict: this rank keeps its experts' slice. Every key of the full state dict must be present
    with its full shape, and no other (ValueError naming them). Values are cast to each tensor's dtype and device."""
    shapes = full_state_dict_shapes(model)
    missing, unexpected = sorted(set(shapes) - set(state_dict)), sorted(set(state_dict) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing keys {missing[:20]}, unexpected keys {unexpected[:20]}")
    bad = [
        f"{k}: {tuple(state_dict[k].shape)} != {tuple(shape)}"
        for k, (shape, _) in shapes.items()
        if state_dict[k].shape != shape
    ]
    if bad:
        raise ValueError(f"state dict shapes differ from the model's: {bad[:20]}")
    experts = _expert_tensors(model)
    own = model.state_dict(keep_vars=True)
    for key in shapes:
        value = state_dict[key]
        if key in experts:
            layer = experts[key][0]
            value = value[layer.local_expert_start : layer.local_expert_start + layer.num_local_experts]
        shard = tp_shard_of(own[key])
        if shard is not None:
            value = shard.shard(value)
        own[key].copy_(value)
