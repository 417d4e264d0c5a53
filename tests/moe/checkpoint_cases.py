"""Selective activation checkpointing of a 'flex' MoE layer that keeps the communication's outputs, run in every rank
of a `RankPool` by test_moe_seams.py.

mtdeepep's dispatch and combine are custom ops (`torch.ops.mtdeepep.dispatch` / `combine`), so
`torch.utils.checkpoint` with a selective policy (`moe.layer.moe_recompute.save_communication_context`) can save their
outputs and recompute the rest. Communication is counted by wrapping the buffer's `get_dispatch_layout`, `dispatch` and
`combine` (every op and every backward goes through them).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from moe import EPBuffers, MoELayer
from moe.layer.dispatcher.flex import nvl_bytes_hint
from moe.layer.moe_recompute import save_communication_context

from .ep_buffer_cases import config
from .moe_testlib import ep_group

H = 32


def _count_calls(buffer, counts: dict[str, int]) -> None:
    """Wrap the buffer's communicating methods (on the instance) so that every call bumps `counts[name]`."""
    for name in ("get_dispatch_layout", "dispatch", "combine"):
        method = getattr(buffer, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)

        setattr(buffer, name, counted)


def selective_checkpoint_does_not_communicate_again(ctx) -> dict[str, dict[str, int]]:
    """A 'flex' layer (shared expert, aux loss) run plainly, under full checkpointing and under selective
    checkpointing that saves the communication: the selective recomputation makes no call to the buffer (the same
    calls as without checkpointing: forward dispatch and combine, backward combine and dispatch), the full one
    dispatches and combines again; gradients are bitwise those without checkpointing in both. Returns the counts."""
    group = ep_group(ctx)
    ep_buffers = EPBuffers()
    counts = {"get_dispatch_layout": 0, "dispatch": 0, "combine": 0}
    _count_calls(ep_buffers.get(group, num_nvl_bytes=nvl_bytes_hint(H, ctx.world_size)), counts)
    torch.manual_seed(13)
    cfg = config(H, moe_shared_expert_intermediate_size=24, moe_aux_loss_coeff=0.01)
    layer = MoELayer(cfg, ep_group=group, ep_buffers=ep_buffers)
    gen = torch.Generator().manual_seed(50 + ctx.rank)
    x, grad_out = torch.randn(2, 7, H, generator=gen), torch.randn(2, 7, H, generator=gen)

    modes = {
        "none": layer,
        "full": lambda x: checkpoint(layer, x, use_reentrant=False),
        "selective": lambda x: checkpoint(layer, x, use_reentrant=False, context_fn=save_communication_context),
    }
    grads, calls = {}, {}
    for mode, run in modes.items():
        layer.zero_grad()
        counts.update(dict.fromkeys(counts, 0))
        x_in = x.clone().requires_grad_()
        out = run(x_in)
        (out * grad_out).sum().backward()
        calls[mode] = dict(counts)
        grads[mode] = [out.detach(), x_in.grad] + [p.grad.clone() for p in layer.parameters()]
    ep_buffers.destroy()

    assert calls["none"] == {"get_dispatch_layout": 1, "dispatch": 2, "combine": 2}, calls
    assert calls["full"] == {"get_dispatch_layout": 2, "dispatch": 3, "combine": 3}, "full recompute communicates"
    assert calls["selective"] == calls["none"], f"the selective recomputation communicated: {calls}"
    for mode in ("full", "selective"):
        assert len(grads[mode]) == len(grads["none"]) == 2 + len(list(layer.parameters()))
        for i, (a, b) in enumerate(zip(grads[mode], grads["none"])):
            assert torch.equal(a, b), f"{mode}: tensor {i} (0 output, 1 input grad, then parameter grads) differs"
    return calls


CASES = {"selective_checkpoint_does_not_communicate_again": selective_checkpoint_does_not_communicate_again}
