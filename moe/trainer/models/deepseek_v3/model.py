"""`DeepseekV3ForCausalLM`: DeepSeek-V3 (MLA, DeepSeekMoE on `moe.MoELayer`, multi-token prediction) for training.

Legend: B sequences, S tokens per sequence, H hidden, V vocabulary, D MTP depths.

Layout (state-dict names, see `full_state_dict`):
    embed_tokens.weight [V, H]
    layers.{i}.*                         decoder layers (block.py: input_layernorm, self_attn.*,
                                         post_attention_layernorm, mlp.*)
    norm.weight [H]                      final norm
    lm_head.weight [V, H]                output head (absent with tie_word_embeddings: the embedding is the head)
    mtp.{k}.*                            MTP depth k+1 (mtp.py)
transformers' names are `model.` + these for the main model (fused / transposed weights differ: see hf.py), and
`model.layers.{num_hidden_layers + k}.*` for the MTP modules.

Expert parallelism: with an `ep_group` of R > 1 ranks every MoE layer keeps experts `[r*E/R, (r+1)*E/R)` and moves
tokens with the 'flex' (mtdeepep) dispatcher; everything else is replicated (its gradients must be summed over the
ranks, as data-parallel gradients are). Each rank runs its own sequences. With an `etp_group` of P > 1 ranks,
`ep_group` is the folded EP x ETP group and each of those experts is split over P ranks along its FFN dimension
(moe/layer/moe_layer.py, moe/layer/dispatcher/etp.py).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe.layer import wgrad
from moe.layer.balancing import AuxLossScale, group_size
from moe.layer.dispatcher import EPBuffers
from moe.layer.moe_layer import MoELayer
from moe.layer.parallel.cross_entropy import vocab_parallel_cross_entropy
from moe.layer.parallel.mappings import (
    SequenceShards,
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
)
from moe.trainer.models.deepseek_v3 import documents
from moe.trainer.models.deepseek_v3 import full_state as state
from moe.trainer.models.deepseek_v3.attention import ATTENTION_BACKENDS, MultiHeadLatentAttention
from moe.trainer.models.deepseek_v3.block import DecoderLayer
from moe.trainer.models.deepseek_v3.init import draw_seed, init_weights
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config
from moe.trainer.models.deepseek_v3.model_recompute import RecomputeConfig, checkpoint, moe_level_for
from moe.trainer.models.deepseek_v3.moe_block import moe_config
from moe.trainer.models.deepseek_v3.mtp import MTPModule
from moe.trainer.models.deepseek_v3.norm import RMSNorm
from moe.trainer.models.deepseek_v3.rope import RotaryEmbedding

IGNORE_INDEX = -100


@dataclass
class DeepseekV3Output:
    """What `DeepseekV3ForCausalLM.forward` returns.

    logits: `[B, S, V]` in the model dtype (float32 for a float32 model); logits[:, t] predicts token t+1. Under
        tensor parallelism `[B, S, V/tp]`, this rank's vocabulary columns from `model.vocab_start`; the losses are
        then the same on every rank of the TP group (see tensor_parallel.py).
    With labels:
        lm_loss_sum: 0-d float32, the sum of next-token cross entropy over valid positions (labels[:, t+1] != -100).
        num_tokens: 0-d int64, the number of those positions.
        mtp_loss_sums / mtp_num_tokens: per MTP depth k = 1..D (depth k predicts token t+k+1 at position t), the same
            sum and count.
        loss: `lm_loss_sum / max(num_tokens, 1)`.
        mtp_loss: the mean over depths of each depth's mean loss, or None without MTP modules.
    The training loss is `loss + config.mtp_loss_weight * mtp_loss`; with data parallelism reduce the sums and counts
    over the ranks instead. The MoE balancing losses ride on the activations (`moe.layer.balancing.attach_aux_loss`):
    any
    `backward()` through these losses includes them.
    """

    logits: torch.Tensor
    lm_loss_sum: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None
    mtp_loss_sums: list[torch.Tensor] = field(default_factory=list)
    mtp_num_tokens: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None


def next_token_loss(
    logits_BSV: torch.Tensor,
    labels_BS: torch.Tensor,
    shift: int,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sum of float32 cross entropy over the valid targets, their count)`: `logits[:, s]` scores `labels[:, s +
    shift]` where that exists and is not -100 (the targets are padded with -100 rather than the logits sliced, so
    the logits are not copied). With `tp_group` the logits are this rank's vocabulary columns from `vocab_start`
    (vocab-parallel cross entropy; the sum is the same on every rank of the group)."""
    targets_BS = F.pad(labels_BS[:, shift:], (0, logits_BSV.size(1) - labels_BS.size(1) + shift), value=IGNORE_INDEX)
    logits_NV, targets_N = logits_BSV.reshape(-1, logits_BSV.size(-1)), targets_BS.reshape(-1)
    if tp_group is not None:
        loss_sum = vocab_parallel_cross_entropy(logits_NV, targets_N, vocab_start, tp_group, IGNORE_INDEX).sum()
    else:
        loss_sum = F.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (targets_BS != IGNORE_INDEX).sum()


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 causal language model with MTP, built on `moe.MoELayer`.

    Args:
        config: the model settings.
        ep_group: the group the MoE layers dispatch over: expert parallel, or with `etp_group` the folded EP x ETP
            group (`ParallelState.expert_model_group`); None or one rank: every expert here, no communication.
        etp_group: expert tensor-parallel group (consecutive ranks of `ep_group`): every routed expert's FFN split
            over its ranks (moe/layer/moe_layer.py); None or one rank: whole experts.
        ep_buffers: the `moe.EPBuffers` whose mtdeepep buffer the MoE layers share (None: the group's default).
        aux_loss_group: MoELayer's group for 'global_aux_loss' counts (unused by DeepSeek-V3's own losses).
        dtype: parameter dtype (the router weight and the expert bias stay float32).
        device: where to build (`"meta"` builds without allocating, e.g. to count parameters).
        moe_options: other `MoEConfig` fields for every MoE layer (e.g. `moe_recompute_level`, `fp8`,
            `moe_shared_expert_overlap`), not those that define the DeepSeek-V3 routing (ValueError).
        recompute: activation recompute (`RecomputeConfig`, Megatron's recompute_granularity / method / num_layers
            / modules; see recompute.py); None = none beyond the MoE layers' configured levels. `set_recompute`
            changes it later (also after `tensor_parallel.parallelize`).

    Weights are initialised from one draw of torch's global generator (seed every rank alike), per tensor and per
    expert by name (init.py), so every expert-parallel layout starts from the same weights.
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        *,
        ep_group: dist.ProcessGroup | None = None,
        etp_group: dist.ProcessGroup | None = None,
        ep_buffers: EPBuffers | None = None,
        aux_loss_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        moe_options: dict | None = None,
        recompute: RecomputeConfig | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, DeepseekV3Config):
            raise ValueError(f"config must be a DeepseekV3Config, got {type(config).__name__}")
        self.config = config
        self.build_dtype = dtype
        # set by moe.trainer.pipeline.keep_stages: the stages this rank holds
        self.pipeline_stages: list[int] | None = None
        self.tp_group: dist.ProcessGroup | None = None  # set by tensor_parallel.parallelize (tp > 1)
        self.ep_group = ep_group if group_size(ep_group) > 1 else None
        self.etp_group = etp_group if group_size(etp_group) > 1 else None
        ep_size = group_size(ep_group) // group_size(etp_group)
        if self.ep_group is not None and config.n_routed_experts % ep_size:
            raise ValueError(
                f"n_routed_experts={config.n_routed_experts} is not divisible by the expert-parallel size {ep_size}"
            )
        self.aux_loss_scale = AuxLossScale()
        moe_cfg = moe_config(config, moe_options)
        moe_kwargs = dict(
            config=moe_cfg,
            ep_group=self.ep_group,
            etp_group=self.etp_group,
            ep_buffers=ep_buffers if self.ep_group is not None else None,
            aux_loss_group=aux_loss_group,
            aux_loss_scale=self.aux_loss_scale,
        )
        kw = dict(dtype=dtype, device=device)

        def layer_moe(idx: int) -> dict | None:
            return moe_kwargs if config.is_moe_layer(idx) else None

        target = torch.device(device if device is not None else "cpu")
        seed = None if target.type == "meta" else draw_seed()
        # Factory calls without an explicit device (the router's weight) land on `device` too ("meta": no memory).
        # The submodules' own initialisation (replaced below) draws from the global generator as much as their
        # layout makes it draw: fork it, so that building the model takes one draw whatever the layout.
        device_ctx = torch.device(device) if device is not None else contextlib.nullcontext()
        accelerator = target.type not in ("cpu", "meta")
        fork = torch.random.fork_rng(
            devices=[target] if accelerator else [], device_type=target.type if accelerator else "cuda"
        )
        with device_ctx, fork:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
            self.rotary = RotaryEmbedding(config.rope_parameters, config.qk_rope_head_dim, device=device)
            self.layers = nn.ModuleList(
                DecoderLayer(config, i, moe_layer_kwargs=layer_moe(i), **kw) for i in range(config.num_hidden_layers)
            )
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
            self.lm_head = None
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
            self.mtp = nn.ModuleList(
                MTPModule(config, k, moe_layer_kwargs=layer_moe(config.num_hidden_layers + k), **kw)
                for k in range(config.num_nextn_predict_layers)
            )
        for layer in self.moe_layers():
            for param in layer.experts.parameters():
                param.expert_parallel = True  # the issue-11 contract's tag: reduced over the expert-dp group
        if seed is not None:
            self.init_weights(seed)
        self.recompute = RecomputeConfig()
        self.set_recompute(recompute)

    def set_attention_backend(self, backend: str) -> None:
        """The attention core of every MLA module (attention.py): 'sdpa' (default), 'unfused' or 'auto'."""
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        for module in self.modules():
            if isinstance(module, MultiHeadLatentAttention):
                module.attention_backend = backend

    def set_recompute(self, recompute: RecomputeConfig | None) -> None:
        """Apply `recompute` (None: no recompute beyond the MoE layers' configured levels) to every layer: the
        decoder layers' selective modules, the MoE layers' recompute levels and the SwiGLU MLPs' (see
        recompute.py). ValueError for a setting that does not fit the model."""
        recompute = RecomputeConfig() if recompute is None else recompute
        if not isinstance(recompute, RecomputeConfig):
            raise ValueError(f"recompute must be a RecomputeConfig or None, got {type(recompute).__name__}")
        runs = recompute.full_chunks(len(self.layers))  # checks num_layers against the model
        full = {i for start, end, checkpointed in runs if checkpointed for i in range(start, end)}
        modules = recompute.selective
        blocks = [(layer, i in full) for i, layer in enumerate(self.layers)]
        blocks += [(module, recompute.mtp_checkpointed) for module in self.mtp]
        for block, whole in blocks:
            block.recompute_modules = frozenset() if whole else modules
            mlp = block.mlp
            if isinstance(mlp, MoELayer):
                configured = "full" if mlp.config.moe_layer_recompute else mlp.config.moe_recompute_level
                # Inside a checkpointed layer the MoE layer keeps nothing of its own: the layer's checkpoint covers it.
                mlp.recompute_level = None if whole else moe_level_for(modules, configured)
                if mlp.shared_experts is not None:  # levels 'medium' and 'full' checkpoint it already
                    own = "shared_experts" in modules and mlp.recompute_level not in ("medium", "full")
                    mlp.shared_experts.recompute = "full" if own else None
            else:
                mlp.recompute = "act" if "moe_act" in modules and "mlp" not in modules else None
        self.recompute = recompute

    # -- weights --------------------------------------------------------------------------------------------------

    def init_weights(self, seed: int) -> None:
        """(Re)initialise every weight from `seed` (layout-independent, see init.py)."""
        init_weights(self, seed, self.config.initializer_range)

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers: the main model's in order, then the MTP modules' (for metrics and bias updates)."""
        return [m.mlp for m in (*self.layers, *self.mtp) if isinstance(m.mlp, MoELayer)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight whole, with global expert indices (state.py). Collective over the EP and TP groups: call it
        on every rank; every rank gets the whole dict. A pipeline rank's pruned model gives its stages' part (the
        trainer merges the parts)."""
        return state.full_state_dict(self, self.tp_group)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a `full_state_dict` (from any layout); this rank keeps its experts and its TP shards. No
        communication. A pipeline rank's pruned model (moe.trainer.pipeline.keep_stages) loads its own keys only."""
        if self.pipeline_stages is not None:
            own = set(state.full_state_dict_shapes(self))
            state_dict = {k: v for k, v in state_dict.items() if k in own}
        state.load_full_state_dict(self, state_dict)

    @property
    def output_weight(self) -> torch.Tensor:
        """`[V, H]` the output head's weight (the embedding's when tied); `[V/tp, H]` this rank's vocabulary rows
        under tensor parallelism."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def vocab_start(self) -> int:
        """The first vocabulary id of this rank's logits columns (0 without tensor parallelism)."""
        return getattr(self.embed_tokens, "vocab_start", 0)

    # -- forward --------------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> DeepseekV3Output:
        """Logits, and with `labels` the next-token and MTP losses.

        Args:
            input_ids: `[B, S] int64` tokens.
            labels: `[B, S] int64` aligned with `input_ids` (transformers' convention: the model shifts; -100 is
                ignored). With labels, the MTP modules run and their losses are returned too.
            position_ids: `[B, S] int64` rotary positions per row (Megatron's `--reset-position-ids`:
                `documents.positions_in_documents`); None: `0 .. S-1` in every row.
            document_ids: `[B, S] int64`, non-decreasing along S: packed documents (Megatron's
                `--reset-attention-mask`, `documents.document_ids`). A token attends only to the earlier tokens of
                its document, and MTP depth k ignores the targets of positions i whose token i + k lies in another
                document (`documents.mtp_labels`); ignoring the main head's target after each EOD (the next
                document's first token) is the labels' business, as Megatron's `--eod-mask-loss`. None: one
                document per row.
        ValueError for labels, position_ids or document_ids that do not fit `input_ids` (before any compute).
        """
        self._check_inputs(input_ids, labels)
        self.check_packed_inputs(input_ids, position_ids, document_ids)
        labels = labels.long() if labels is not None else None
        cos_SP, sin_SP, mask = self.attention_inputs(input_ids.size(1), input_ids.device, position_ids, document_ids)
        emb_BSH, h_BSH, shards = self.embed(input_ids)
        h_BSH = self.run_layers(h_BSH, range(len(self.layers)), cos_SP, sin_SP, shards, mask)
        return self.head(h_BSH, emb_BSH, labels, cos_SP, sin_SP, shards, document_ids, mask)

    # The forward's parts, which pipeline stages run on their own (moe/trainer/pipeline/stage_modules.py).

    def check_packed_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, document_ids: torch.Tensor | None
    ) -> None:
        """ValueError for `position_ids` / `document_ids` that do not fit `input_ids` (`documents.check_packed_inputs`:
        shapes, dtypes, positions in range, document ids non-decreasing)."""
        documents.check_packed_inputs(input_ids, position_ids, document_ids, self.config)

    def attention_inputs(
        self,
        seq_len: int,
        device: torch.device,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(cos, sin, mask)`: the rotary tables (`rotary_tables`) and the attention mask (None: causal; with
        `document_ids` the additive `[B, 1, S, S]` bias in the model dtype, `documents.attention_bias`) of every
        decoder layer."""
        cos_SP, sin_SP = self.rotary_tables(seq_len, device, position_ids)
        mask = None if document_ids is None else documents.attention_bias(document_ids, self.config_dtype)
        return cos_SP, sin_SP, mask

    def rotary_tables(
        self, seq_len: int, device: torch.device, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` in the model dtype: `[S, Dr/2]` for positions `0 .. S-1` shared by the rows, or `[B, S, Dr/2]`
        for per-row `position_ids [B, S]`."""
        if position_ids is not None:
            return self.rotary(position_ids, self.config_dtype)
        return self.rotary(torch.arange(seq_len, device=device), self.config_dtype)

    @property
    def config_dtype(self) -> torch.dtype:
        """The dtype of the activations: the norms' (a pipeline stage may hold any subset of the modules)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                return module.weight.dtype
        return self.build_dtype  # a pipeline rank holding no layer (only placeholders) computes nothing in it

    def sequence_shards(self, seq_len: int) -> SequenceShards | None:
        """How sequence parallelism splits `seq_len` positions over the TP ranks (None without TP)."""
        return None if self.tp_group is None else SequenceShards.split(seq_len, self.tp_group)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, SequenceShards | None]:
        """`(emb [B, S, H], h, shards)`: h is emb, or under TP this rank's positions `[B, S_r, H]`.

        Under TP the embedding is this rank's partial sum (its vocabulary rows); the reduce-scatter sums it into
        this rank's positions. `emb` is kept whole-sequence for the MTP depths, which take shifted slices of it."""
        emb_BSH = self.embed_tokens(input_ids)
        shards = self.sequence_shards(input_ids.size(1))
        h_BSH = emb_BSH if shards is None else reduce_scatter_to_sequence_parallel(emb_BSH, shards)
        return emb_BSH, h_BSH, shards

    def run_layers(self, h_BSH: torch.Tensor, indices, cos_SP, sin_SP, shards, mask=None) -> torch.Tensor:
        """Decoder layers `indices` (ascending) in order, with the full-layer recompute runs laid over them (a
        pipeline stage counts `recompute_num_layers` in its own layers, as Megatron-core does). `mask`: the
        attention's (None: causal; `documents.attention_bias`, see `attention_inputs`)."""
        layers = [self.layers[i] for i in indices]
        for start, end, checkpointed in self.recompute.full_chunks(len(layers)):
            run = functools.partial(_run_layers, layers[start:end], cos_SP, sin_SP, shards, mask)
            h_BSH = checkpoint(run, h_BSH) if checkpointed else run(h_BSH)
        return h_BSH

    def head(self, h_BSH, emb_BSH, labels, cos_SP, sin_SP, shards, document_ids=None, mask=None) -> DeepseekV3Output:
        """Final norm and logits, and with `labels [B, S]` the next-token and MTP losses, from the last decoder
        layer's output `h` and the embedding `emb` (see `embed`). Packed documents: `document_ids [B, S]` and their
        `mask` (`attention_inputs`), both None without.

        MTP depth k with packed documents: position i holds the state of token i and the embedding of token i + k;
        its rotary position is token i + k's (the shifted tables) and its attention mask token i's (the mask's
        first S - k rows and columns), as Megatron's MTP rolls the position ids and keeps the main model's mask.
        So a position whose tokens i and i + k lie in one document sees exactly what that document alone gives;
        the others (the last k of each document) mix two documents: their targets are ignored
        (`documents.mtp_labels`) and no position of their document attends to them (they come last in it)."""
        tp = self.tp_group
        h_BSH = self.norm(h_BSH)
        logits_BSV = self._logits(h_BSH, shards)
        out = DeepseekV3Output(logits=logits_BSV)
        if labels is None:
            return out
        S = labels.size(1)
        out.lm_loss_sum, out.num_tokens = next_token_loss(logits_BSV, labels, 1, tp, self.vocab_start)
        out.loss = out.lm_loss_sum / out.num_tokens.clamp(min=1)
        means = []
        for depth, module in enumerate(self.mtp, start=1):
            # Position t of depth k sees tokens up to t + k and predicts token t + k + 1: the last k positions have
            # no embedded token, the last one of the rest no target. Causal attention keeps the result of every
            # position independent of the positions after it, so cutting them off changes nothing.
            length = S - depth
            if length <= 0:
                loss_sum, count = logits_BSV.new_zeros((), dtype=torch.float32), labels.new_zeros(())
            else:
                h_in, emb_in, mtp_shards = self._mtp_inputs(h_BSH, emb_BSH, shards, depth, length)
                # The tables' position axis is the second last: `[S, Dr/2]` or per row `[B, S, Dr/2]`.
                args = (h_in, emb_in, cos_SP[..., depth:, :], sin_SP[..., depth:, :], mtp_shards)
                if mask is not None:
                    args += (mask[..., :length, :length],)
                h_BSH = checkpoint(module, *args) if self.recompute.mtp_checkpointed else module(*args)
                shards = mtp_shards
                targets = labels if document_ids is None else documents.mtp_labels(labels, document_ids, depth)
                loss_sum, count = next_token_loss(self._logits(h_BSH, shards), targets, depth + 1, tp, self.vocab_start)
            out.mtp_loss_sums.append(loss_sum)
            out.mtp_num_tokens.append(count)
            means.append(loss_sum / count.clamp(min=1))
        if means:
            out.mtp_loss = torch.stack(means).mean()
        return out

    def _logits(self, h_BSH: torch.Tensor, shards: SequenceShards | None) -> torch.Tensor:
        """`[B, S, V]` (`[B, S, V/tp]`, this rank's vocabulary, from this rank's positions `[B, S_r, H]` gathered
        under TP)."""
        if shards is not None:
            h_BSH = gather_from_sequence_parallel(h_BSH, shards)
        return wgrad.linear(h_BSH, self.output_weight)

    def _mtp_inputs(self, h_BSH, emb_BSH, shards, depth: int, length: int):
        """`(h[:, :length], emb[:, depth:depth + length], their shards)`: under TP, the previous depth's positions
        resharded over the shorter sequence, and this rank's part of the shifted embedding (reduce-scattered from
        the whole-sequence partial sums)."""
        if shards is None:
            return h_BSH[:, :length], emb_BSH[:, depth:], None
        new = SequenceShards.split(length, shards.group)
        h_full = gather_from_sequence_parallel(h_BSH, shards)[:, :length]
        h_in = scatter_to_sequence_parallel(h_full, new)
        return h_in, reduce_scatter_to_sequence_parallel(emb_BSH[:, depth:], new), new

    def _check_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be [B, S] int64, got {tuple(input_ids.shape)} {input_ids.dtype}")
        if input_ids.size(1) > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {input_ids.size(1)} exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        tp = group_size(self.tp_group)
        min_len = tp + (len(self.mtp) if labels is not None else 0)
        if tp > 1 and input_ids.size(1) < min_len:
            raise ValueError(
                f"sequence length {input_ids.size(1)} is too short for sequence parallelism over {tp} ranks with "
                f"{len(self.mtp) if labels is not None else 0} MTP depths (each depth's positions must give every "
                f"rank one): at least {min_len}"
            )
        if labels is not None and (labels.shape != input_ids.shape or labels.dtype not in (torch.int64, torch.int32)):
            raise ValueError(
                f"labels must be int64 of the shape of input_ids {tuple(input_ids.shape)}, got "
                f"{tuple(labels.shape)} {labels.dtype}"
            )


def _run_layers(layers: list[nn.Module], cos_SP, sin_SP, shards, mask, h_BSH: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        h_BSH = layer(h_BSH, cos_SP, sin_SP, shards, mask)
    return h_BSH
