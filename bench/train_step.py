"""Training step of DeepSeek-V3 (forward + backward + AdamW step): the trainer's step against a plain loop around
transformers' `DeepseekV3ForCausalLM`; our `moe.trainer.models.deepseek_v3` model against transformers', tokens/s and
peak memory side by side; then our expert-parallel scaling.

The trainer's step (first table): `Trainer.train_step` as `examples/deepseek_v3/train.py` builds it for one process
with the config tree's defaults (`examples/deepseek_v3/configs/tiny.toml`, MTP off since transformers has none; its
[training]: 32 x 128 tokens in 4 micro-batches, FP32, AdamW with the warm-up + cosine schedule, clipping at 1.0,
the expert-bias update; speed flags only with `--trainer-set`, e.g. `training.attention_backend=auto` or
`training.compile=true`) against a plain loop around transformers' model holding the same initial weights: the
same micro-batches (each mean loss divided by their number), `clip_grad_norm_`, torch's AdamW with the same
settings and schedule. Both sides train on the same 32 random sequences (`fixed_batches`), one intra-op thread
(train.sh's setting per rank), in one process, step by step in turns. Printed: both step times (wall clock, and
the thread's CPU time, steadier on a shared machine), the ratio, the first step's parity (loss and gradient norm),
and each side's top operators by self CPU time over one more step (torch.profiler `key_averages`).

The same at R processes (`--trainer-only --ranks R`, under the one launcher: gloo on 127.0.0.1, one intra-op
thread per rank as scripts/train.sh sets it): each rank builds the trainer of world R with `--ep R` (train.sh's
layout: the experts over the R ranks, everything else data parallel; another layout with `--trainer-set
parallel.ep=...`) and transformers' model (the same initial weights) in torch's `DistributedDataParallel` over the
same group, with torch's defaults. Each rank takes its rows of the same global batch (the trainer's split, global
32 x 128 tokens, 4 micro-batches per rank on both sides; `no_sync` on all but the last, whose backward all-reduces
the averaged gradients), `clip_grad_norm_`, AdamW as above. The sides alternate step by step with a barrier before
each; printed are each side's slowest rank's median, every rank's, tokens/s of all ranks, the process CPU time
(gloo's threads included; it also counts a waiting rank's spinning and yielding in mtdeepep's rendezvous), and rank
0's top operators (the other ranks run the profiled step unprofiled). With R single-thread ranks on fewer cores
the ranks take turns, and every rendezvous (mtdeepep's dispatch and combine, 4 per MoE layer and micro-batch; DDP's
one all-reduce per bucket) waits for a descheduled peer: the times are noisy and favour fewer rendezvous.

First-step loss on both sides: the trainer reports the cross entropy summed over every next-token target of the
global batch (float64 sums over micro-batches and ranks) over their count; the loop the mean of its micro-batches'
means (each `F.cross_entropy` over its rows x 127 targets), averaged over the ranks. Every micro-batch has the same
number of targets here (no padding, no ignored labels), so the two are the same quantity; they would differ with
uneven micro-batches, where a mean of means weights tokens unequally. The trainer's loss excludes MTP (off here) and
the sequence-wise auxiliary loss (`seq_aux_loss_coeff` 0 in tiny); the trainer also updates the router biases after
the step (transformers has no such update), which does not touch the first step's loss.

The model comparison (second table), setting: `examples/deepseek_v3/configs/small.toml` (hidden 512, 4 layers of
which 3 MoE with 16 routed experts of 256, top-4 in 2 of 4 groups, one shared expert, MLA with q LoRA 384 / kv LoRA
256, YaRN, vocabulary 4096), a batch of 4 x 256 random token ids from a seeded generator (labels = the ids; every
model shifts them itself). One step: gradients set to None, forward with labels (mean next-token cross entropy,
FP32), backward, global-norm clipping at 1.0, AdamW (torch's fused kernel, lr 1e-4, betas (0.9, 0.95), weight
decay 0.1 on matrices) and, for our model, the aux-loss-free expert-bias update (`moe.update_expert_bias`, part of a
DeepSeek-V3 step; transformers has none).
Both models run their defaults: transformers 'sdpa' attention and 'grouped_mm' experts, ours
`scaled_dot_product_attention` (attention backend 'sdpa') and grouped-GEMM experts behind the 'flex' dispatcher
(no communication on one rank).

Variants (rows of the second table), all in one process with every core's intra-op threads:
- transformers and ours in FP32, without MTP on both (transformers does not model multi-token prediction, so the
  compared models have `num_nextn_predict_layers = 0`), with identical weights: transformers' randomly initialised
  weights imported into ours (`moe.trainer.models.deepseek_v3.hf.from_hf_state_dict`);
- the same pair in BF16 mixed precision: BF16 weights, activations and gradients, FP32 master weights that the
  clipping and AdamW work on, copied back (rounded to BF16) after each step; the BF16 weights are the FP32 ones
  rounded, and both models get the same mixed-precision step;
- ours with MTP on (one MTP depth, loss weight from the config; freshly initialised MTP weights), in each precision:
  the step DeepSeek-V3 really trains, more work for the same tokens.
Before timing, every pair's first-step loss and pre-clipping gradient norm are compared (the parity line).

Timing: one iteration = one step of every variant in turn (alternating iteration by iteration, so drifts of a
noisy machine hit all variants alike; each model keeps training on the same batch); the median over `--iters`
iterations after `--warmup` is the step time; tokens/s = batch * seq / step time. The speedups compare ours with
transformers in the same precision, and with transformers in FP32 (the precision a user would otherwise train in).

Peak memory: each variant once more in a fresh process (the same one-rank launcher): building the model and its
optimizer in the variant's dtype, then `--memory-steps` steps on the batch. Reported is the process's resident-set
high-water mark (`VmHWM` of /proc/self/status) minus its resident set just before building (after the imports):
weights, gradients, optimizer state (and FP32 masters), the activations' peak, and what the libraries keep. On CPU
torch has no allocator statistics (no `max_memory_allocated`), and tracemalloc does not see torch's allocations, so
the kernel's count of resident pages is the measure. Two settings keep it a measure of the step rather than of
malloc: these processes run with `MALLOC_MMAP_THRESHOLD_=65536` (glibc otherwise raises its mmap threshold as large
blocks are freed, then serves activations from a heap that keeps freed pages resident, and the high-water mark
creeps up with every step), and the default 8 steps reach the plateau: in BF16 the mark grows for about 5 steps
while the expert GEMMs change shape as the routing moves (oneDNN keeps state per BF16 GEMM shape, its primitive
cache among it): measured +400 MiB for transformers' BF16 model, and none with the learning rate at 0. Both
models pay it; FP32 GEMMs (MKL) keep nothing per shape.

Expert-parallel scaling (third table): our model (MTP off) under `run_ranks` with R = 1, 2, 4 processes (gloo on
127.0.0.1, `max(1, cores // R)` threads each): the experts sharded over the R ranks through the 'flex' (mtdeepep)
dispatcher, everything else data parallel (each rank its own 4 x 256 batch, loss divided by R, the replicated
gradients summed over the ranks in FP32 in one all-reduce, the global norm over all ranks, the expert-bias update
from counts summed over the ranks). Timed as above with a gloo barrier before every step; the slowest rank's median,
tokens/s = R * batch * seq / that time. On 2 cores, R = 4 oversubscribes (4 single-thread ranks take turns).
Check: rank 0's first loss (its batch is EP 1's) is the same at every R.

Run (about 6 minutes on a 2-core machine):

    .venv/bin/python bench/train_step.py                   # every table + bench/results/train_step.json
    .venv/bin/python bench/train_step.py --iters 3 --ep 1,2 --precisions bf16 --skip-memory --skip-trainer
    .venv/bin/python bench/train_step.py --trainer-only    # the trainer's step only (about a minute)
    .venv/bin/python bench/train_step.py --trainer-only --trainer-set training.compile=true
    .venv/bin/python bench/train_step.py --trainer-only --ranks 4   # EP 4 vs DDP, 4 processes (about a minute)

Legend: B sequences, S tokens per sequence, R ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from _common import (
    RESULTS_DIR,
    add_config_arguments,
    config_from_args,
    environment,
    environment_variables,
    make_parser,
    num_cores,
    parse_choices,
    parse_int_list,
    print_table,
    run_ranks,
    save_results,
    slowest_rank,
    threads_per_rank,
    time_variants,
)
from torch.nn.parallel import DistributedDataParallel

from moe import EPBuffers, update_expert_bias
from moe.trainer import run
from moe.trainer.data.token_file import TokenBatches
from moe.trainer.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moe.trainer.models.deepseek_v3.hf import from_hf_state_dict
from moe.trainer.train import job_config
from moe.trainer.train.config_tree import split_overrides
from moe.trainer.train.parallel_state import ParallelState
from moe.trainer.train.schedule import lr_at
from moe.trainer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TRAINING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # [training] dtype
MAX_GRAD_NORM = 1.0

# Parity of a pair (relative difference of the first-step loss and of the pre-clipping gradient norm).
# FP32: the same maths in another order (fused projections, grouped GEMMs, summation order): float32 rounding over
# a few layers, measured ~1e-7 on the loss. BF16: both models round to 8 significant bits at different points
# (relative 2^-9 per rounding); the loss averages 1020 positions (measured ~1e-3), the gradient norm sums squares of
# BF16 gradients (measured ~1e-2).
PARITY_RTOL = {"fp32": 1e-4, "bf16": 5e-2}


@dataclass(frozen=True)
class BenchConfig:
    config: str = "examples/deepseek_v3/configs/small.toml"
    batch: int = 4
    seq: int = 256
    precisions: tuple[str, ...] = ("fp32", "bf16")
    ep_precisions: tuple[str, ...] = ("fp32", "bf16")
    lr: float = 1e-4
    weight_decay: float = 0.1
    iters: int = 10
    warmup: int = 2
    memory_steps: int = 8
    seed: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def model_config(self, mtp: bool) -> DeepseekV3Config:
        config = DeepseekV3Config.from_toml(REPO / self.config if not Path(self.config).is_absolute() else self.config)
        return config if mtp else dataclasses.replace(config, num_nextn_predict_layers=0)


@dataclass(frozen=True)
class Variant:
    impl: str  # 'transformers' or 'ours'
    precision: str  # 'fp32' or 'bf16' (mixed: FP32 master weights)
    mtp: bool = False

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.precision}" + ("+mtp" if self.mtp else "")


def variants(cfg: BenchConfig) -> list[Variant]:
    """Per precision: transformers, ours, ours with MTP."""
    kinds = [("transformers", False), ("ours", False), ("ours", True)]
    return [Variant(impl, precision, mtp) for precision in cfg.precisions for impl, mtp in kinds]


# ---------------------------------------------------------------------------------------------------------------
# The step


class MasterWeightsAdamW:
    """AdamW (fused kernel) on FP32 master weights, with global-norm clipping.

    Parameters in a lower precision get an FP32 master copy with an FP32 gradient; AdamW updates the master, which is
    then copied back (rounded). FP32 parameters are their own master. Weight decay applies to matrices only.
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.low = [p for p in self.params if p.dtype != torch.float32]
        self.low_masters = [p.detach().float() for p in self.low]
        masters = {id(p): m for p, m in zip(self.low, self.low_masters)}
        self.masters = [masters.get(id(p), p) for p in self.params]
        groups = [
            {"params": [m for m in self.masters if m.dim() >= 2], "weight_decay": weight_decay},
            {"params": [m for m in self.masters if m.dim() < 2], "weight_decay": 0.0},
        ]
        self.adamw = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def grads_to_masters(self) -> None:
        """FP32 copies of the low-precision gradients on their masters (None where the parameter got none)."""
        pairs = [(m, p.grad) for m, p in zip(self.low_masters, self.low)]
        for m, g in pairs:
            if g is None:
                m.grad = None
            elif m.grad is None:
                m.grad = torch.empty_like(m)
        with_grad = [(m.grad, g) for m, g in pairs if g is not None]
        if with_grad:
            torch._foreach_copy_(*map(list, zip(*with_grad)))

    def master_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def step(self, total_norm: torch.Tensor) -> None:
        """Clip the master gradients to `MAX_GRAD_NORM` given their global norm (`clip_grad_norm_`'s factor, applied
        only when it is below 1: on CPU reading the norm costs no device sync), AdamW, copy the masters back."""
        factor = MAX_GRAD_NORM / (float(total_norm) + 1e-6)
        if factor < 1.0:
            torch._foreach_mul_(self.master_grads(), factor)
        self.adamw.step()
        if self.low:
            torch._foreach_copy_(self.low, self.low_masters)


@dataclass
class TrainStep:
    """One training step of `model` on a fixed batch; calling it returns `(loss, pre-clipping grad norm)`.

    loss_fn(model, ids, labels) -> the 0-d training loss of this rank's batch. With a `group` of R > 1 ranks
    (expert parallel over data parallel), the loss is divided by R, the replicated gradients are summed over the
    group and the norm counts every parameter once (`expert_params`: this rank's shard of the experts).
    """

    model: torch.nn.Module
    loss_fn: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: MasterWeightsAdamW
    ids: torch.Tensor
    labels: torch.Tensor
    bias_update: bool = False
    group: dist.ProcessGroup | None = None
    expert_params: tuple[torch.nn.Parameter, ...] = ()

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        opt = self.optimizer
        opt.zero_grad()
        loss = self.loss_fn(self.model, self.ids, self.labels)
        world = dist.get_world_size(self.group) if self.group is not None else 1
        (loss / world if world > 1 else loss).backward()
        opt.grads_to_masters()
        if world > 1:
            self._reduce_replicated()
            total_norm = self._global_norm()
        else:
            total_norm = torch.nn.utils.get_total_norm(opt.master_grads(), foreach=True)
        opt.step(total_norm)
        if self.bias_update:
            update_expert_bias(self.model, dp_group=self.group if world > 1 else None)
        return loss.detach(), total_norm

    def _is_expert(self) -> list[bool]:
        ids = {id(p) for p in self.expert_params}
        return [id(p) in ids for p in self.optimizer.params]

    @torch.no_grad()
    def _reduce_replicated(self) -> None:
        grads = [m.grad for m, e in zip(self.optimizer.masters, self._is_expert()) if not e and m.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        torch._foreach_copy_(grads, [part.view_as(g) for g, part in zip(grads, flat.split([g.numel() for g in grads]))])

    @torch.no_grad()
    def _global_norm(self) -> torch.Tensor:
        sums = torch.zeros(2)
        for m, expert in zip(self.optimizer.masters, self._is_expert()):
            if m.grad is not None:
                sums[int(expert)] += m.grad.float().square().sum()
        dist.all_reduce(sums[1:], group=self.group)  # the experts' shards; the replicated part is the same everywhere
        return sums.sum().sqrt()


def ours_loss(model: DeepseekV3ForCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = model(ids, labels)
    return out.loss if out.mtp_loss is None else out.loss + model.config.mtp_loss_weight * out.mtp_loss


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss


def batch(cfg: BenchConfig, vocab_size: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, labels)` `[B, S]` int64, random tokens of this rank's seeded generator; labels = ids."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    ids = torch.randint(0, vocab_size, (cfg.batch, cfg.seq), generator=gen)
    return ids, ids.clone()


def hf_model(config: DeepseekV3Config, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """transformers' model of `config` (its own random init, built in `dtype`), in training mode; the router's
    `e_score_correction_bias` buffer stays FP32 as `from_pretrained` keeps it."""
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.DeepseekV3Config(**config.to_hf_dict())
    model = transformers.DeepseekV3ForCausalLM._from_config(hf_config, dtype=dtype).train()
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.data = buf.data.float()
    return model


def make_step(variant: Variant, model: torch.nn.Module, cfg: BenchConfig, ids, labels, **kwargs) -> TrainStep:
    optimizer = MasterWeightsAdamW(model, cfg.lr, cfg.weight_decay)
    ours = variant.impl == "ours"
    return TrainStep(model, ours_loss if ours else hf_loss, optimizer, ids, labels, bias_update=ours, **kwargs)


def build_models(cfg: BenchConfig) -> dict[Variant, torch.nn.Module]:
    """Every variant's model; all hold transformers' initial weights (rounded to BF16 in the BF16 variants), the
    MTP variants freshly initialised MTP modules besides."""
    config, config_mtp = cfg.model_config(mtp=False), cfg.model_config(mtp=True)
    reference = hf_model(config, torch.float32, cfg.seed)
    hf_state = dict(reference.state_dict())
    state = from_hf_state_dict(hf_state, config, log=lambda message: None)
    state_mtp = from_hf_state_dict(hf_state, config_mtp, seed=cfg.seed, log=lambda message: None)
    models = {}
    for variant in variants(cfg):
        dtype = DTYPES[variant.precision]
        if variant.impl == "transformers":
            model = hf_model(config, dtype, cfg.seed)
            model.load_state_dict(hf_state)  # copy_ rounds to the model's dtype (the bias buffer stays FP32)
        else:
            model = DeepseekV3ForCausalLM(config_mtp if variant.mtp else config, dtype=dtype).train()
            model.load_full_state_dict(state_mtp if variant.mtp else state)
        models[variant] = model
    return models


# ---------------------------------------------------------------------------------------------------------------
# The trainer's step against a plain transformers loop (the first table)

TRAINER_CONFIG = "examples/deepseek_v3/configs/tiny.toml"
# transformers models no multi-token prediction: both sides train the main head only.
TRAINER_OVERRIDES = ("--model.num_nextn_predict_layers", "0")
# Parity of the first step (loss and pre-clipping gradient norm; FP32, the same maths in another order, see
# PARITY_RTOL): measured ~1e-7 on the loss.
TRAINER_PARITY_RTOL = 1e-4


# Bound on every collective wait of the multi-process comparison (train.py's --timeout).
TRAINER_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TrainerBench:
    """The trainer-vs-transformers comparison: `config` with `TRAINER_OVERRIDES` and `overrides` (`--section.key
    value` pairs, e.g. a speed flag), `iters` timed steps per side after `warmup`, `top` profiler rows per side.
    `ranks` > 1: that many processes, the trainer with `--ep ranks` (scripts/train.sh's layout; an override may
    change it) against transformers' model under `DistributedDataParallel`."""

    config: str = TRAINER_CONFIG
    overrides: tuple[str, ...] = ()
    iters: int = 6
    warmup: int = 1
    top: int = 8
    seed: int = 0
    ranks: int = 1


def trainer_job(bench: TrainerBench) -> job_config.Job:
    """The validated config tree of train.py for `bench` (`bench.ranks` processes, expert parallel over all of
    them as scripts/train.sh runs it, unless an override says otherwise)."""
    layout = ("--parallel.ep", str(bench.ranks)) if bench.ranks > 1 else ()
    _, overrides = split_overrides([*TRAINER_OVERRIDES, *layout, *bench.overrides])
    return job_config.load_job(REPO / bench.config, overrides, world=bench.ranks)


def fixed_batches(job: job_config.Job, seed: int) -> TokenBatches:
    """Random tokens for exactly one global batch (plus one held-out window): every step trains the same
    `global_batch` sequences (each step an epoch, so in another order)."""
    t = job.training
    tokens = np.random.default_rng(seed).integers(0, job.model.vocab_size, (t.global_batch + 1) * t.seq_len)
    return TokenBatches(tokens, seq_len=t.seq_len, global_batch=t.global_batch, val_sequences=1, seed=seed)


def build_trainer(job: job_config.Job, batches: TokenBatches, run_dir: Path, hf_state: dict,
                  parallel: ParallelState | None = None, ep_buffers: EPBuffers | None = None) -> Trainer:  # fmt: skip
    """The model and `Trainer` as train.py builds them (its dtype, FP8 recipe, recompute and [training] settings;
    with `parallel`, its process groups: experts over the EP group, tensor parallel over the TP group), holding
    transformers' initial weights (each rank keeps its experts). One process without `parallel`."""
    parallel = parallel if parallel is not None else ParallelState.single()
    initial_state = from_hf_state_dict(hf_state, job.model, log=lambda message: None)
    model, _ = run.build_model(job, parallel, ep_buffers, seed=None, initial_state=initial_state)  # train.py's build
    return run.build_trainer(job, model, parallel, batches, run_dir, seed=0)


@dataclass
class HFLoop:
    """A plain training loop around transformers' model: per step the same micro-batches, each loss (a mean over
    its micro-batch) divided by their number and back-propagated, `clip_grad_norm_`, torch's AdamW (its defaults,
    with the trainer's hyperparameters, decay on matrices and learning-rate schedule).

    Data parallel: `model` wrapped in `DistributedDataParallel`, this rank (`dp_rank` of `dp`) takes its rows of
    the global batch (the trainer's split) and its micro-batches; DDP averages the gradients over the ranks in the
    last micro-batch's backward (`no_sync` before it), so they are the global batch's. The returned loss is this
    rank's (its micro-batches' mean); the global one is the mean over the ranks."""

    model: torch.nn.Module
    config: Any  # TrainerConfig: [training] and [optimizer]
    batches: TokenBatches
    dp_rank: int = 0
    dp: int = 1

    def __post_init__(self) -> None:
        o = self.config.optimizer
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)

    def train_step(self, step: int) -> dict[str, float]:
        t, o = self.config.training, self.config.optimizer
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        ddp = isinstance(self.model, DistributedDataParallel)
        for index, mb in enumerate(self.batches.local_batch(step, self.dp_rank, self.dp).chunk(t.micro_batches)):
            last = index == t.micro_batches - 1
            with self.model.no_sync() if ddp and not last else contextlib.nullcontext():
                loss = self.model(input_ids=mb, labels=mb).loss / t.micro_batches
                loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.clip_grad)
        lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, total_steps=t.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return {"loss": float(total), "grad_norm": float(norm)}


def top_costs(fn: Callable[[], Any], rows: int) -> list[dict[str, Any]]:
    """One call of `fn` under torch.profiler: the `rows` operators of the largest self CPU time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:rows]]  # fmt: skip


def trainer_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, bench: TrainerBench) -> dict[str, Any]:
    """Both sides in this process on one intra-op thread (train.sh's per-rank setting): the parity step, then the
    steps in turns (a barrier before each), then one profiled step each (profiled on rank 0; the other ranks run
    it unprofiled, as its collectives need them).

    One process: the trainer against transformers' model. `num_ranks` > 1: the trainer of that world (its layout
    from `trainer_job`) against transformers' model in `DistributedDataParallel` over the same gloo group, each
    rank its rows of the same global batch."""
    import tempfile

    torch.set_num_threads(1)
    job = trainer_job(bench)
    batches = fixed_batches(job, bench.seed)
    hf = hf_model(job.model, TRAINING_DTYPES[job.training.dtype], bench.seed)  # the same weights on every rank
    parallel, ep_buffers = ParallelState.single(), None
    if num_ranks > 1:
        parallel = ParallelState.from_process_group(job.layout)
        ep_buffers = EPBuffers(timeout_s=TRAINER_TIMEOUT_S)
    # One process: the thread's CPU time. Several: the process's (gloo runs the collectives on its own threads,
    # DDP's gradient all-reduce among them), which also counts the time a waiting rank spends yielding its core.
    clock = time.thread_time if num_ranks == 1 else time.process_time
    with tempfile.TemporaryDirectory(prefix="train_step-") as run_dir:
        trainer = build_trainer(job, batches, Path(run_dir), dict(hf.state_dict()), parallel, ep_buffers)
        if num_ranks > 1:
            # torch's defaults: 25 MiB buckets, the buffers broadcast from rank 0 at every forward.
            hf = DistributedDataParallel(hf, process_group=group)
        loop = HFLoop(hf, job.trainer, batches, dp_rank=rank, dp=num_ranks)
        steps = {"trainer": 0, "transformers": 0}
        sides = {"trainer": trainer.train_step, "transformers": loop.train_step}
        cpu: dict[str, list[float]] = {name: [] for name in sides}

        def call(name: str):
            steps[name] += 1
            start = clock()
            result = sides[name](steps[name])
            cpu[name].append(clock() - start)
            return result

        first, first_seconds = {}, {}
        for name in sides:  # the first step also builds what is built once (with `compile`, the compilation)
            dist.barrier(group=group)
            start = time.perf_counter()
            first[name] = {k: float(v) for k, v in call(name).items() if k in ("loss", "grad_norm")}
            first_seconds[name] = time.perf_counter() - start
        if num_ranks > 1:  # the trainer's loss is the global batch's; the loop's this rank's: their mean over ranks
            loss = torch.tensor(first["transformers"]["loss"], dtype=torch.float64)
            dist.all_reduce(loss, group=group)
            first["transformers"]["loss"] = float(loss) / num_ranks
        timed = time_variants({name: functools.partial(call, name) for name in sides}, bench.iters, bench.warmup, group)
        # The CPU time of the same timed steps: on a shared machine, the wall clock also counts the time spent
        # waiting for a core; the CPU time does not.
        cpu_samples = {name: values[-bench.iters :] for name, values in cpu.items()}
        cpu_seconds = {name: statistics.median(values) for name, values in cpu_samples.items()}
        costs = {}
        for name in sides if bench.top > 0 else ():
            dist.barrier(group=group)
            if rank == 0:
                costs[name] = top_costs(functools.partial(call, name), bench.top)
            else:
                call(name)
        dist.barrier(group=group)
    if ep_buffers is not None:
        ep_buffers.destroy()  # after the last backward, which communicates on them
    return {**timed, "cpu_seconds": cpu_seconds, "cpu_samples": cpu_samples, "first_step": first,
            "first_step_seconds": first_seconds, "top_costs": costs, "layout": job.layout.to_dict(),
            "config": job.tables,
            "transformers_impl": {"attn": hf_config(hf)._attn_implementation,
                                  "experts": hf_config(hf)._experts_implementation}}  # fmt: skip


def hf_config(model: torch.nn.Module):
    """transformers' config of `model`, bare or under DDP."""
    return (model.module if isinstance(model, DistributedDataParallel) else model).config


def slowest_of(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's result with each side's step time, samples and CPU time taken from that side's slowest rank
    (largest median); every rank's median besides (`per_rank_seconds`, `slowest_rank`)."""
    out = dict(per_rank[0])
    names = list(out["seconds"])
    slowest = {name: slowest_rank([r["seconds"][name] for r in per_rank]) for name in names}
    for key in ("seconds", "samples", "cpu_seconds", "cpu_samples"):
        out[key] = {name: per_rank[slowest[name]][key][name] for name in names}
    out["per_rank_seconds"] = {name: [r["seconds"][name] for r in per_rank] for name in names}
    out["slowest_rank"] = slowest
    return out


def samples_text(seconds: list[float]) -> str:
    return " ".join(f"{s * 1e3:.0f}" for s in seconds)


def print_trainer(bench: TrainerBench, result: dict[str, Any]) -> dict[str, Any]:
    """The table of both sides, the ratio, the parity and the top costs (`slowest_of`'s result: with several ranks,
    each side's slowest rank's times, rank 0's operators); returns the summary for the JSON."""
    seconds, first = result["seconds"], result["first_step"]
    t = result["config"]["training"]
    tokens = t["global_batch"] * t["seq_len"]
    ratio = seconds["transformers"] / seconds["trainer"]
    cpu = result["cpu_seconds"]
    cpu_ratio = cpu["transformers"] / cpu["trainer"]
    parity = {k: relative(first["trainer"][k], first["transformers"][k]) for k in ("loss", "grad_norm")}
    flags = " ".join(bench.overrides) or "none (train.py's defaults)"
    if bench.ranks == 1:
        setting, median_of, cpu_head = "one process, 1 thread", "median", "CPU ms"
    else:
        lay = result["layout"]
        setting = (f"{bench.ranks} processes (gloo, 1 thread each, {num_cores()} cores): the trainer with the "
                   f"experts over ep {lay['ep']}, the rest data parallel over dp "
                   f"{lay['world'] // (lay['tp'] * lay['pp'])} (tp {lay['tp']}, pp {lay['pp']}); transformers under "
                   f"DistributedDataParallel, {t['global_batch'] // bench.ranks} sequences per rank")  # fmt: skip
        median_of, cpu_head = "slowest rank's median", "process CPU ms"
    print(f"The trainer's step vs a transformers loop: {bench.config} without MTP, {t['global_batch']} x "
          f"{t['seq_len']} tokens in {t['micro_batches']} micro-batches per rank, {t['dtype']}, {setting}; "
          f"speed flags: {flags}; transformers attention '{result['transformers_impl']['attn']}', experts "
          f"'{result['transformers_impl']['experts']}'; {median_of} of {bench.iters} steps after {bench.warmup} "
          f"warm-up(s), in turns; load average at start {result['load_average']}")  # fmt: skip
    rows = [
        [name, f"{seconds[name] * 1e3:.0f}", f"{tokens / seconds[name]:.0f}", samples_text(result["samples"][name]),
         f"{cpu[name] * 1e3:.0f}"]
        for name in ("transformers", "trainer")
    ]  # fmt: skip
    notes = [f"Speedup (transformers' step time / the trainer's): {ratio:.2f}x wall clock, {cpu_ratio:.2f}x CPU "
             "time (goal 1.3x, 1.5x stretch).",
             f"First step (builds caches; with compile, compiles): transformers "
             f"{result['first_step_seconds']['transformers']:.1f} s, trainer "
             f"{result['first_step_seconds']['trainer']:.1f} s.",
             f"First step's loss: transformers {first['transformers']['loss']:.6f}, trainer "
             f"{first['trainer']['loss']:.6f}; relative difference: loss {parity['loss']:.1e}, grad norm "
             f"{parity['grad_norm']:.1e} (bound {TRAINER_PARITY_RTOL:.0e})."]  # fmt: skip
    if bench.ranks > 1:
        notes.append("Every rank's median ms: " + "; ".join(
            f"{name} {samples_text(result['per_rank_seconds'][name])} (slowest: rank {result['slowest_rank'][name]})"
            for name in ("transformers", "trainer")))  # fmt: skip
        notes.append(f"{bench.ranks} single-thread ranks on {num_cores()} cores take turns: the times are noisy.")
    print_table(("side", "step ms", "tokens/s", "samples ms", cpu_head), rows, *notes)
    for name in ("transformers", "trainer") if result["top_costs"] else ():
        costs = result["top_costs"][name]
        where = "" if bench.ranks == 1 else " on rank 0"
        print(f"Top {len(costs)} operators of one {name} step{where} by self CPU time:")
        table = [[c["op"], f"{c['self_ms']:.1f}", f"{100 * c['share']:.1f}%", str(c["calls"])] for c in costs]
        print_table(("op", "self ms", "share", "calls"), table)
    summary = {"speedup": ratio, "speedup_cpu_time": cpu_ratio, "parity": parity, "overrides": list(bench.overrides),
               "ranks": bench.ranks}  # fmt: skip
    return {**summary, **result}


# ---------------------------------------------------------------------------------------------------------------
# Ranks


def single_process_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Builds every variant, runs the parity step, then times all variants interleaved."""
    models = build_models(cfg)
    ids, labels = batch(cfg, cfg.model_config(mtp=False).vocab_size)
    steps = {variant.name: make_step(variant, model, cfg, ids, labels) for variant, model in models.items()}
    first = {}
    for name, step in steps.items():  # also the first warm-up step of each
        loss, norm = step()
        first[name] = {"loss": float(loss), "grad_norm": float(norm)}
    hf = next(m for v, m in models.items() if v.impl == "transformers")
    impls = {"attn": hf.config._attn_implementation, "experts": hf.config._experts_implementation}
    return {**time_variants(steps, cfg.iters, cfg.warmup, group), "first_step": first, "transformers_impl": impls}


def vm_bytes(field: str) -> int:
    """`VmRSS` / `VmHWM` of this process in bytes (/proc/self/status, kB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


# glibc: blocks from 64 KiB on are mmapped and unmapped when freed (no dynamic threshold), see the docstring.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def memory_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig, variant: Variant):
    """Peak resident memory of building `variant` and running `cfg.memory_steps` steps (fresh process)."""
    import gc

    import transformers  # noqa: F401  (imported before the baseline, as ours are)

    config = cfg.model_config(variant.mtp)
    ids, labels = batch(cfg, config.vocab_size)
    gc.collect()
    baseline = vm_bytes("VmRSS")
    dtype = DTYPES[variant.precision]
    if variant.impl == "transformers":
        model = hf_model(config, dtype, cfg.seed)
    else:
        torch.manual_seed(cfg.seed)
        model = DeepseekV3ForCausalLM(config, dtype=dtype).train()
    step = make_step(variant, model, cfg, ids, labels)
    for _ in range(cfg.memory_steps):
        step()
    peak = vm_bytes("VmHWM")
    return {"baseline_bytes": baseline, "peak_bytes": peak, "peak_over_baseline_bytes": peak - baseline}


def ep_rank(rank: int, num_ranks: int, group: dist.ProcessGroup, cfg: BenchConfig) -> dict[str, Any]:
    """Our model (MTP off) with its experts over the group, data parallel otherwise; times each precision."""
    config = cfg.model_config(mtp=False)
    ids, labels = batch(cfg, config.vocab_size, rank)
    steps, first = {}, {}
    for precision in cfg.ep_precisions:
        torch.manual_seed(cfg.seed)  # the same weights on every rank and at every R (layout-independent init)
        model = DeepseekV3ForCausalLM(config, ep_group=group, dtype=DTYPES[precision]).train()
        experts = tuple(p for layer in model.moe_layers() for p in layer.experts.parameters())
        step = make_step(Variant("ours", precision), model, cfg, ids, labels, group=group, expert_params=experts)
        loss, _ = step()
        first[precision] = float(loss)
        steps[precision] = step
    return {**time_variants(steps, cfg.iters, cfg.warmup, group), "first_loss": first}


# ---------------------------------------------------------------------------------------------------------------
# Report


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def single_rows(cfg: BenchConfig, result: dict[str, Any], memory: dict[str, Any]) -> list[dict[str, Any]]:
    seconds = result["seconds"]
    rows = []
    for variant in variants(cfg):
        s = seconds[variant.name]
        peak = memory.get(variant.name, {}).get("peak_over_baseline_bytes")
        same = seconds.get(Variant("transformers", variant.precision).name)
        fp32 = seconds.get(Variant("transformers", "fp32").name)
        rows.append(
            {
                "variant": variant.name,
                "impl": variant.impl,
                "precision": variant.precision,
                "mtp": variant.mtp,
                "step_ms": s * 1e3,
                "tokens_per_s": cfg.tokens / s,
                "speedup_vs_transformers_same_precision": same / s if same else None,
                "speedup_vs_transformers_fp32": fp32 / s if fp32 else None,
                "peak_mib": None if peak is None else peak / 2**20,
                "samples_ms": [x * 1e3 for x in result["samples"][variant.name]],
                "first_step": result["first_step"][variant.name],
            }
        )
    return rows


def parity(cfg: BenchConfig, first: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per precision: relative differences of ours (MTP off) from transformers in the first step."""
    out = {}
    for precision in cfg.precisions:
        ours, theirs = first[Variant("ours", precision).name], first[Variant("transformers", precision).name]
        out[precision] = {key: relative(ours[key], theirs[key]) for key in ("loss", "grad_norm")}
    return out


def ep_rows(cfg: BenchConfig, num_ranks: int, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for precision in cfg.ep_precisions:
        seconds = [r["seconds"][precision] for r in per_rank]
        slowest = slowest_rank(seconds)
        rows.append(
            {
                "ep": num_ranks,
                "precision": precision,
                "step_ms": seconds[slowest] * 1e3,
                "slowest_rank": slowest,
                "tokens_per_s": cfg.tokens * num_ranks / seconds[slowest],
                "per_rank_ms": [s * 1e3 for s in seconds],
                "samples_ms": [[s * 1e3 for s in r["samples"][precision]] for r in per_rank],
                "rank0_first_loss": per_rank[0]["first_loss"][precision],
            }
        )
    return rows


def fmt_speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_single(cfg: BenchConfig, rows: list[dict[str, Any]], checks: dict, impls: dict[str, str]) -> None:
    print(
        f"DeepSeek-V3 {cfg.config}, batch {cfg.batch} x {cfg.seq}, one process, {num_cores()} cores / "
        f"{threads_per_rank(1)} threads; transformers attention '{impls['attn']}', experts '{impls['experts']}'; "
        f"median of {cfg.iters} steps after {cfg.warmup} warm-up(s), variants alternating"
    )
    table = [
        [
            row["impl"],
            row["precision"] + (" mixed" if row["precision"] != "fp32" else ""),
            "on" if row["mtp"] else "off",
            f"{row['step_ms']:.0f}",
            f"{row['tokens_per_s']:.0f}",
            fmt_speedup(row["speedup_vs_transformers_same_precision"]),
            fmt_speedup(row["speedup_vs_transformers_fp32"]),
            "-" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}",
        ]
        for row in rows
    ]
    parity_text = "; ".join(
        f"{p}: loss {c['loss']:.1e}, grad norm {c['grad_norm']:.1e} (bound {PARITY_RTOL[p]:.0e})"
        for p, c in checks.items()
    )
    notes = [
        "bf16 mixed = BF16 weights/activations/gradients, FP32 master weights + AdamW. 'vs tf same' = transformers' "
        "step time in the same precision / this row's; 'vs tf fp32' = transformers' FP32 step time / this row's.",
        "peak MiB = resident-set high-water mark of a fresh process building the model and running "
        f"{cfg.memory_steps} steps, minus its resident set after the imports.",
        f"Parity with transformers, first step, relative difference: {parity_text}.",
    ]
    notes.extend(goal_lines(rows))
    print_table(
        ("model", "precision", "MTP", "step ms", "tokens/s", "vs tf same", "vs tf fp32", "peak MiB"), table, *notes
    )


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Which of ours (MTP off) reach the issue's goal: 1.5x transformers' tokens/s on one process."""
    lines = []
    for row in rows:
        if row["impl"] != "ours" or row["mtp"]:
            continue
        for key, what in (
            ("speedup_vs_transformers_same_precision", f"transformers {row['precision']}"),
            ("speedup_vs_transformers_fp32", "transformers fp32"),
        ):
            value = row[key]
            if value is None or (key.endswith("fp32") and row["precision"] == "fp32"):
                continue
            verdict = "meets" if value >= 1.5 else "does not meet"
            lines.append(f"Goal 1.5x: ours {row['precision']} vs {what}: {value:.2f}x, {verdict} it.")
    return lines


def print_ep(cfg: BenchConfig, rows: list[dict[str, Any]], ep_sizes: list[int]) -> None:
    threads = {n: threads_per_rank(n) for n in ep_sizes}
    print(
        f"\nOurs (MTP off), expert parallel over R ranks, data parallel otherwise; batch {cfg.batch} x {cfg.seq} per "
        f"rank; threads per rank {threads}; slowest rank's median of {cfg.iters} steps"
    )
    base = {row["precision"]: row["tokens_per_s"] for row in rows if row["ep"] == ep_sizes[0]}
    table = [
        [
            str(row["ep"]),
            row["precision"] + (" mixed" if row["precision"] != "fp32" else ""),
            f"{row['step_ms']:.0f}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['tokens_per_s'] / row['ep']:.0f}",
            f"{row['tokens_per_s'] / base[row['precision']]:.2f}x",
        ]
        for row in rows
    ]
    losses = {p: [row["rank0_first_loss"] for row in rows if row["precision"] == p] for p in cfg.ep_precisions}
    spread = "; ".join(f"{p}: {max(v) - min(v):.1e}" for p, v in losses.items())
    print_table(
        ("EP", "precision", "step ms", "tokens/s", "per rank", f"vs EP {ep_sizes[0]}"),
        table,
        f"tokens/s of all ranks; {num_cores()} cores, so R > {num_cores()} oversubscribes (ranks take turns).",
        f"Rank 0's first loss (the same batch at every R), max - min over R: {spread}.",
    )


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def parse_args() -> argparse.Namespace:
    defaults = BenchConfig()
    parser = make_parser(__doc__)
    helps = {
        "config": "model TOML (relative to the repository root)",
        "batch": "sequences per step (per rank under EP)",
        "seq": "tokens per sequence",
        "iters": "timed steps per variant",
        "warmup": "untimed steps per variant (after the parity step)",
        "memory_steps": "steps of each fresh memory process",
    }
    add_config_arguments(parser, defaults, ("config", "batch", "seq", "lr", "weight_decay"), helps)
    for name in ("precisions", "ep_precisions"):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=lambda s: parse_choices(s, tuple(DTYPES)),
            default=getattr(defaults, name),
            help="comma-separated subset of fp32,bf16 (default: fp32,bf16)",
        )
    add_config_arguments(parser, defaults, ("iters", "warmup", "memory_steps", "seed"), helps)
    parser.add_argument("--trainer-only", action="store_true", help="only the trainer-vs-transformers table")
    parser.add_argument("--skip-trainer", action="store_true", help="no trainer-vs-transformers table")
    parser.add_argument("--trainer-iters", type=int, default=TrainerBench.iters, help="timed steps per side")
    parser.add_argument("--trainer-warmup", type=int, default=TrainerBench.warmup,
                        help="untimed steps per side after the parity step")  # fmt: skip
    parser.add_argument("--trainer-top", type=int, default=TrainerBench.top,
                        help="profiler rows per side (0: no profiled step)")  # fmt: skip
    parser.add_argument(
        "--ranks",
        type=int,
        default=TrainerBench.ranks,
        help="processes of the trainer-vs-transformers table (with --trainer-only): > 1 runs the trainer with --ep "
        "RANKS (scripts/train.sh's layout) against transformers under DistributedDataParallel",
    )
    parser.add_argument(
        "--trainer-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config override of the trainer's side (repeatable), e.g. training.compile=true",
    )
    parser.add_argument("--ep", default="1,2,4", help="comma-separated expert-parallel sizes (default: 1,2,4)")
    parser.add_argument("--skip-ep", action="store_true", help="no expert-parallel table")
    parser.add_argument("--skip-memory", action="store_true", help="no peak-memory processes")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per launch")
    parser.add_argument("--json", type=Path, default=None,
                        help="results file (default: bench/results/train_step.json, train_step_ranksR.json with "
                        "--ranks R)")  # fmt: skip
    return parser.parse_args()


def trainer_overrides(settings: list[str]) -> tuple[str, ...]:
    """['training.compile=true'] -> ('--training.compile', 'true')."""
    out: list[str] = []
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq or "." not in key:
            raise SystemExit(f"--trainer-set {setting!r}: expected SECTION.KEY=VALUE")
        out += [f"--{key}", value]
    return tuple(out)


def check_trainer_parity(summary: dict[str, Any]) -> None:
    if max(summary["parity"].values()) > TRAINER_PARITY_RTOL:
        raise SystemExit(f"trainer parity check failed: {summary['parity']}")


def main() -> None:
    args = parse_args()
    cfg = config_from_args(BenchConfig, args)
    if args.ranks > 1 and not args.trainer_only:
        raise SystemExit("train_step.py: --ranks applies to the trainer-vs-transformers table: add --trainer-only")
    name = f"train_step_ranks{args.ranks}.json" if args.ranks > 1 else "train_step.json"
    json_path = args.json or RESULTS_DIR / name
    wall = {}
    trainer_summary = None
    if not args.skip_trainer:
        bench = TrainerBench(overrides=trainer_overrides(args.trainer_set), iters=args.trainer_iters,
                             warmup=args.trainer_warmup, top=args.trainer_top, seed=cfg.seed,
                             ranks=args.ranks)  # fmt: skip
        try:  # the layout and the batch split are checked before any process starts
            trainer_job(bench)
        except ValueError as exc:
            raise SystemExit(f"train_step.py: --ranks {bench.ranks}: {exc}") from None
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())  # 1, 5, 15 minutes
        print(f"load average at start: {load} ({num_cores()} cores)")
        start = time.perf_counter()
        per_rank = run_ranks(trainer_rank, bench.ranks, (bench,), timeout_s=args.timeout, threads=1)
        wall["trainer"] = time.perf_counter() - start
        trainer_summary = print_trainer(bench, {**slowest_of(per_rank), "load_average": load})
        if args.trainer_only:
            save_results(json_path, {"trainer": trainer_summary, "wall_seconds": wall, "environment": environment()})
            check_trainer_parity(trainer_summary)
            return
    start = time.perf_counter()
    (single,) = run_ranks(single_process_rank, 1, (cfg,), timeout_s=args.timeout)
    wall["single_process"] = time.perf_counter() - start
    memory = {}
    if not args.skip_memory:
        start = time.perf_counter()
        with environment_variables(MEMORY_ENV):  # the fresh (spawned) processes start with it
            for variant in variants(cfg):
                (memory[variant.name],) = run_ranks(memory_rank, 1, (cfg, variant), timeout_s=args.timeout)
        wall["memory"] = time.perf_counter() - start
    rows = single_rows(cfg, single, memory)
    checks = parity(cfg, single["first_step"])
    print_single(cfg, rows, checks, single["transformers_impl"])

    ep_sizes, ep_results = parse_int_list(args.ep), []
    if not args.skip_ep:
        for num_ranks in ep_sizes:
            start = time.perf_counter()
            per_rank = run_ranks(ep_rank, num_ranks, (cfg,), timeout_s=args.timeout)
            wall[f"ep{num_ranks}"] = time.perf_counter() - start
            ep_results.extend(ep_rows(cfg, num_ranks, per_rank))
        print_ep(cfg, ep_results, ep_sizes)

    save_results(
        json_path,
        {
            "config": asdict(cfg),
            "model_config": cfg.model_config(mtp=True).to_dict(),
            "transformers_impl": single["transformers_impl"],
            "parity": checks,
            "threads": {"single_process": threads_per_rank(1), **{f"ep{n}": threads_per_rank(n) for n in ep_sizes}},
            "wall_seconds": wall,
            "environment": environment(),
            "rows": rows,
            "memory": memory,
            "memory_env": MEMORY_ENV,
            "ep_rows": ep_results,
            "trainer": trainer_summary,
        },
    )
    if trainer_summary is not None:
        check_trainer_parity(trainer_summary)
    failed = [p for p, c in checks.items() if max(c.values()) > PARITY_RTOL[p]]
    if failed:
        raise SystemExit(f"parity check failed for {failed}: {checks}")


if __name__ == "__main__":
    main()
