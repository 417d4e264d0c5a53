"""Mixture-of-Experts layer: router, balancing, capacity, token dispatchers, experts (BF16/FP32 and FP8)."""

from moe.layer.balancing import (
    AuxLossScale,
    ExpertBias,
    GlobalAuxLossTracker,
    MoEMetrics,
    reset_global_aux_loss_tracker,
    set_aux_loss_scale,
    update_expert_bias,
)
from moe.layer.config import MoEConfig
from moe.layer.dispatcher import EPBuffers, TokenDispatcher, build_dispatcher, register_dispatcher
from moe.layer.experts import SwiGLUExperts, SwiGLUMLP
from moe.layer.fp8 import Fp8SwiGLUExperts
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
