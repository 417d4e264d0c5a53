"""Rank cases of test_zero.py: the ZeRO-1 optimizer (moe/trainer/train/zero.py) against MasterAdamW on the same ranks
and data, and against one process holding the gradients of the global loss (tensor/sequence/expert-parallel tags)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.trainer.train.optim import MasterAdamW
from moe.trainer.train.parallel_state import Layout, ParallelState
from moe.trainer.train.training_config import OptimizerConfig
from moe.trainer.train.zero import CollectiveTimeout, DistributedAdamW, ZeroConfig
from tests.train.optim_step import optimizer_step
from tests.train.state_io import gathered_state, load_state, save_state

E = 4  # experts of the fake MoE layer
D_IN, WIDTH = 12, 20


class Net(nn.Module):
    """An MLP with a vector parameter (no weight decay) and a fake expert layer: token t goes through local expert
    t % num_local (each rank's tokens use its own experts, so the expert gradients are summed over the expert-dp
    group, as after a real dispatch). Parameters drawn from one generator (the same on every rank); the experts
    are this EP rank's slice of the E experts."""

    def __init__(self, ep: int, ep_rank: int, dtype=torch.float32, depth: int = 2) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(D_IN, WIDTH)
        self.hidden = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.out = nn.Linear(WIDTH, D_IN)
        self.norm = nn.Parameter(torch.empty(WIDTH))
        full = torch.randn(E, WIDTH, WIDTH, generator=gen) / WIDTH**0.5
        n = E // ep
        self.experts = nn.Parameter(full[ep_rank * n : (ep_rank + 1) * n].clone())
        self.experts.expert_parallel = True
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name != "experts":
                    p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0))
        self.to(dtype)

    def forward(self, x):
        h = F.gelu(self.inp(x)) * self.norm
        which = torch.arange(x.size(0)) % self.experts.size(0)
        h = h + torch.einsum("tw,twv->tv", h, self.experts[which])
        for layer in self.hidden:
            h = h + F.gelu(layer(h))
        return self.out(h)


def config(clip: float) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=clip)


def batch(rank: int, step: int, micro: int, rows: int = 6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(rows, D_IN, generator=gen).to(dtype), torch.randn(rows, D_IN, generator=gen).to(dtype)


def train(model: Net, opt, parallel: ParallelState, steps: int, micro: int, zero: bool):
    """`steps` optimizer steps of `micro` micro-batches each; the loss is this rank's share of a global sum
    (so the global gradient is the sum of the ranks' gradients). Returns the grad norms."""
    norms = []
    world = parallel.layout.world
    for step in range(1, steps + 1):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(parallel.rank, step, m, dtype=model.norm.dtype)
            ctx = opt.accumulation_context(m, micro) if zero else _null()
            with ctx:
                loss = F.mse_loss(model(x).float(), y.float(), reduction="sum") / (world * micro * x.numel())
                loss.backward()
        norms.append(optimizer_step(opt, step))
    return norms


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def parity_case(ctx, ep: int, steps: int, micro: int, clip: float, bucket_size: int | None, run_dir: str,
                dtype=torch.float32):  # fmt: skip
    """MasterAdamW and ZeRO-1 from the same initial model and data on this rank; returns both runs' norms,
    parameters, full states (checkpointed under `run_dir`, read back whole) and state bytes."""
    par = ParallelState.from_process_group(Layout(world=ctx.world_size, ep=ep))
    ref_model = Net(ep, par.ep_rank, dtype)
    ref = MasterAdamW(ref_model, [ref_model.experts], config(clip), par)
    ref_norms = train(ref_model, ref, par, steps, micro, zero=False)
    model = Net(ep, par.ep_rank, dtype)
    opt = DistributedAdamW(model, [], config(clip), par, ZeroConfig(bucket_size=bucket_size, timeout_s=60))
    norms = train(model, opt, par, steps, micro, zero=True)
    opt.remove_hooks()
    return {
        "ref": (ref_norms, _params(ref_model), gathered_state(ref, par, f"{run_dir}/ref"), ref.state_bytes_per_rank()),
        "zero": (norms, _params(model), gathered_state(opt, par, f"{run_dir}/zero"), opt.state_bytes_per_rank()),
        "buckets": [(b.kind, b.numel, b.group_size, sum(e.numel for e in b.entries)) for b in opt.buckets],
        "straddling": _straddling(opt),
        "dp": par.layout.dp,
        "expert_dp": par.layout.expert_dp,
    }


def _straddling(opt: DistributedAdamW) -> int:
    """Parameters whose elements lie in more than one rank's shard of their bucket."""
    n = 0
    for b in opt.buckets:
        for e in b.entries:
            first, last = e.offset // b.shard_size, (e.offset + e.numel - 1) // b.shard_size
            n += first != last
    return n


def state_swap_case(ctx, ep: int, bucket_size: int, run_dir: str):
    """Checkpoint round trips: a MasterAdamW state loaded into ZeRO-1 gathers back equal, and both optimizers
    continue with the same next step from it; a ZeRO-1 state loads into MasterAdamW."""
    par = ParallelState.from_process_group(Layout(world=ctx.world_size, ep=ep))
    cfg = config(1.0)
    ref_model = Net(ep, par.ep_rank)
    ref = MasterAdamW(ref_model, [ref_model.experts], cfg, par)
    train(ref_model, ref, par, 2, 1, zero=False)
    ref_path = save_state(ref, par, f"{run_dir}/ref")
    state = gathered_state(ref, par, f"{run_dir}/ref_again")
    # a ZeRO-1 optimizer on a model holding the same weights, loaded from MasterAdamW's state
    model = Net(ep, par.ep_rank)
    model.load_state_dict(ref_model.state_dict())
    opt = DistributedAdamW(model, [], cfg, par, ZeroConfig(bucket_size=bucket_size, timeout_s=60))
    load_state(opt, par, ref_path, ref.steps)
    back = gathered_state(opt, par, f"{run_dir}/back")
    # one more step on both (step 3 of the data)
    for o, m in ((ref, ref_model), (opt, model)):
        o.zero_grad()
        x, y = batch(par.rank, 3, 0)
        (F.mse_loss(m(x), y, reduction="sum") / (ctx.world_size * x.numel())).backward()
        o.reduce_gradients()
        o.clip(o.global_grad_norm())
        o.step(lr=3e-2)
    # and ZeRO-1's state into a fresh MasterAdamW
    other_model = Net(ep, par.ep_rank)
    other = MasterAdamW(other_model, [other_model.experts], cfg, par)
    zero_path = save_state(opt, par, f"{run_dir}/zero")
    zero_state = gathered_state(opt, par, f"{run_dir}/zero_again")
    load_state(other, par, zero_path, opt.steps)
    opt.remove_hooks()
    return state, back, _params(ref_model), _params(model), zero_state, gathered_state(other, par, f"{run_dir}/other")


class Tagged(nn.Module):
    """Parameters with the contract's tags, each used once: `col` a TP shard (tensor_parallel_dim=0) of an [8, 6]
    matrix, `norm` TP-replicated with a partial gradient per TP rank (sequence_parallel_grad), `bias` TP-replicated
    with the full gradient, `experts` this EP rank's experts of [E, 3, 3]. Their gradients are prescribed: the
    loss is `sum(p * G)`, so `p.grad = G` exactly."""

    def __init__(self, tp: int, tp_rank: int, ep: int, ep_rank: int) -> None:
        super().__init__()
        full = full_tagged()
        r, n = 8 // tp, E // ep
        self.col = nn.Parameter(full["col"][tp_rank * r : (tp_rank + 1) * r].clone())
        self.col.tensor_parallel_dim = 0
        self.norm = nn.Parameter(full["norm"].clone())
        self.norm.sequence_parallel_grad = True
        self.experts = nn.Parameter(full["experts"][ep_rank * n : (ep_rank + 1) * n].clone())
        self.experts.expert_parallel = True


def full_tagged() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"col": torch.randn(8, 6, generator=gen), "norm": torch.randn(6, generator=gen),
            "experts": torch.randn(E, 3, 3, generator=gen)}  # fmt: skip


def tagged_grads(rank: int, step: int, tp: int, ep: int, tp_rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s gradients at `step` (local shapes)."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return {"col": torch.randn(8 // tp, 6, generator=gen), "norm": torch.randn(6, generator=gen),
            "experts": torch.randn(E // ep, 3, 3, generator=gen)}  # fmt: skip


def tagged_case(ctx, tp: int, ep: int, steps: int, clip: float, bucket_size: int):
    par = ParallelState.from_process_group(Layout(world=ctx.world_size, tp=tp, ep=ep))
    model = Tagged(tp, par.tp_rank, ep, par.ep_rank)
    opt = DistributedAdamW(model, [], config(clip), par, ZeroConfig(bucket_size=bucket_size, timeout_s=60))
    norms = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        g = tagged_grads(par.rank, step, tp, ep, par.tp_rank, par.ep_rank)
        sum((getattr(model, k) * g[k]).sum() for k in g).backward()
        norms.append(optimizer_step(opt, step))
    opt.remove_hooks()
    return par.tp_rank, par.ep_rank, norms, _params(model)


def overlap_case(ctx, overlap: bool, steps: int = 3, width: int = 384, depth: int = 8, bucket_size: int = 150_000):
    """A deeper MLP (one bucket per ~1 layer): per step, the launch times of the buckets, the end of the backward
    and the end of `finish_grad_sync` (perf_counter seconds, relative to the backward's start)."""
    par = ParallelState.from_process_group(Layout(world=ctx.world_size))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
    opt = DistributedAdamW(model, [], config(0.0), par,
                           ZeroConfig(bucket_size=bucket_size, overlap_grad_reduce=overlap, timeout_s=60))  # fmt: skip
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step * 10 + ctx.rank)
        x = torch.randn(256, width, generator=gen)
        opt.zero_grad()
        loss = model(x).square().mean()
        dist.barrier()
        start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        opt.finish_grad_sync()
        sync_end = time.perf_counter()
        opt.step(lr=1e-3)
        launches = [(i, t - start) for i, t in opt.launch_times()]
        out.append({"launches": launches, "backward_end": backward_end - start, "sync_end": sync_end - start,
                    "num_buckets": len(opt.buckets)})  # fmt: skip
    opt.remove_hooks()
    return out


def timeout_case(ctx):
    """Rank 1 builds the optimizer but never reduces: rank 0's wait must fail within the deadline, naming the
    phase. A group of its own (with a short gloo timeout) keeps the abandoned collective off the world group."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=5))
    par = ParallelState(Layout(world=2), ctx.rank, _groups={"dp": group})
    model = nn.Linear(4, 4)
    opt = DistributedAdamW(model, [], config(0.0), par, ZeroConfig(timeout_s=1.0))
    opt.zero_grad()
    with opt.no_sync() if ctx.rank == 1 else _null():  # rank 1 launches nothing
        model(torch.ones(2, 4)).sum().backward()
    start = time.perf_counter()
    if ctx.rank == 1:
        opt.remove_hooks()
        return None
    try:
        opt.finish_grad_sync()
    except CollectiveTimeout as exc:
        return str(exc), time.perf_counter() - start
    finally:
        opt.remove_hooks()
    return "no error", time.perf_counter() - start
