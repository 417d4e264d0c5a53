"""Mixture-of-Experts on mtdeepep, in two rooms.

- `moe.layer`: the MoE layer itself (router, balancing, capacity, token dispatchers, experts in BF16/FP32 and FP8,
  TP/SP building blocks). Its public names are re-exported here.
- `moe.trainer`: the training run built on it (model, pipeline, trainer, data, files, planner). It imports the
  layer room; the layer room never imports it (tests/test_import_layers.py).
"""

from moe.layer.balancing import (
    AuxLossScale,
    ExpertBias,
    GlobalAuxLossTracker,
    MoEMetrics,
    reset_global_aux_loss_tracker,
    set_aux_loss_scale,
    update_expert_bias,
)
from moe.layer.dispatcher import EPBuffers, TokenDispatcher, build_dispatcher, register_dispatcher
from moe.layer.experts import SwiGLUExperts, SwiGLUMLP
from moe.layer.fp8 import Fp8SwiGLUExperts
from moe.layer.moe_config import MoEConfig
from moe.layer.moe_layer import MoELayer
from moe.layer.router import RouterOutput, TopKRouter, node_limited_routing

__all__ = [
    "AuxLossScale",
    "EPBuffers",
    "ExpertBias",
    "Fp8SwiGLUExperts",
    "GlobalAuxLossTracker",
    "MoEConfig",
    "MoELayer",
    "MoEMetrics",
    "RouterOutput",
    "SwiGLUExperts",
    "SwiGLUMLP",
    "TokenDispatcher",
    "TopKRouter",
    "build_dispatcher",
    "node_limited_routing",
    "register_dispatcher",
    "reset_global_aux_loss_tracker",
    "set_aux_loss_scale",
    "update_expert_bias",
]
