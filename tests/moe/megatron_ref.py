"""megatron-core (0.19.2) as the reference for the MoE numerics: its real `TopKRouter` and `moe_utils` on the CPU.

Two things stand in the way on a CPU-only machine, and this module handles both, for the tests only:
- `import megatron.core...` runs megatron.core's package __init__, which (through the pipeline schedules) imports
  the MoE paged-stash kernels, `megatron/core/transformer/moe/ops/paged_stash.py`, whose first line is
  `import triton`. Triton is a GPU compiler and is not installed; the router and loss code used here never calls
  those kernels, so a stand-in for that one module (its kernels raise if called) is registered before megatron is
  imported. A stand-in `triton` package would not do: torch._dynamo would see it and then need the real one.
- Megatron's router puts its buffers and weight on `torch.cuda.current_device()`; `on_cpu()` points that at the
  CPU while a router is built or run. It also runs the functions megatron wraps in `torch.compile` (its router's
  expert-bias counting) eagerly: the same operations, without compiling C++ kernels on the CPU for every test.

megatron-core is installed without its dependencies (`pip install --no-deps --ignore-requires-python
megatron-core==0.19.2`); the router code needs only torch, numpy and packaging.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

import torch

from moe import MoEConfig

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _kernel_unavailable(*args, **kwargs):
    raise RuntimeError("megatron's paged-stash kernels need triton, which these tests stand in for")


if _PAGED_STASH not in sys.modules:
    _stub = types.ModuleType(_PAGED_STASH)
    _stub.GLOBAL_BLOCK_SIZE = 1024
    _stub.paged_stash_copy_kernel = _stub.paged_stash_pop_kernel = _kernel_unavailable
    sys.modules[_PAGED_STASH] = _stub

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron warns about optional packages (TE, apex, absl) it does not need here
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["TransformerConfig", "moe_utils", "megatron_config", "megatron_router", "on_cpu", "recorded_losses"]

# Our MoEConfig fields that are Megatron's TransformerConfig fields under the same name and meaning.
SHARED_FIELDS = (
    "hidden_size",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_dtype",
    "moe_input_jitter_eps",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
    "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy",
)

# Megatron's metric name of each loss (the router records `loss / coefficient` under it).
METRIC_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
    "z_loss": "z_loss",
}


@contextlib.contextmanager
def on_cpu():
    """Megatron's router asks `torch.cuda.current_device()` where to put its tensors: answer 'cpu' meanwhile (and
    run torch.compile'd functions eagerly)."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        torch.cuda.current_device = saved


def megatron_config(cfg: MoEConfig, **overrides) -> TransformerConfig:
    """Megatron's TransformerConfig with our config's router settings copied field by field (same names)."""
    fields = {name: getattr(cfg, name) for name in SHARED_FIELDS}
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if isinstance(fields[name], tuple):
            fields[name] = list(fields[name])
    base = dict(num_layers=1, num_attention_heads=1, add_bias_linear=False, init_method_std=cfg.init_method_std)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="full scope is deprecated")  # a CUDA-graph default, unused here
        return TransformerConfig(**{**base, **fields, **overrides})


def megatron_router(
    cfg: MoEConfig,
    weight: torch.Tensor,
    *,
    tp_cp_group,
    tp_dp_cp_group,
    expert_bias: torch.Tensor | None = None,
    **overrides,
) -> TopKRouter:
    """Megatron's TopKRouter (layer 1 of 1) on the CPU, with our router's weight (and expert bias) copied in.

    `tp_cp_group`: the ranks that split the tokens of the same sequences; `tp_dp_cp_group`: every rank with
    different tokens of the global batch (what 'global_aux_loss' sums over).
    """
    pgs = ProcessGroupCollection(tp=tp_cp_group, cp=tp_cp_group, tp_cp=tp_cp_group, tp_dp_cp=tp_dp_cp_group)
    with on_cpu():
        router = TopKRouter(megatron_config(cfg, **overrides), pg_collection=pgs)
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(weight)
        if expert_bias is not None:
            router.expert_bias.copy_(expert_bias)
    return router


def run_router(router: TopKRouter, x_SBH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(probs [S*B, E], routing_map [S*B, E] bool)` of Megatron's router on `x [S, B, H]` (sequence-major)."""
    with on_cpu():
        return router(x_SBH)


def recorded_losses(coeffs: dict[str, float], z_loss_coeff: float | None, tp_cp_size: int = 1):
    """Losses Megatron's router recorded since the last call, coefficients applied as its router applies them
    (the z-loss coefficient divided by the tensor/context-parallel size); clears the tracker."""
    tracker = get_moe_metrics_tracker()
    out = {}
    for kind, coeff in coeffs.items():
        out[kind] = tracker.metrics[METRIC_NAMES[kind]].values[0] * coeff
    if z_loss_coeff:
        out["z_loss"] = tracker.metrics["z_loss"].values[0] * z_loss_coeff / tp_cp_size
    tracker.clear()
    return out
