"""The search: enumerate the layouts (`moe.trainer.plan.space`), estimate each one's memory and step time, drop those
that do not fit, rank the rest by step time (then by memory)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.plan.devices import DeviceSpec
from moe.trainer.plan.framework import THIS_TRAINER, Framework
from moe.trainer.plan.memory_estimate import MemoryBreakdown, estimate_memory
from moe.trainer.plan.model_shape import RECOMPUTE_CHOICES, ModelShape
from moe.trainer.plan.space import Candidate, Workload, enumerate_candidates
from moe.trainer.plan.timing import TimeBreakdown, estimate_time
from moe.trainer.train.metrics import mfu
from moe.trainer.train.parallel_state import FP8_RECIPES


@dataclass(frozen=True)
class Estimate:
    """A layout with its estimated peak memory (worst rank) and step time (bottleneck rank)."""

    candidate: Candidate
    memory: MemoryBreakdown
    time: TimeBreakdown

    def tokens_per_s(self, work: Workload) -> float:
        return work.global_batch * work.seq_len / self.time.step

    def mfu(self, shape: ModelShape, work: Workload, spec: DeviceSpec) -> float:
        """Model FLOPs (3x forward, no recompute) per second over the devices' peak rate of the model dtype."""
        dtype = "fp8" if self.candidate.fp8 != "none" else work.dtype
        world = self.candidate.world
        peak_per_rank = spec.tflops[dtype] * 1e12 * spec.share(world)
        return mfu(shape.model_flops_per_token(work.seq_len), self.tokens_per_s(work), peak_per_rank, world)


@dataclass
class PlanResult:
    """`ranked`: the layouts that fit, fastest first. `rejected`: counts per reason key
    (moe.trainer.plan.space.REASONS),
    `examples`: one rejected choice per reason. `total`: every choice considered (accepted + rejected)."""

    ranked: list[Estimate]
    rejected: Counter
    examples: dict[str, str]
    total: int


def estimate(
    cand: Candidate,
    config: DeepseekV3Config,
    work: Workload,
    spec: DeviceSpec,
    framework: Framework = THIS_TRAINER,
) -> Estimate:
    """Memory and time of one layout (no rule checked: see `moe.trainer.plan.space` and `moe.trainer.plan.layout` for
    those), for this trainer or another `framework`."""
    shape = ModelShape.from_config(config)
    memory = estimate_memory(cand, shape, work, spec, framework)
    return Estimate(cand, memory, estimate_time(cand, shape, work, spec, framework))


def plan(
    config: DeepseekV3Config,
    work: Workload,
    devices: int,
    spec: DeviceSpec,
    *,
    recomputes: tuple[str, ...] = tuple(RECOMPUTE_CHOICES),
    fp8s: tuple[str, ...] = FP8_RECIPES,
    max_tp: int | None = None,
) -> PlanResult:
    """Every layout of `devices` devices for `config` and `work`, ranked (see the module docstring)."""
    shape = ModelShape.from_config(config)
    space = enumerate_candidates(config, work, devices, spec, recomputes=recomputes, fp8s=fp8s, max_tp=max_tp)
    ranked = []
    capacity = spec.memory_capacity_bytes(devices)
    for cand in space.accepted:
        mem = estimate_memory(cand, shape, work, spec)
        if mem.total > capacity:
            space.reject("memory", 1, f"{cand.name()}: {mem.total / 2**30:.1f} GiB")
            continue
        ranked.append(Estimate(cand, mem, estimate_time(cand, shape, work, spec)))
    ranked.sort(key=lambda e: (e.time.step, e.memory.total, e.candidate.name()))
    total = len(ranked) + sum(space.rejected.values())
    return PlanResult(ranked, space.rejected, space.examples, total)
