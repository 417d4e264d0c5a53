"""Two-rank cases of the FP8 dispatch through the 'flex' (mtdeepep) dispatcher, run in a `RankPool`
(test_fp8_dispatch.py): E4M3 bytes with 1x128 scales cross the buffer, and the expert-parallel layer computes what
one process computes with the same E4M3 round trip (forward, input and router gradients)."""

from __future__ import annotations

import dataclasses

import torch

import mtdeepep as deep_ep
from moe import MoEConfig, MoELayer
from moe.layer.fp8.convert import apply_fp8

from ..moe.moe_dist_cases import load_ep_from_ref
from ..moe.moe_testlib import ep_group

CFG = MoEConfig(
    hidden_size=128, num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2,
    moe_token_dispatcher_type="flex", moe_shared_expert_intermediate_size=64,
)  # fmt: skip
TOKENS = 24


class DispatchSpy:
    """Records the payload type of every `mtdeepep.Buffer.dispatch` call of this process while active."""

    def __enter__(self):
        self.sent = []
        self._orig = deep_ep.Buffer.dispatch
        spy = self

        def dispatch(buffer, x, *args, **kwargs):
            spy.sent.append(tuple(t.dtype for t in x) if isinstance(x, tuple) else (x.dtype,))
            return spy._orig(buffer, x, *args, **kwargs)

        deep_ep.Buffer.dispatch = dispatch
        return self

    def __exit__(self, *exc):
        deep_ep.Buffer.dispatch = self._orig


def _inputs(world: int):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(world * TOKENS, CFG.hidden_size, generator=gen)
    x[::7, ::13] *= 20.0  # outliers: the 1x128 tiles must carry them
    return x, torch.randn(world * TOKENS, CFG.hidden_size, generator=gen)


def _run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.router.weight.grad


def _check(rank: int, world: int, group, recipe: str | None) -> list:
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, moe_flex_use_fp8=True)  # the wire format is chosen at build, with or without
    ref = MoELayer(cfg)  # one process: the same E4M3 round trip, no communication
    ep = load_ep_from_ref(MoELayer(cfg, ep_group=group), ref)
    if recipe is not None:
        conv_ref, conv_ep = apply_fp8(ref, recipe), apply_fp8(ep, recipe)
        assert conv_ref.fp8_dispatch == conv_ep.fp8_dispatch == [""], (conv_ref, conv_ep)
    x, g = _inputs(world)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    y_ref, gx_ref, gr_ref = _run(ref, x, g)
    with DispatchSpy() as spy:
        y, gx, gr = _run(ep, x[rows], g[rows])
    assert spy.sent and spy.sent[0] == (torch.float8_e4m3fn, torch.float32), spy.sent
    torch.testing.assert_close(y, y_ref[rows], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref[rows], rtol=1e-4, atol=1e-5)
    # The router is replicated: each rank's gradient is its tokens' share; their sum is the reference's.
    torch.distributed.all_reduce(gr, group=group)
    torch.testing.assert_close(gr, gr_ref, rtol=1e-4, atol=1e-6)
    # FP8 was applied: the output differs from the unquantised layer's by an E4M3-sized error, not by rounding.
    plain = MoELayer(dataclasses.replace(CFG))
    plain.load_state_dict(ref.state_dict())
    with torch.no_grad():
        err = (plain(x) - y_ref).norm() / y_ref.norm()
    assert 1e-3 < err < 0.1, err
    return spy.sent


def case_fp8_dispatch(ctx) -> list:
    """Only the dispatch in FP8 (config `moe_flex_use_fp8`); FP32 experts."""
    return _check(ctx.rank, ctx.world_size, ep_group(ctx), None)


def case_apply_fp8(ctx, recipe: str) -> list:
    """FP8 dispatch (built in) with FP8 experts from `apply_fp8` under `recipe` (block-wise: parity holds)."""
    return _check(ctx.rank, ctx.world_size, ep_group(ctx), recipe)
