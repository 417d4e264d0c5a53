"""Model FLOPs of DeepSeek-V3 (this project's model, moe/trainer/models/deepseek_v3), counted from its config: what MFU
divides by (examples/deepseek_v3/train.py) and what the planner's step-time estimate prices
(moe/trainer/plan/model_shape.py).

Legend: V vocabulary, H hidden, F dense FFN, Fm expert FFN, Fs shared-expert FFN (`n_shared_experts * Fm`), L decoder
layers, N heads, Q `q_lora_rank` (None: a plain q_proj of N*Dq outputs), C `kv_lora_rank`, Dn / Dr / Dv the per-head
no-rope key, rope key and value dims, Dq = Dn + Dr, E routed experts, K experts per token, D MTP depths, S sequence
length.

Convention (PaLM's "model FLOPs"; Megatron-LM's `num_floating_point_operations` and torchtitan's
`get_num_flop_per_token` count the same way up to the causal attention, see below):
- Matrix products only, 2 FLOPs per multiply-add. Per token, forward:
      MLA projections    2 (H (q_in + C + Dr) + [Q N Dq] + C N (Dn + Dv) + N Dv H)   q_in = Q, or N Dq without LoRA
      attention core     2 N (Dq + Dv) x (keys attended)                              q k^T and p v
      dense MLP          6 H F                                                        SwiGLU: w13 [H, 2F], w2 [F, H]
      MoE layer          6 H (K Fm + Fs) + 2 H E                                      K routed + shared experts, the
                                                                                      FP32 router gate
      output head        2 H V                                                        per head: main and each depth
      MTP input          2 (2H) H                                                     eh_proj [H, 2H], per depth
  Norms, RoPE, SwiGLU's products, the softmax, the embedding lookup, the cross entropy and the optimizer are not
  counted (element-wise, memory-bound work).
- Backward = 2 x forward for every product (one input-gradient and one weight-gradient product per forward product;
  the attention core's backward counted 2 x its forward too, as Megatron and torchtitan do), so a training step is
  3 x the forward. Recompute is not counted: it is hardware work, not model work (the same step with or without
  recompute has the same model FLOPs).
- Causal attention: query i (1-based) attends to i keys, S (S + 1) / 2 score entries per sequence, (S + 1) / 2 per
  token on average. Megatron counts S / 2 per token the same way; torchtitan counts the full S (2x this).
- Values: Dv columns, the model's. The implementation pads v to Dq columns for SDPA's fused kernels
  (attention.py); `padded_values=True` counts what runs instead (the planner's timing does).
- Routed experts: K per token. Routing is dropless top-K (moe_block.py): every token reaches exactly K experts,
  however unbalanced the loads are, so the count does not depend on the routing.
- MTP depth k runs on the S - k positions whose token i + k exists (model.py), its head too: per token of the
  batch, a depth counts (S - k) / S of a layer and a head.
Per token = per sequence / S, the tokens being the batch's `B * S` input positions (the trainer's tokens/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config

# Forward + backward of a matrix product, in forwards (see the module docstring).
TRAINING_FORWARDS = 3.0


def q_input_width(config: DeepseekV3Config) -> int:
    """Width of the query input: the q LoRA rank, or the plain q_proj's N * Dq."""
    c = config
    return c.q_lora_rank if c.q_lora_rank is not None else c.num_attention_heads * c.qk_head_dim


def attention_projection_flops(config: DeepseekV3Config) -> float:
    """Forward FLOPs per token of one MLA block's projections: the query input and kv latent (fused or not, the
    same products), q_b_proj (with q LoRA), kv_b_proj and o_proj."""
    c = config
    N, Dq = c.num_attention_heads, c.qk_head_dim
    down = c.hidden_size * (q_input_width(c) + c.kv_lora_rank + c.qk_rope_head_dim)
    q_up = c.q_lora_rank * N * Dq if c.q_lora_rank is not None else 0
    kv_up = c.kv_lora_rank * N * (c.qk_nope_head_dim + c.v_head_dim)
    out = N * c.v_head_dim * c.hidden_size
    return 2.0 * (down + q_up + kv_up + out)


def attention_core_flops(
    config: DeepseekV3Config, seq_len: int, *, causal: bool = True, padded_values: bool = False
) -> float:
    """Forward FLOPs per token of one MLA block's core (`q k^T` and `p v`) over sequences of `seq_len` positions:
    (S + 1) / 2 keys per query on average when `causal`, S otherwise; Dv value columns, or Dq with `padded_values`
    (what SDPA computes after the padding, attention.py)."""
    c = config
    keys = (seq_len + 1) / 2 if causal else float(seq_len)
    value_cols = max(c.v_head_dim, c.qk_head_dim) if padded_values else c.v_head_dim
    return 2.0 * c.num_attention_heads * (c.qk_head_dim + value_cols) * keys


def ffn_flops(config: DeepseekV3Config, layer: int) -> tuple[float, float]:
    """`(GEMMs, router)` forward FLOPs per token of decoder layer `layer`'s feed-forward (MTP depth k is layer
    L + k - 1): the dense SwiGLU MLP, or K routed experts + the shared experts and the FP32 router gate."""
    c = config
    H = c.hidden_size
    if not c.is_moe_layer(layer):
        return 6.0 * H * c.intermediate_size, 0.0
    shared = c.n_shared_experts * c.moe_intermediate_size
    return 6.0 * H * (c.num_experts_per_tok * c.moe_intermediate_size + shared), 2.0 * H * c.n_routed_experts


def head_flops(config: DeepseekV3Config) -> float:
    """Forward FLOPs per token of one output head (the main one, or an MTP depth's: the same weight)."""
    return 2.0 * config.hidden_size * config.vocab_size


def mtp_input_flops(config: DeepseekV3Config) -> float:
    """Forward FLOPs per token of an MTP depth's input projection `eh_proj [H, 2H]`."""
    return 2.0 * 2 * config.hidden_size * config.hidden_size


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token of the whole model (main model and MTP depths), by kind of product.

    linear: the projections, MLPs, experts (routed and shared) and `eh_proj`, in the model dtype (or FP8).
    router: the FP32 router gates.
    head: the output heads (main and MTP).
    attention_core: `q k^T` and `p v`.
    """

    linear: float
    router: float
    head: float
    attention_core: float

    @property
    def gemms(self) -> float:
        """The products of weights (everything but the attention core)."""
        return self.linear + self.router + self.head

    @property
    def total(self) -> float:
        return self.gemms + self.attention_core


def forward_flops(
    config: DeepseekV3Config, seq_len: int, *, causal: bool = True, padded_values: bool = False
) -> ForwardFlops:
    """Forward FLOPs per token of sequences of `seq_len` positions (see the module docstring; `causal` and
    `padded_values` as `attention_core_flops`)."""
    c = config
    S = seq_len
    # (positions a part runs on, decoder layer index): the main layers, then each MTP depth's layer.
    layers = [(S, i) for i in range(c.num_hidden_layers)]
    depths = [S - k for k in range(1, c.num_nextn_predict_layers + 1) if S - k > 0]
    layers += [(positions, c.num_hidden_layers + k) for k, positions in enumerate(depths)]
    linear = router = core = 0.0
    projections = attention_projection_flops(c)
    for positions, layer in layers:
        gemm, gate = ffn_flops(c, layer)
        linear += positions * (projections + gemm)
        router += positions * gate
        core += positions * attention_core_flops(c, positions, causal=causal, padded_values=padded_values)
    linear += sum(depths) * mtp_input_flops(c)
    head = (S + sum(depths)) * head_flops(c)
    return ForwardFlops(linear=linear / S, router=router / S, head=head / S, attention_core=core / S)


def model_flops_per_token(config: DeepseekV3Config, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x the forward, causal attention, Dv value columns,
    K routed experts, the MTP depths on their S - k positions; see the module docstring), per token of a batch of
    `seq_len`-position sequences."""
    return TRAINING_FORWARDS * forward_flops(config, seq_len).total
