"""`register_dispatcher` end to end: `MoEConfig` validates `moe_token_dispatcher_type` against the registry, and a
dispatcher registered here (a backend of this test, not a built-in) is built by `MoELayer` and used for forward and
backward; an unknown name is refused with the registered names listed."""

from __future__ import annotations

import re

import pytest
import torch

from moe import EPBuffers, MoEConfig, MoELayer
from moe.layer.dispatcher import (
    DispatchResult,
    TokenDispatcher,
    available_dispatchers,
    build_dispatcher,
    register_dispatcher,
    unregister_dispatcher,
)

from .moe_testlib import assert_close

pytestmark = pytest.mark.timeout(60)

H, F_HID, E = 32, 16, 8
BUILT_IN = ["allgather", "alltoall", "flex", "flex_ll"]


class ExpertLoopDispatcher(TokenDispatcher):
    """A one-process backend written for this test: each expert's rows are found with `topk_idx == e` (token order),
    and the combine adds `weight * row` per token in float32. Handle: `(token_N, weights_N, T, dtype)`."""

    def dispatch_begin(self, hidden_TH, probs_TK, topk_idx_TK):
        if self.ep_group is not None:
            raise ValueError("ExpertLoopDispatcher runs in one process")
        tokens, weights, counts = [], [], []
        for e in range(self.num_experts):
            token_n, slot_n = torch.nonzero(topk_idx_TK == e, as_tuple=True)
            tokens.append(token_n)
            weights.append(probs_TK[token_n, slot_n])
            counts.append(token_n.numel())
        token_N = torch.cat(tokens)
        handle = (token_N, torch.cat(weights), hidden_TH.size(0), hidden_TH.dtype)
        return DispatchResult(hidden_TH[token_N], counts, handle)

    def dispatch_end(self, pending: DispatchResult) -> DispatchResult:
        return pending

    def combine_begin(self, expert_output_NH, handle):
        token_N, weights_N, num_tokens, dtype = handle
        out_TH = torch.zeros(num_tokens, expert_output_NH.size(1), dtype=torch.float32)
        return out_TH.index_add(0, token_N, expert_output_NH.float() * weights_N.float().unsqueeze(1)).to(dtype)

    def combine_end(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


@pytest.fixture
def expert_loop():
    """Registers 'test_expert_loop' for one test; yields the list of `(config, ep_group, ep_buffers)` it was built
    with."""
    calls = []

    def factory(config, ep_group, ep_buffers):
        calls.append((config, ep_group, ep_buffers))
        return ExpertLoopDispatcher(num_experts=config.num_moe_experts, ep_group=ep_group)

    register_dispatcher("test_expert_loop", factory)
    try:
        yield calls
    finally:
        unregister_dispatcher("test_expert_loop")


def _config(name: str, **overrides) -> MoEConfig:
    return MoEConfig(hidden_size=H, num_moe_experts=E, moe_ffn_hidden_size=F_HID, init_method_std=0.2,
                     moe_token_dispatcher_type=name, moe_router_topk=3, moe_aux_loss_coeff=0.01,
                     moe_shared_expert_intermediate_size=24, **overrides)  # fmt: skip


def test_registered_dispatcher_runs_the_layer_forward_and_backward(expert_loop):
    ep_buffers = EPBuffers()
    cfg = _config("test_expert_loop")
    torch.manual_seed(0)
    custom = MoELayer(cfg, ep_buffers=ep_buffers)
    reference = MoELayer(_config("alltoall"))
    reference.load_state_dict(custom.state_dict())
    assert isinstance(custom.dispatcher, ExpertLoopDispatcher)
    assert expert_loop == [(cfg, None, ep_buffers)], "the factory gets (config, ep_group, ep_buffers)"

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, H, generator=gen)
    grad_out = torch.randn(2, 9, H, generator=gen)
    results = []
    for layer in (custom, reference):
        x_in = x.clone().requires_grad_()
        out = layer(x_in)
        (out * grad_out).sum().backward()
        results.append((out.detach(), x_in.grad, dict(layer.named_parameters()), layer.metrics.losses))
    (out_c, gx_c, params_c, losses_c), (out_r, gx_r, params_r, losses_r) = results
    assert_close(out_c, out_r, msg="output")
    assert_close(gx_c, gx_r, msg="input grad")
    for name, param in params_r.items():
        assert param.grad is not None and params_c[name].grad is not None, f"{name} has no grad"
        assert_close(params_c[name].grad, param.grad, msg=f"{name} grad")
    assert losses_c.keys() == losses_r.keys() == {"aux_loss"}
    assert ep_buffers.buffers() == [], "a dispatcher without mtdeepep creates no buffer"


def test_registration_rules(expert_loop):
    assert available_dispatchers() == sorted([*BUILT_IN, "test_expert_loop"])
    with pytest.raises(ValueError, match="already registered"):
        register_dispatcher("test_expert_loop", lambda *args: None)
    with pytest.raises(ValueError, match="non-empty str"):
        register_dispatcher("", lambda *args: None)
    register_dispatcher("test_not_a_dispatcher", lambda config, ep_group, ep_buffers: object())
    try:
        with pytest.raises(TypeError, match="not a TokenDispatcher"):
            build_dispatcher(_config("test_not_a_dispatcher"))
    finally:
        unregister_dispatcher("test_not_a_dispatcher")


def test_unknown_name_lists_the_registered_dispatchers(expert_loop):
    listed = re.escape(str(sorted([*BUILT_IN, "test_expert_loop"])))
    with pytest.raises(ValueError, match=rf"moe_token_dispatcher_type='deepspeed' names no .*registered: {listed}"):
        MoELayer(_config("deepspeed"))  # checked where the dispatcher is built, before any communication
    register_dispatcher("test_short_lived", lambda config, ep_group, ep_buffers: None)
    cfg = _config("test_short_lived")
    unregister_dispatcher("test_short_lived")
    # A config made while its name was registered: building the layer refuses it, listing the others.
    with pytest.raises(ValueError, match=rf"'test_short_lived' names no .*registered: {listed}"):
        MoELayer(cfg)
    with pytest.raises(ValueError, match="names no registered token dispatcher"):
        build_dispatcher(_config("test_short_lived"))
