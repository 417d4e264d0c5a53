"""The trainer a layout is priced for, where trainers differ in ways the layout does not name.

The planner prices this project's trainer (examples/deepseek_v3/train.py) by default. To check the model against
runs of another trainer (bench/plan_vs_published.py: SimuMax's published Megatron-LM runs) the differences that
move the step time are stated here rather than hidden in the device figures:
- the token dispatcher: 'flex' (mtdeepep, DeepEP's normal mode: one row per destination rank, an FP32 combine) or
  'alltoall' (Megatron's: one row per (token, expert) pair, the combine in the model dtype);
- whether the gradient reduction overlaps the last backward (this trainer's ZeRO-1 buckets do; Megatron without
  --overlap-grad-reduce reduces after the backward).
"""

from __future__ import annotations

from dataclasses import dataclass

DISPATCHERS = ("flex", "alltoall")


@dataclass(frozen=True)
class Framework:
    """name: a label. dispatcher: one of `DISPATCHERS`. combine_fp32: the combine moves FP32 rows.
    overlap_grad_reduce: bucketed gradient reduce-scatters overlap the last micro-batch's backward (no pipeline)."""

    name: str
    dispatcher: str = "flex"
    combine_fp32: bool = True
    overlap_grad_reduce: bool = True

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")


THIS_TRAINER = Framework("train.py")
# Megatron-LM as SimuMax's B200 / A100 runs used it (simu_tools/megatron_scripts/scripts/run_pretrain_deepseekv2.sh:
# --moe-token-dispatcher-type alltoall, --moe-expert-capacity-factor 1 with --moe-pad-expert-input-to-capacity,
# --use-distributed-optimizer without --overlap-grad-reduce).
MEGATRON_ALLTOALL = Framework("megatron-alltoall", dispatcher="alltoall", combine_fp32=False, overlap_grad_reduce=False)
FRAMEWORKS = {f.name: f for f in (THIS_TRAINER, MEGATRON_ALLTOALL)}
