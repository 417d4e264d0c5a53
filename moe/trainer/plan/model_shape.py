"""Closed-form sizes of a DeepSeek-V3 config for the planner: parameters, FLOPs and activation bytes per token.

Legend: V vocabulary, H hidden, F dense FFN, Fm expert FFN, Fs shared-expert FFN (`n_shared_experts * Fm`), L
decoder layers, N heads, Q `q_lora_rank` (None: a plain q_proj), C `kv_lora_rank`, Dn / Dr / Dv the per-head
no-rope key, rope key and value dims, Dq = Dn + Dr, E routed experts, K experts per token, D MTP depths, S sequence
length, b bytes per element of the model dtype, tp the tensor-parallel size, etp the expert tensor-parallel size
(each routed expert's FFN split over etp ranks: Fm / etp columns each).

Everything here follows this project's model (moe/trainer/models/deepseek_v3), not a generic transformer:
- parameters: the fused `qkv_a_proj [Q + C + Dr, H]`, `kv_b_proj [N (Dn + Dv), C]`, SwiGLU `w13 [H, 2F]` + `w2`,
  an FP32 router `[E, H]` per MoE layer, an MTP depth = a decoder layer + `enorm`, `hnorm`, `eh_proj [H, 2H]`,
  `shared_head.norm` (embedding and head shared). `tests/plan` checks the counts against the real model's.
- FLOPs: counted once, in moe/trainer/models/deepseek_v3/flops.py (2 per multiply-add, causal attention core); the step
  time prices the core's value side on Dq columns, because the model pads v from Dv to Dq for SDPA's fused
  kernels, while `model_flops_per_token` (what MFU divides by) counts the model's Dv. The routed experts' share
  on one rank is priced from the rows its expert shards receive (`expert_rows`, `expert_row_flops`): etp times
  the rows at 1/etp of the FLOPs each, the same FLOPs per rank as without ETP.
- activations: the tensors autograd keeps per token of a micro-batch (see `activation_bytes`), checked against the
  measured resident set of a real forward in `tests/plan`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from moe.trainer.models.deepseek_v3 import flops
from moe.trainer.models.deepseek_v3.attention import fuses_input_projections
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config

# The recompute choices the planner enumerates, as train.py flags (Megatron's options).
RECOMPUTE_CHOICES: dict[str, dict] = {
    "none": {},
    "selective": {"granularity": "selective", "modules": ("core_attn",)},
    # What DeepSeek-V3 recomputes (report, section 3.2.3: RMSNorm and MLA up-projections), plus the SwiGLU
    # activations and the core attention.
    "selective+": {"granularity": "selective", "modules": ("core_attn", "mla_up_proj", "layernorm", "moe_act")},
    "full": {"granularity": "full", "method": "uniform", "num_layers": 1},
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FP32 = 4


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, by how they are sharded.

    tp_sharded: split over the TP ranks (q_b_proj, kv_b_proj, o_proj, dense MLP). replicated: the same on every TP
    rank (norms, the fused down projection qkv_a_proj and its norms, the shared expert). router: the FP32 router
    weight (replicated). experts: the routed experts (split over EP).
    """

    tp_sharded: int
    replicated: int
    router: int
    experts: int

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.router + self.experts


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a `DeepseekV3Config` that the estimates use (see the module docstring's legend)."""

    V: int
    H: int
    F: int
    Fm: int
    Fs: int
    L: int
    N: int
    Q: int | None
    C: int
    Dn: int
    Dr: int
    Dv: int
    E: int
    K: int
    first_dense: int
    D: int
    tied: bool
    bias: bool
    fused: bool
    # The config the FLOPs are counted from (flops.py); not part of the shape's identity (equality, hash).
    config: DeepseekV3Config | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, c: DeepseekV3Config) -> ModelShape:
        return cls(
            V=c.vocab_size, H=c.hidden_size, F=c.intermediate_size, Fm=c.moe_intermediate_size,
            Fs=c.n_shared_experts * c.moe_intermediate_size, L=c.num_hidden_layers, N=c.num_attention_heads,
            Q=c.q_lora_rank, C=c.kv_lora_rank, Dn=c.qk_nope_head_dim, Dr=c.qk_rope_head_dim, Dv=c.v_head_dim,
            E=c.n_routed_experts, K=c.num_experts_per_tok, first_dense=c.first_k_dense_replace,
            D=c.num_nextn_predict_layers, tied=c.tie_word_embeddings, bias=c.attention_bias,
            fused=fuses_input_projections(c), config=c,
        )  # fmt: skip

    # -- derived sizes

    @property
    def Dq(self) -> int:
        return self.Dn + self.Dr

    @property
    def q_in(self) -> int:
        """Width of the query input: the q LoRA rank, or the plain q_proj's N * Dq."""
        return self.Q if self.Q is not None else self.N * self.Dq

    def is_moe(self, layer: int) -> bool:
        """Decoder layer `layer` (MTP depth k is layer L + k - 1) is an MoE layer."""
        return layer >= self.first_dense

    # -- parameters

    def attention_params(self) -> tuple[int, int]:
        """`(tp_sharded, replicated)` parameters of one MLA block."""
        H, N, C, Dr, Dv = self.H, self.N, self.C, self.Dr, self.Dv
        if self.fused:
            replicated = H * (self.q_in + C + Dr) + (self.q_in + C + Dr) * self.bias
        else:  # q_proj without bias, kv_a_proj_with_mqa with one
            replicated = H * self.N * self.Dq + H * (C + Dr) + (C + Dr) * self.bias
        replicated += C + (self.Q or 0)  # kv_a_layernorm, q_a_layernorm
        sharded = C * N * (self.Dn + Dv) + N * Dv * H + (self.Q * N * self.Dq if self.Q is not None else 0)
        return sharded, replicated + H * self.bias  # o_proj's bias is added after the reduction: replicated

    def layer_params(self, layer: int) -> LayerParams:
        """Parameters of decoder layer `layer` (an MTP depth's decoder layer included, its extras not)."""
        return self._layer_params(self.is_moe(layer))

    @functools.cache  # noqa: B019 (a frozen dataclass: the cache keys on its fields, few shapes per process)
    def _layer_params(self, moe: bool) -> LayerParams:
        sharded, replicated = self.attention_params()
        replicated += 2 * self.H  # input_layernorm, post_attention_layernorm
        if not moe:
            return LayerParams(sharded + 3 * self.H * self.F, replicated, 0, 0)
        return LayerParams(sharded, replicated + 3 * self.H * self.Fs, self.E * self.H, self.E * 3 * self.H * self.Fm)

    def mtp_extra_params(self) -> int:
        """An MTP depth's own parameters besides its decoder layer: enorm, hnorm, eh_proj [H, 2H], the head norm."""
        return 3 * self.H + 2 * self.H * self.H

    def embedding_params(self) -> int:
        return self.V * self.H

    def head_params(self) -> int:
        """The output head's own parameters (0 when tied to the embedding)."""
        return 0 if self.tied else self.V * self.H

    def total_params(self) -> int:
        """Main model parameters (embedding, layers, final norm, head; MTP excluded), as DeepSeek counts 671B."""
        layers = sum(self.layer_params(i).total for i in range(self.L))
        return self.embedding_params() + layers + self.H + self.head_params()

    def activated_params(self) -> int:
        """Main-model parameters one token computes with: K/E of every routed expert, one embedding row."""
        layers = 0.0
        for i in range(self.L):
            p = self.layer_params(i)
            layers += p.total - p.experts + p.experts * self.K / self.E
        return round(self.H + layers + self.H + self.head_params())  # the head in full (DeepSeek's convention)

    def mtp_params(self) -> int:
        return sum(self.layer_params(self.L + k).total + self.mtp_extra_params() for k in range(self.D))

    # -- FLOPs per token, forward (moe/trainer/models/deepseek_v3/flops.py is the one count; these are its planner
    # views)

    def _flops_config(self) -> DeepseekV3Config:
        if self.config is None:
            raise ValueError("FLOPs are counted from the model config: build the shape with ModelShape.from_config")
        return self.config

    def attention_flops(self, seq_len: int) -> tuple[float, float]:
        """`(projection GEMMs, causal core)` forward FLOPs per token of one MLA block, the core on the padded value
        columns the implementation computes (what the step time prices)."""
        c = self._flops_config()
        return flops.attention_projection_flops(c), flops.attention_core_flops(c, seq_len, padded_values=True)

    def ffn_flops(self, layer: int) -> dict[str, float]:
        """Forward FLOPs per token of layer `layer`'s feed-forward: 'gemm' (model dtype / FP8), 'router' (FP32)."""
        gemm, router = flops.ffn_flops(self._flops_config(), layer)
        return {"gemm": gemm, "router": router}

    def expert_rows(self, etp: int = 1) -> int:
        """Rows the routed experts compute per routed token: K experts, each split over `etp` ranks that all receive
        the token (Megatron's flex dispatcher over the folded EP x ETP group)."""
        return self.K * etp

    def expert_row_flops(self, etp: int = 1) -> float:
        """Forward FLOPs of one row through one expert shard of `Fm / etp` columns: gate/up `[H, 2 Fm / etp]`
        (column parallel) and down `[Fm / etp, H]` (row parallel, a partial output the combine sums)."""
        return 6.0 * self.H * self.Fm / etp

    def head_flops(self) -> float:
        return flops.head_flops(self._flops_config())

    def mtp_extra_flops(self) -> float:
        return flops.mtp_input_flops(self._flops_config())

    def model_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of one training token (forward + backward, main model and MTP; `flops.model_flops_per_token`:
        causal core on the model's Dv value columns, no recompute)."""
        return flops.model_flops_per_token(self._flops_config(), seq_len)

    # -- activations

    def activation_bytes(
        self, layer: int, *, dtype: str, tp: int, recompute: str, fp8: str = "none", etp: int = 1
    ) -> float:
        """Bytes autograd keeps per token of a micro-batch (its B*S tokens, whole sequences) for decoder layer
        `layer` on one rank, until the layer's backward.

        Per component (elements per token, b bytes each unless FP32; /tp where sequence or heads are split):
            norm     RMSNorm input (FP32 model) or its FP32 copy + normalised value (BF16): H*b or H*(4+b);
                     'layernorm' recompute keeps only the input (H*b)
            a        the input norm's output, kept by qkv_a_proj: H*b ('layernorm': rebuilt)
            lat      qkv_a_proj's output [Q + C + Dr] (its slices feed the q/kv norms and the rope key)
            lnorm    q/kv norms' outputs (Q + C), FP32 copies in BF16; under TP the gathered latents (whole seq)
            qb       q_b_proj's output N*Dq (its rope slice kept by the rotation); 'mla_up_proj': rebuilt
            qkv      q, k, v of the core, 3*N*Dq; 'mla_up_proj': rebuilt
            core     SDPA's output N*Dq and log-sum-exp (FP32 N); 'core_attn': recomputed
            o_in     o_proj's input N*Dv
            dense    fc1 output 2F, SiLU F, product F ('moe_act': the last two rebuilt); under TP the gathered
                     input H (whole seq)
            router   FP32 logits / scores / selection, ~4E*4 bytes ('moe_act' recomputes the router)
            experts  K rows of: input H, fc1 2Fm, SiLU Fm, product Fm ('moe_act': the last two rebuilt), output H;
                     under expert tensor parallelism (`etp` > 1) each of the K rows reaches the etp ranks holding a
                     shard of its expert: K * etp rows of input H, fc1 2Fm/etp, SiLU and product Fm/etp, partial
                     output H (`expert_rows`), so the H-wide parts grow etp-fold and the Fm-wide parts stay
            shared   fc1 2Fs, SiLU Fs, product Fs
        'full' recompute keeps only the layer's input (H*b/tp). FP8 ('blockwise' keeps the high-precision GEMM
        inputs plus their FP8 copies, 1 byte each; 'delayed' keeps only the FP8 copies) changes the GEMM inputs.
        """
        return self._activation_bytes(self.is_moe(layer), dtype, tp, recompute, fp8, etp)

    @functools.cache  # noqa: B019
    def _activation_bytes(self, moe: bool, dtype: str, tp: int, recompute: str, fp8: str, etp: int) -> float:
        b = DTYPE_BYTES[dtype]
        if recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute must be one of {tuple(RECOMPUTE_CHOICES)}, got {recompute!r}")
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1 or self.Fm % etp:
            raise ValueError(f"etp must be a positive divisor of moe_intermediate_size={self.Fm}, got {etp!r}")
        H, N, C, Dr, Dq = self.H, self.N, self.C, self.Dr, self.Dq
        if recompute == "full":
            return H * b / tp
        modules = set(RECOMPUTE_CHOICES[recompute].get("modules", ()))
        norm_full = H * b if b == FP32 else H * (FP32 + b)
        norm = H * b if "layernorm" in modules else norm_full
        a = 0 if "layernorm" in modules else H * b
        lat = (self.q_in + C + Dr) * b
        q_lora = self.Q if self.Q is not None else 0
        lnorm_local = (q_lora + C) * (b if b == FP32 else FP32 + 2 * b)
        if tp > 1:
            lnorm = (q_lora + C) * (0 if b == FP32 else FP32 + b) / tp + (self.q_in + C + Dr) * b  # gathered: /1
            lat_rank = lat / tp
        else:
            lnorm, lat_rank = lnorm_local, lat
        up = 0 if "mla_up_proj" in modules else (N * Dq * b + 3 * N * Dq * b)
        if "mla_up_proj" in modules and tp == 1:
            up += Dr * b  # the rope key's own copy (recompute keeps it)
        core = 0 if "core_attn" in modules else N * Dq * b + N * FP32
        o_in = N * self.Dv * b
        attention = (norm + a + up + core + o_in) / tp + lat_rank + lnorm
        post = (norm + (0 if "layernorm" in modules else H * b)) / tp
        gemm_in_extra = 0.0  # FP8 copies of GEMM inputs (see the docstring)
        if not moe:
            F = self.F
            act = 0 if "moe_act" in modules else 2 * F * b
            gathered = H * b if tp > 1 else 0
            ffn = gathered + (2 * F * b + act) / tp
            gemm_inputs = H + F / tp
        else:
            K, Fm, Fs = self.K, self.Fm, self.Fs
            router = 0 if "moe_act" in modules else 4 * self.E * FP32 + (H * FP32 if b != FP32 else 0)
            act = 0 if "moe_act" in modules else 2 * Fm * b
            rows = self.expert_rows(etp)  # K * etp rows of Fm / etp columns each
            experts = rows * (H * b + H * b) + K * (2 * Fm * b + act)
            shared = 4 * Fs * b
            ffn = (router + experts + shared) / tp
            gemm_inputs = (rows * H + K * Fm + H + Fs) / tp
        gemm_inputs += (self.q_in + C + Dr) / tp + (N * self.Dv) / tp + H / tp  # MLA's GEMM inputs
        if fp8 == "blockwise":
            gemm_in_extra = gemm_inputs * 1.0
        elif fp8 == "delayed":
            gemm_in_extra = -gemm_inputs * (b - 1)
        return max(attention + post + ffn + gemm_in_extra, H * b / tp)

    def mtp_extra_activation_bytes(self, *, dtype: str, tp: int) -> float:
        """Per token, an MTP depth's own kept tensors besides its decoder layer and head: the enorm / hnorm inputs
        and their outputs (the concatenation eh_proj keeps, 2H)."""
        b = DTYPE_BYTES[dtype]
        norm_full = self.H * b if b == FP32 else self.H * (FP32 + b)
        return (2 * norm_full + 2 * self.H * b) / tp

    def head_activation_bytes(self, *, dtype: str, tp: int, kept_logits: bool, norm: bool = True) -> float:
        """Per token, one output head: the final norm's input and output (gathered whole-sequence under TP), the
        FP32 log-softmax of the cross entropy ([V/tp]), and with `kept_logits` the logits the trainer's output holds
        until the step's backward ends (the main head's). `norm=False`: the norm ran inside a checkpoint (an MTP
        depth under 'full' recompute), only the head's input is kept."""
        b = DTYPE_BYTES[dtype]
        norm_full = self.H * b if b == FP32 else self.H * (FP32 + b)
        gathered = self.H * b if tp > 1 else 0
        logits = self.V * b / tp if kept_logits else 0
        norm_bytes = norm_full / tp if norm else 0
        return norm_bytes + self.H * b / tp + gathered + self.V * FP32 / tp + logits

    def stage_activation_bytes(
        self,
        layers: list[int],
        *,
        first: bool,
        last: bool,
        dtype: str,
        tp: int,
        recompute: str,
        fp8: str = "none",
        etp: int = 1,
    ) -> float:
        """Per token of a micro-batch: what one micro-batch keeps on a stage holding decoder `layers`, with the
        MTP depths and heads when `last` (the embedding keeps nothing but indices). 'full' recompute checkpoints
        every MTP depth too (train.py's 'uniform' method)."""
        kw = dict(dtype=dtype, tp=tp, recompute=recompute, fp8=fp8, etp=etp)
        total = sum(self.activation_bytes(i, **kw) for i in layers)
        if last:
            total += self.head_activation_bytes(dtype=dtype, tp=tp, kept_logits=True)
            for k in range(self.D):
                full = recompute == "full"  # a checkpointed depth keeps its inputs: slices of tensors kept anyway
                if not full:
                    total += self.activation_bytes(self.L + k, **kw)
                    total += self.mtp_extra_activation_bytes(dtype=dtype, tp=tp)
                total += self.head_activation_bytes(dtype=dtype, tp=tp, kept_logits=False, norm=not full)
        return total
