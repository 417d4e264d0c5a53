"""What a parallel layout and a batch ask of a DeepSeek-V3 model config: the rules the trainer checks before any
process group exists (examples/deepseek_v3/train.py) and the planner applies to every candidate layout
(moe/trainer/plan/space.py), from one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe.trainer.models.deepseek_v3.tensor_parallel import check_tensor_parallel

if TYPE_CHECKING:
    from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
    from moe.trainer.train.parallel_state import Layout
    from moe.trainer.train.training_config import TrainingConfig


def check_model_layout(model_cfg: DeepseekV3Config, train_cfg: TrainingConfig, layout: Layout) -> None:
    """What the layout and the batch ask of the model config (ValueError, before any process group). The routing
    settings themselves (e.g. a top-k larger than the experts of the allowed groups) are checked by
    `DeepseekV3Config`."""
    check_expert_tensor_parallel(model_cfg, layout.etp, layout.fp8)
    layout.check_experts(model_cfg.n_routed_experts)
    layout.check_batch(train_cfg.global_batch, train_cfg.micro_batches)
    check_tensor_parallel(model_cfg, layout.tp)
    if train_cfg.seq_len < layout.tp + model_cfg.num_nextn_predict_layers:
        raise ValueError(
            f"seq_len={train_cfg.seq_len} is shorter than --tp {layout.tp} + MTP depth "
            f"{model_cfg.num_nextn_predict_layers}: a sequence-parallel rank would hold no position"
        )
    if train_cfg.seq_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len={train_cfg.seq_len} exceeds max_position_embeddings={model_cfg.max_position_embeddings}"
        )
    if train_cfg.seq_len < 2 + model_cfg.num_nextn_predict_layers:
        raise ValueError(
            f"seq_len={train_cfg.seq_len} leaves no target for MTP depth {model_cfg.num_nextn_predict_layers}"
        )


def check_expert_tensor_parallel(model_cfg: DeepseekV3Config, etp: int, fp8: str) -> None:
    """What splitting every routed expert's FFN over `etp` ranks asks of the model under the FP8 recipe `fp8`
    (ValueError): whole shards, and with block-wise scaling whole 128-wide tiles in each shard (the shard is the down
    projection's reduction dimension; per-tensor scaling has no tiles)."""
    if model_cfg.moe_intermediate_size % etp:
        raise ValueError(
            f"--etp {etp}: moe_intermediate_size={model_cfg.moe_intermediate_size} (each routed expert's FFN, split "
            f"over the expert tensor-parallel ranks) is not divisible by {etp}"
        )
    shard = model_cfg.moe_intermediate_size // etp
    if etp > 1 and fp8 == "blockwise" and shard % 128:
        raise ValueError(
            f"--etp {etp} with --fp8 blockwise: each expert's FFN shard ({shard} = moe_intermediate_size "
            f"{model_cfg.moe_intermediate_size} / {etp}) is the down projection's reduction dimension, which the "
            "1x128 / 128x128 tiles need as a multiple of 128"
        )
