"""Tensor and sequence parallelism building blocks: region mappings (mappings.py), parameter shards and their tags
(sharding.py), column / row / vocab parallel layers (layers.py), vocab-parallel cross entropy (cross_entropy.py).

Where torch's DTensor tensor parallelism (`parallelize_module` with ColwiseParallel / RowwiseParallel /
SequenceParallel) serves and where it does not is written in moe/trainer/models/deepseek_v3/tensor_parallel.py.
"""

from moe.layer.parallel.cross_entropy import vocab_parallel_cross_entropy
from moe.layer.parallel.layers import ColumnParallelLinear, ParallelSwiGLUMLP, RowParallelLinear, VocabParallelEmbedding
from moe.layer.parallel.mappings import (
    SequenceShards,
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
)
from moe.layer.parallel.sharding import TPShard, gather_shards, tag_sequence_parallel_grad, tag_sharded, tp_shard_of

__all__ = [
    "ColumnParallelLinear",
    "ParallelSwiGLUMLP",
    "RowParallelLinear",
    "SequenceShards",
    "TPShard",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel",
    "gather_from_sequence_parallel",
    "gather_shards",
    "reduce_from_tensor_parallel",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "tag_sequence_parallel_grad",
    "tag_sharded",
    "tp_shard_of",
    "vocab_parallel_cross_entropy",
]
