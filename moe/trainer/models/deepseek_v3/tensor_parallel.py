"""Tensor + sequence parallelism of `DeepseekV3ForCausalLM` (Megatron-core's layout), applied to a built model.

Legend: B sequences, S positions, S_r this rank's positions, H hidden, N heads, V vocabulary, tp the TP size.

Every TP rank runs the same sequences (those of its data-parallel rank). Outside the TP regions the residual
stream is split along the sequence (`SequenceShards`: rank r holds `[B, S_r, H]`); inside them every rank sees the
whole sequence and a part of the weights:

    embedding      vocab-parallel rows [V/tp, H]; the partial embeddings are reduce-scattered to [B, S_r, H]
    norms          replicated, on [B, S_r, H]
    MLA            qkv_a_proj (q_a / kv_a fused) and q_a / kv_a_layernorm replicated, on the local positions (as
                   Megatron's MLA with "duplicated" down projections); the latents [B, S_r, Q + C + Dr] (narrower
                   than H) all-gathered once; q_b_proj and kv_b_proj column parallel by heads, the attention core
                   on N/tp heads over the whole sequence, o_proj row parallel, reduce-scattered to [B, S_r, H].
                   Without q LoRA the replicated q_proj's output is gathered with the latents and the rank keeps
                   its heads' columns.
    dense MLP      all-gather, w13 [H, 2F/tp] (this rank's gate and up columns), w2 [F/tp, H], reduce-scatter
    MoE layer      fed [B, S_r, H]: routes and dispatches this rank's positions through its (folded) ep_group;
                   router and shared expert replicated; 'seq_aux_loss' sums the per-sequence counts over the TP
                   group (`tp_cp_group`), so the ranks' losses add up to the sequence's loss
    head + loss    all-gather [B, S, H], head rows [V/tp, H] -> logits [B, S, V/tp], vocab-parallel cross entropy
    MTP depth k    the previous depth's positions resharded over the S - k positions (gather, slice, scatter), the
                   shifted embedding reduce-scattered from the whole-sequence partial sums, `enorm`/`hnorm`/
                   `eh_proj` replicated on the local positions, the decoder layer as above, the shared head.

Gradients: a parameter sharded over TP is tagged `tensor_parallel_dim` (and `tensor_parallel_shard`); every other
dense parameter is replicated and only ever sees this rank's positions (no replicated parameter is used inside a
TP region), so its gradient is a partial sum, tagged `sequence_parallel_grad`: summing it over the TP group gives
the full gradient. Expert parameters are tagged `expert_parallel` by the model.

Loss: the vocab-parallel cross entropy gives every TP rank the same per-token losses, so `lm_loss_sum`,
`mtp_loss_sums` and the counts are the loss of this data-parallel rank's batch, identical on its TP ranks; each TP
rank back-propagates it once (the gradients reach disjoint shards or partial sums). The returned `logits` are this
rank's vocabulary columns `[B, S, V/tp]` from `model.vocab_start`.

Weights: `parallelize` slices the one-process modules, so built from the same seed the shards are exact slices of
the one-process weights, and `init_weights` after it draws every whole tensor and keeps the slice (init.py).
`full_state_dict` gathers the shards (state.py); `load_full_state_dict` slices them.

Where torch's DTensor tensor parallelism serves, and where it did not (measured in
tests/train/test_tensor_parallel.py::test_dtensor_parallelize_module_on_mla and the report of issue 11):
`parallelize_module` with ColwiseParallel / RowwiseParallel / SequenceParallel expresses the MLA and MLP plans
above, but (1) the MoE layer and the mtdeepep dispatch take plain local tensors of this rank's tokens, so every MoE
layer would need to_local / from_local at its borders; (2) the parameters become DTensors, which the FP8 recipes'
`linear_fn` (its own autograd function over plain tensors, casts and amax included), the ZeRO-1 optimizer's flat
buffers, and the byte-wise state-dict gathers would all have to unwrap; (3) DTensor's SequenceParallel shards a
sequence into equal parts only, while MTP depth k runs on S - k positions; (4) the replicated down projections
under sequence parallelism (partial-sum gradients, our contract's `sequence_parallel_grad`) and the vocab-parallel
cross entropy with FP32 accumulation and -100 targets are not among its styles (`loss_parallel` works on a DTensor
of logits sharded on the last dim, which the head would produce, but returns a mean). So the layers here are plain
modules whose weights are local shards, with the collectives written out as Megatron's mappings (moe/layer/parallel/).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from moe.layer.experts import SwiGLUMLP
from moe.layer.moe_layer import MoELayer
from moe.layer.parallel.layers import ColumnParallelLinear, ParallelSwiGLUMLP, RowParallelLinear, VocabParallelEmbedding
from moe.layer.parallel.sharding import tag_sequence_parallel_grad
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config


def check_tensor_parallel(config: DeepseekV3Config, tp: int) -> None:
    """ValueError naming every size of `config` that does not split over `tp` ranks (before any communication)."""
    broken = []
    if config.num_attention_heads % tp:
        broken.append(f"num_attention_heads={config.num_attention_heads}")
    if config.vocab_size % tp:
        broken.append(f"vocab_size={config.vocab_size}")
    layers = range(config.num_hidden_layers + config.num_nextn_predict_layers)
    if any(not config.is_moe_layer(i) for i in layers) and config.intermediate_size % tp:
        broken.append(f"intermediate_size={config.intermediate_size} (dense MLP)")
    if broken:
        raise ValueError(f"tensor parallelism over {tp} ranks needs these divisible by {tp}: " + ", ".join(broken))


def parallelize(model: nn.Module, parallel) -> nn.Module:
    """Turn `model` (a `DeepseekV3ForCausalLM` built with `ep_group=parallel.expert_model_group`) into its TP + SP
    form over `parallel.tp_group` in place, and return it. A no-op when tp is 1. See the module docstring."""
    tp = parallel.layout.tp
    if tp == 1:
        return model
    return apply_tensor_parallel(model, parallel.tp_group, parallel.tp_rank, tp)


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup, rank: int, size: int) -> nn.Module:
    """`parallelize` for an explicit TP `group` where this process is `rank` of `size`."""
    check_tensor_parallel(model.config, size)
    if getattr(model, "tp_group", None) is not None:
        raise ValueError("the model is already tensor parallel")
    if dist.get_world_size(group) != size or dist.get_rank(group) != rank:
        raise ValueError(f"rank {rank} of {size} does not match the TP group ({dist.get_rank(group)} of "
                         f"{dist.get_world_size(group)})")  # fmt: skip

    model.embed_tokens = VocabParallelEmbedding.from_embedding(model.embed_tokens, rank, size)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear.from_linear(model.lm_head, rank, size)
    for layer in (*model.layers, *model.mtp):
        attn = layer.self_attn
        attn.num_heads //= size
        attn.head_start = rank * attn.num_heads
        if attn.q_b_proj is not None:
            attn.q_b_proj = ColumnParallelLinear.from_linear(attn.q_b_proj, rank, size)
        attn.kv_b_proj = ColumnParallelLinear.from_linear(attn.kv_b_proj, rank, size)
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, rank, size, group)
        if isinstance(layer.mlp, MoELayer):
            layer.mlp.tp_cp_group = group
        elif isinstance(layer.mlp, SwiGLUMLP):
            layer.mlp = ParallelSwiGLUMLP.from_mlp(layer.mlp, rank, size)
    for param in model.parameters():
        if not hasattr(param, "tensor_parallel_dim") and not getattr(param, "expert_parallel", False):
            tag_sequence_parallel_grad(param)
    model.tp_group = group
    return model
