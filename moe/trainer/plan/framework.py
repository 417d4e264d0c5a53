"""The trainer a layout is priced for, where trainers differ in ways the layout does not name.

The planner prices this project's trainer (examples/deepseek_v3/train.py) by default. To check the model against
runs of another trainer (bench/plan_vs_published.py: SimuMax's published Megatron-LM runs) the differences that
move the step time are stated here rather than hidden in the device figures:
- the token dispatcher: 'flex' (mtdeepep, DeepEP's normal mode: one row per destination rank, an FP32 combine) or
  'alltoall' (Megatron's: one row per (token, expert) pair, the combine in the model dtype);
- whether the gradient reduction overlaps the last backward (this trainer's ZeRO-1 buckets do; Megatron without
  --overlap-grad-reduce reduces after the backward);
- what the kernels keep for the backward: a fused cross entropy (Megatron's --cross-entropy-loss-fusion keeps no
  FP32 log-softmax and no FP32 logits gradients, only the logits gradient it computes in the forward, in the model
  dtype) and fused RMSNorms (Transformer Engine keeps the BF16 input and a per-token FP32 scale, where this
  trainer's norm keeps an FP32 copy of its input too);
- the optimizer step's memory traffic beyond AdamW's 28 bytes per parameter (timing.OPTIMIZER_BYTES_PER_PARAM):
  Megatron's distributed optimizer also copies every updated FP32 master shard into the BF16 parameters (read 4,
  write 2), reads the gradient shard for the clipping norm (4; --clip-grad 1.0), and zeroes the whole local FP32
  gradient buffer every step (write 4 per local parameter, not only the shard).
"""

from __future__ import annotations

from dataclasses import dataclass

DISPATCHERS = ("flex", "alltoall")


@dataclass(frozen=True)
class Framework:
    """name: a label. dispatcher: one of `DISPATCHERS`. combine_fp32: the combine moves FP32 rows.
    overlap_grad_reduce: bucketed gradient reduce-scatters overlap the last micro-batch's backward (no pipeline).
    fused_cross_entropy / fused_norms: see the module docstring. shard_bytes_per_param / buffer_bytes_per_param:
    the optimizer step's extra bytes per parameter of the rank's optimizer shard / of its whole gradient buffer."""

    name: str
    dispatcher: str = "flex"
    combine_fp32: bool = True
    overlap_grad_reduce: bool = True
    fused_cross_entropy: bool = False
    fused_norms: bool = False
    shard_bytes_per_param: float = 0.0
    buffer_bytes_per_param: float = 0.0

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}")


THIS_TRAINER = Framework("train.py")
# Megatron-LM as SimuMax's B200 / A100 runs used it (simu_tools/megatron_scripts/scripts/run_pretrain_deepseekv2.sh:
# --moe-token-dispatcher-type alltoall, --moe-expert-capacity-factor 1 with --moe-pad-expert-input-to-capacity,
# --use-distributed-optimizer without --overlap-grad-reduce; the B200 cases' "_cef": cross-entropy fusion;
# --transformer-impl transformer_engine: TE's fused RMSNorm).
MEGATRON_ALLTOALL = Framework(
    "megatron-alltoall",
    dispatcher="alltoall",
    combine_fp32=False,
    overlap_grad_reduce=False,
    fused_cross_entropy=True,
    fused_norms=True,
    shard_bytes_per_param=4 + 2 + 4,
    buffer_bytes_per_param=4,
)
FRAMEWORKS = {f.name: f for f in (THIS_TRAINER, MEGATRON_ALLTOALL)}
