"""torchtitan 0.3.0's DeepEP V2 backend (`torchtitan/distributed/deepep/deepep.py`), unmodified, on mtdeepep's
`ElasticBuffer` with CUDA tensors: the CPU client cases of tests/clients/client_cases.py (same inputs, same float64
reference layer, same bounds) with the layer's tensors on GPU 0. torchtitan registers its custom ops for the CUDA
key, which is the key they run under here (the CPU registration of clients_env.py is not used).
"""

from __future__ import annotations

import torch

from ..clients import client_cases as cc
from ..clients import clients_env
from . import gpu


def _titan(ctx, hidden: int, capacity: int, num_topk: int):
    gpu.device()
    titan = clients_env.prepare_torchtitan()
    buffer = titan.get_buffer(ctx.group, hidden=hidden, num_max_tokens_per_rank=capacity, num_topk=num_topk)
    gpu.check_cuda_buffer(buffer)
    return titan


def torchtitan_training_round_trip(ctx, dtype_name: str):
    """get_buffer / dispatch_tokens (compact layout, autograd) / grouped experts / combine_tokens / sync_combine on
    the GPU, forward and backward, against the float64 reference layer; the routed rows against the reference
    dispatch."""
    dtype = cc.DTYPES[dtype_name]
    capacity, hidden, num_experts, num_topk = 64, 128, 8, 3
    num_tokens = capacity - 5 * ctx.rank
    weights, topk_idx, ids, scores, x, grad_out = cc._titan_inputs(
        ctx, dtype, num_tokens, hidden, num_experts, num_topk, 300
    )
    titan = _titan(ctx, hidden, capacity, num_topk)
    x_d, scores_d = gpu.cuda(x).requires_grad_(), gpu.cuda(scores).requires_grad_()
    output, routed, tokens_per_expert, _ = cc._titan_layer(
        titan, ctx, x_d, gpu.cuda(ids), scores_d, gpu.cuda(weights), num_experts, capacity
    )
    gpu.assert_on_gpu(output, routed)
    ref_dispatch = cc.reference_dispatch(ctx, cc.gather(ctx, (x, topk_idx, scores)), num_experts)
    rows, slots = (ref_dispatch.recv_topk_idx >= 0).nonzero(as_tuple=True)
    order = torch.argsort(ref_dispatch.recv_topk_idx[rows, slots], stable=True)
    assert torch.equal(gpu.host(routed.detach()), ref_dispatch.recv_x[rows[order]]), "routed rows differ"
    assert tokens_per_expert.tolist() == ref_dispatch.num_recv_tokens_per_expert
    (output.float() * gpu.cuda(grad_out)).sum().backward()
    assert output.dtype == dtype and output.shape == x.shape
    cc.assert_layer_bounded(
        ctx, (x, topk_idx, scores, weights, grad_out),
        (gpu.host(output.detach()), gpu.host(x_d.grad), gpu.host(scores_d.grad)), dtype,
        (num_topk + 3, num_topk + 1, 3), before_x=2, names=("output", "x.grad", "scores.grad"),
    )  # fmt: skip
    assert not titan._handle_cache, "torchtitan's handle cache should be empty after the backward"


def torchtitan_inference_expanded_layout(ctx):
    """Inference (`cudagraphable=True` under no_grad): the expanded layout with no host synchronisation, per-expert
    counts from the device-side prefix sums; the output against the reference layer."""
    dtype = torch.bfloat16
    capacity, hidden, num_experts, num_topk = 48, 128, 8, 3
    num_local = num_experts // ctx.world_size
    num_tokens = capacity - 4 * ctx.rank
    weights, topk_idx, ids, scores, x, grad_out = cc._titan_inputs(
        ctx, dtype, num_tokens, hidden, num_experts, num_topk, 400
    )
    titan = _titan(ctx, hidden, capacity, num_topk)
    with torch.no_grad():
        output, routed, tokens_per_expert, state = cc._titan_layer(
            titan, ctx, gpu.cuda(x), gpu.cuda(ids), gpu.cuda(scores), gpu.cuda(weights), num_experts, capacity,
            cudagraphable=True,
        )  # fmt: skip
        assert state.cudagraphable, "the expanded (inference) path was not taken"
        assert routed.size(0) == ctx.world_size * capacity * min(num_topk, num_local), routed.size(0)
        ref_dispatch = cc.reference_dispatch(ctx, cc.gather(ctx, (x, topk_idx, scores)), num_experts)
        assert tokens_per_expert.tolist() == ref_dispatch.num_recv_tokens_per_expert
    ref = cc.Reference(x, topk_idx, scores, weights, grad_out)
    # Expert rows (1), score product (2), the expert rank's reduction of a row's slots (1), combine (1).
    cc.assert_bounded("output", gpu.host(output), ref.out, ref.mag_out, dtype, 5, hidden + ctx.world_size + num_topk)
