"""Deterministic weight initialisation that does not depend on the parallel layout.

Every tensor is drawn from its own generator, seeded by `(seed, full parameter name)`; routed experts by
`(seed, name, global expert index)`; a tensor-parallel shard draws its whole tensor and keeps its slice. So a model
sharded over any number of expert- or tensor-parallel ranks holds exactly the
slice of the weights the one-process model holds, and a part built on its own (e.g. the MTP modules added on
import) gets the values it would have in the whole model, given the same name prefix.

Distributions (transformers' `_init_weights` for DeepSeek-V3): linear, embedding, router and expert weights
`N(0, initializer_range)`; linear biases and the expert bias zero; RMSNorm weights one. Values are drawn in float32
and cast to the parameter's dtype, so every dtype starts from the same numbers (rounded).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from moe.layer.experts import SwiGLUExperts, SwiGLUMLP
from moe.layer.moe_layer import MoELayer
from moe.layer.parallel.sharding import TPShard, tp_shard_of
from moe.layer.router import TopKRouter
from moe.trainer.models.deepseek_v3.norm import RMSNorm


def draw_seed() -> int:
    """A base seed from torch's global generator (one draw): the same on every rank seeded alike."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@torch.no_grad()
def _normal_(param: torch.Tensor, std: float, seed: int, name: str, shard: TPShard | None = None) -> None:
    # A tensor-parallel shard draws the whole tensor and keeps its slice: the same values at any TP size. `shard`:
    # the geometry of a view that does not carry the tag (one expert of an ETP-sharded expert tensor).
    shard = shard if shard is not None else tp_shard_of(param)
    shape = param.shape if shard is None else shard.full_shape(param.shape)
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=_generator(seed, name))
    param.copy_(values if shard is None else shard.shard(values))


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, std: float, prefix: str = "") -> None:
    """Initialise every parameter and balancing buffer of `module` (see the module docstring).

    Args:
        seed: the base seed (`draw_seed()`).
        std: `initializer_range`.
        prefix: the module's name inside the whole model (e.g. `"mtp.0."`), so its values match the whole model's.
    Meta tensors are skipped.
    """
    for mod_name, mod in module.named_modules():
        name = prefix + (mod_name + "." if mod_name else "")
        if isinstance(mod, RMSNorm):
            if not mod.weight.is_meta:
                mod.weight.fill_(1.0)
        elif isinstance(mod, (nn.Linear, nn.Embedding)):
            if not mod.weight.is_meta:
                _normal_(mod.weight, std, seed, name + "weight")
            if getattr(mod, "bias", None) is not None and not mod.bias.is_meta:
                mod.bias.zero_()
        elif isinstance(mod, TopKRouter):
            if not mod.weight.is_meta:
                _normal_(mod.weight, std, seed, name + "weight")
            if mod.expert_bias is not None and not mod.expert_bias.bias.is_meta:
                mod.expert_bias.bias.zero_()
                mod.expert_bias.counts.zero_()
        elif isinstance(mod, SwiGLUMLP):
            for pname in ("w13", "w2"):
                param = getattr(mod, pname)
                if not param.is_meta:
                    _normal_(param, std, seed, name + pname)
        elif isinstance(mod, MoELayer):
            _init_experts(mod, seed, std, name + "experts.")


def _init_experts(layer: MoELayer, seed: int, std: float, name: str) -> None:
    experts: SwiGLUExperts = layer.experts
    for pname in ("w13", "w2"):
        param = getattr(experts, pname)
        if param.is_meta:
            continue
        # Under expert tensor parallelism each expert is drawn whole and this rank keeps its shard (same weights at
        # any etp); the tensor's shard dims count the expert dim, one expert's do not.
        shard = tp_shard_of(param)
        one = None if shard is None else TPShard(shard.dim - 1, shard.chunks, shard.rank, shard.size)
        for local in range(layer.num_local_experts):
            _normal_(param[local], std, seed, f"{name}{pname}.{layer.local_expert_start + local}", one)
