"""The MoE layer with expert parallelism on the GPU: `MoELayer(ep_group=...)` with mtdeepep's 'flex' dispatcher
(normal-mode dispatch/combine on the CUDA executor) on ranks that share GPU 0, against the same layer in one process
on the host ('alltoall' dispatcher, ep_group=None, the weights of every expert), as tests/moe/moe_dist_cases.py does
on CPU ranks. FP32: GPU and host GEMMs differ only in summation order (TF32 is off by default for matmuls), so the
outputs and gradients agree to 1e-4 relative (1e-4 absolute for the elements near zero: sums of terms of order 1 whose
order differs).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moe import MoELayer

from ..moe.moe_dist_cases import load_ep_from_ref
from ..moe.moe_testlib import SMALL_LAYER, assert_close, moe_config
from . import gpu


def flex_layer_matches_single_process(ctx, hidden: int):
    """Forward and backward of the EP layer (each rank its own tokens) against the host layer on the same tokens:
    output, input gradient, the local experts' weight gradients and the router's gradient summed over ranks."""
    dev = gpu.device()
    cfg = moe_config({**SMALL_LAYER, "hidden_size": hidden}, moe_token_dispatcher_type="flex", moe_router_topk=2)
    torch.manual_seed(0)
    ref = MoELayer(dataclasses.replace(cfg, moe_token_dispatcher_type="alltoall"))
    ep = load_ep_from_ref(MoELayer(cfg, ep_group=ctx.group, device=dev), ref)
    gpu.assert_on_gpu(ep.experts.w13)
    gen = torch.Generator().manual_seed(7)
    chunks = [(torch.randn(48 + 8 * r, hidden, generator=gen), torch.randn(48 + 8 * r, hidden, generator=gen))
              for r in range(ctx.world_size)]  # fmt: skip
    x, grad_out = chunks[ctx.rank]
    ref_x = x.clone().requires_grad_()
    ref_out = ref(ref_x)
    (ref_out * grad_out).sum().backward()
    ep_x = x.to(dev).requires_grad_()
    ep_out = ep(ep_x)
    gpu.assert_on_gpu(ep_out)
    (ep_out * grad_out.to(dev)).sum().backward()
    router_grad = ep.router.weight.grad.cpu()
    dist.all_reduce(router_grad, group=ctx.group)
    ref_router_grads = [None] * ctx.world_size
    # The host layer saw only this rank's tokens: sum its router gradients over the ranks too.
    dist.all_gather_object(ref_router_grads, ref.router.weight.grad, group=ctx.group)
    assert_close(ep_out.detach().cpu(), ref_out.detach(), atol=1e-4, msg="output")
    assert_close(ep_x.grad.cpu(), ref_x.grad, atol=1e-4, msg="input grad")
    start, stop = ep.local_expert_start, ep.local_expert_start + ep.num_local_experts
    w13_grads = [None] * ctx.world_size
    dist.all_gather_object(w13_grads, ref.experts.w13.grad, group=ctx.group)
    assert_close(ep.experts.w13.grad.cpu(), sum(w13_grads)[start:stop], atol=1e-4, msg="w13 grad")
    # The router gradient sums ~100 tokens' hidden-wide products: at hidden 256 its elements reach ~560, and the host
    # FP32 reference itself is 1.5e-4 off a float64 run (2.7e-7 of the largest element). An absolute floor scaled by
    # the largest element (1e-6, ~8 FP32 ulps of it) allows another summation order the same error, not more.
    ref_router_grad = sum(ref_router_grads)
    atol = 1e-4 + 1e-6 * float(ref_router_grad.abs().max())
    assert_close(router_grad, ref_router_grad, atol=atol, msg="router grad summed over ranks")
