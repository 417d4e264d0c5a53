"""Cases for `EPBuffers` (one mtdeepep buffer per process group and mode, shared by the layers), run in every rank of
a `RankPool` by test_moe_seams.py. Collectives of a case run before its assertions.

What is counted: the shared-memory segments this process created (`/proc/self/maps`: an mtdeepep segment stays
mapped, unlinked, while its buffer lives; a rank maps its own and its peers'), their bytes, and the threads of the
process (each buffer runs a comm thread).
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from torch import nn

import mtdeepep as deep_ep
from moe import EPBuffers, MoEConfig, MoELayer
from moe.layer.dispatcher.buffers import default_ep_buffers
from moe.layer.dispatcher.flex import nvl_bytes_hint
from moe.layer.dispatcher.flex_ll import low_latency_rdma_bytes

from .moe_testlib import ep_group

E = 8
NUM_LAYERS = 4


def own_segments() -> dict[str, int]:
    """The mtdeepep shared-memory segments this process created and still maps: name -> bytes."""
    prefix = f"/dev/shm/mtdeepep-u{os.getuid()}-p{os.getpid()}-"
    segments = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(prefix):
                start, end = (int(v, 16) for v in fields[0].split("-"))
                segments[fields[5]] = segments.get(fields[5], 0) + end - start
    return segments


def num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def config(hidden: int, dispatcher: str = "flex", **overrides) -> MoEConfig:
    return MoEConfig(hidden_size=hidden, num_moe_experts=E, moe_ffn_hidden_size=16, init_method_std=0.2,
                     moe_token_dispatcher_type=dispatcher, moe_router_topk=3, **overrides)  # fmt: skip


def tokens(ctx, num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """`[num_tokens + 3 * rank, hidden]` float32 tokens of this rank."""
    gen = torch.Generator().manual_seed(100 * seed + ctx.rank)
    return torch.randn(num_tokens + 3 * ctx.rank, hidden, generator=gen)


def layers_share_one_buffer(ctx) -> dict[str, int]:
    """N 'flex' layers on one `EPBuffers` create one buffer (one segment, one comm thread per rank); N layers with an
    `EPBuffers` each create N. Layers given none share the group's default. Returns the measured figures."""
    group = ep_group(ctx)
    cfg = config(32)
    x = tokens(ctx, 12, 32, seed=1)
    with torch.no_grad():
        MoELayer(config(32, "alltoall"), ep_group=group)(x)  # warm-up: threads torch starts lazily
    gc.collect()  # buffers of earlier cases are gone
    segments_0, threads_0 = own_segments(), num_threads()

    shared = EPBuffers()
    layers = [MoELayer(cfg, ep_group=group, ep_buffers=shared) for _ in range(NUM_LAYERS)]
    with torch.no_grad():
        for layer in layers:
            layer(x)
    segments_1, threads_1 = own_segments(), num_threads()

    separate = [MoELayer(cfg, ep_group=group, ep_buffers=EPBuffers()) for _ in range(NUM_LAYERS)]
    with torch.no_grad():
        for layer in separate:
            layer(x)
    segments_2, threads_2 = own_segments(), num_threads()

    defaults = [MoELayer(cfg, ep_group=group) for _ in range(2)]
    with torch.no_grad():
        for layer in defaults:
            layer(x)
    default_pool = default_ep_buffers(group)
    on_default = all(layer.dispatcher.ep_buffers is default_pool for layer in defaults)
    default_created = default_pool.num_created
    default_buffers = [layer.dispatcher.buffer for layer in defaults]
    shared_buffers = {id(layer.dispatcher.buffer) for layer in layers}
    separate_buffers = {id(layer.dispatcher.buffer) for layer in separate}
    shared.destroy()
    for layer in separate:
        layer.dispatcher.ep_buffers.destroy()
    del defaults, default_pool  # the last users of the group's default EPBuffers: they go, with their buffer

    new_shared = set(segments_1) - set(segments_0)
    new_separate = set(segments_2) - set(segments_1)
    assert shared.num_created == 1 and len(shared_buffers) == 1, "one buffer for every layer"
    assert len(separate_buffers) == NUM_LAYERS
    assert len(new_shared) == 1, f"one segment for {NUM_LAYERS} layers, got {len(new_shared)}"
    assert len(new_separate) == NUM_LAYERS, f"{NUM_LAYERS} segments for as many owners, got {len(new_separate)}"
    comm_threads = threads_1 - threads_0
    assert comm_threads >= 1 and threads_2 - threads_1 == NUM_LAYERS * comm_threads
    assert on_default and default_created == 1 and default_buffers[0] is default_buffers[1]
    with pytest.raises(deep_ep.CommError, match="destroyed"):
        default_buffers[0].get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64), E)
    return {
        "shared_segment_bytes": sum(segments_1[name] for name in new_shared),
        "separate_segment_bytes": sum(segments_2[name] for name in new_separate),
        "comm_threads_per_buffer": comm_threads,
    }


class _Model(nn.Module):
    """MoE(32) -> MoE(32) -> Linear(32, 64) -> MoE(64) -> Linear(64, 32) -> MoE(32): the third MoE layer needs a
    larger normal-mode buffer than the first two."""

    def __init__(self, group, ep_buffers_of) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.moe = nn.ModuleList(
            MoELayer(config(h, moe_aux_loss_coeff=0.01), ep_group=group, ep_buffers=ep_buffers_of(i))
            for i, h in enumerate((32, 32, 64, 32))
        )
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        x = self.moe[1](self.moe[0](x))
        return self.moe[3](self.down(self.moe[2](self.up(x))))


def _step(model: _Model, x: torch.Tensor, grad_out: torch.Tensor):
    model.zero_grad()
    x = x.clone().requires_grad_()
    out = model(x)
    (out * grad_out).sum().backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]


def growth_and_per_layer_parity(ctx) -> None:
    """A model whose third layer needs more: the shared `EPBuffers` creates a buffer, replaces it by a larger one
    (the first two layers' backward still runs on the first, which is released afterwards), and creates nothing on
    the next step, where every layer runs on the larger one. Outputs and gradients are bitwise those of the same
    model with a buffer per layer, on both steps."""
    group, R = ep_group(ctx), ctx.world_size
    shared = EPBuffers()
    model = _Model(group, lambda i: shared)
    per_layer = _Model(group, lambda i: EPBuffers())
    per_layer.load_state_dict(model.state_dict())
    first = []
    model.moe[0].register_forward_hook(lambda *_: first.append(weakref.ref(model.moe[0].dispatcher.buffer)))

    results, per_layer_results = [], []
    for step in range(2):
        x, g = tokens(ctx, 10, 32, seed=20 + step), tokens(ctx, 10, 32, seed=30 + step)
        results.append(_step(model, x, g))
        gc.collect()
        per_layer_results.append(_step(per_layer, x, g))
        if step == 0:
            created_after_first_step, first_released = shared.num_created, first[0]() is None
    buffers = {id(layer.dispatcher.buffer) for layer in model.moe}
    grown = model.moe[0].dispatcher.buffer
    sizes = [layer.dispatcher.buffer.num_nvl_bytes for layer in per_layer.moe]
    shared.destroy()
    for layer in per_layer.moe:
        layer.dispatcher.ep_buffers.destroy()

    assert created_after_first_step == 2, "created, then replaced by a larger one"
    assert first_released, "the replaced buffer is released once its layers' backward ran"
    assert shared.num_created == 2, "no buffer created on the second step"
    assert len(buffers) == 1 and grown.num_nvl_bytes == nvl_bytes_hint(64, R)
    assert sizes == [nvl_bytes_hint(h, R) for h in (32, 32, 64, 32)]
    for step, (got, expected) in enumerate(zip(results, per_layer_results)):
        assert len(got) == len(expected) == 2 + len(list(model.parameters()))
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), f"step {step}: tensor {i} (0 output, 1 input grad, then parameter grads)"


def modes_share_per_mode(ctx) -> None:
    """One `EPBuffers` holds a normal and a low-latency buffer; 'flex_ll' layers with different T_max share one
    low-latency buffer, grown to the larger hint, with bitwise the outputs of a buffer per layer."""
    group, R, H = ep_group(ctx), ctx.world_size, 64
    shared = EPBuffers()
    t_max = (8, 16)
    x = torch.randn(5 + ctx.rank, H, generator=torch.Generator().manual_seed(40 + ctx.rank)).to(torch.bfloat16)
    outputs = {}
    for name, pool_of in (("shared", lambda: shared), ("separate", EPBuffers)):
        torch.manual_seed(12)
        layers = [
            MoELayer(config(H, "flex_ll", moe_flex_ll_num_max_dispatch_tokens_per_rank=t), ep_group=group,
                     ep_buffers=pool_of(), dtype=torch.bfloat16)
            for t in t_max
        ]  # fmt: skip
        flex = MoELayer(config(H), ep_group=group, ep_buffers=pool_of(), dtype=torch.bfloat16)
        with torch.no_grad():
            outputs[name] = [flex(layers[1](layers[0](x)))]
            outputs[name].append(layers[1](layers[0](x)))  # again: every layer on the grown buffer
        if name == "shared":
            modes = sorted((b.low_latency_mode, b.num_nvl_bytes, b.num_rdma_bytes) for b in shared.buffers())
            ll_buffers = {id(layer.dispatcher.buffer) for layer in layers}
    shared.destroy()

    assert modes == [(False, nvl_bytes_hint(H, R), 0), (True, 0, low_latency_rdma_bytes(16, H, R, E))]
    assert len(ll_buffers) == 1 and shared.num_created == 3, "normal, low-latency, low-latency grown"
    for a, b in zip(outputs["shared"], outputs["separate"]):
        assert torch.equal(a, b)


def lifetime(ctx) -> None:
    """`destroy()` and the owner's collection destroy every buffer still alive; `get` after `destroy()` raises;
    a replaced buffer still held (here by the test) is destroyed with its owner."""
    group = ep_group(ctx)
    pool = EPBuffers()
    small = pool.get(group, num_nvl_bytes=1 << 16)
    same = pool.get(group, num_nvl_bytes=1 << 12)
    large = pool.get(group, num_nvl_bytes=1 << 17)
    larger_rdma = pool.get(group, num_nvl_bytes=1 << 12, num_rdma_bytes=1 << 16)
    pool.destroy()
    pool.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="destroyed"):
        pool.get(group, num_nvl_bytes=1)
    collected = EPBuffers()
    kept = collected.get(group, num_nvl_bytes=1 << 16)
    del collected
    gc.collect()

    assert same is small and large is not small and large.num_nvl_bytes == 1 << 17
    assert larger_rdma.num_nvl_bytes == 1 << 17 and larger_rdma.num_rdma_bytes == 1 << 16, "grown, never shrunk"
    for buffer in (small, large, larger_rdma, kept):
        with pytest.raises(deep_ep.CommError, match="destroyed"):
            buffer.get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64), E)


CASES = {
    "ep_buffers_layers_share_one_buffer": layers_share_one_buffer,
    "ep_buffers_growth_and_per_layer_parity": growth_and_per_layer_parity,
    "ep_buffers_modes_share_per_mode": modes_share_per_mode,
    "ep_buffers_lifetime": lifetime,
}
