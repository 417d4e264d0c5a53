"""DeepSeek-V3 cut into pipeline stages: `DeepseekV3Stage` (one stage's forward, the module torch's `PipelineStage`
runs) and `keep_stages` (drops from a rank's model what its stages do not hold).

What travels between stages (per micro-batch of b sequences of S tokens):
    h    [b, S, H] (under sequence parallelism this rank's positions [b, S/tp, H]): the residual stream;
    emb  [b, S, H]: the embedding output, which the MTP modules of the last stage need (DeepSeek-V3's MTP shares the
         main model's embedding). Sending it along costs one more activation per hop; in exchange the embedding
         exists once (no copy on the last stage whose gradient must be all-reduced with the first, as Megatron-core
         does) and its gradient comes back through the pipeline like any other.
The token ids reach every stage as a keyword argument (torch's schedules hand the same micro-batch of keyword
arguments to every stage): the first stage embeds them, the last stage takes its labels from them. Packed documents
(`DeepseekV3ForCausalLM.forward`'s `position_ids` / `document_ids`) and explicit `labels` travel the same way, as
`[b, S]` keyword arguments: every stage builds its rotary tables and attention mask from them (a few `[b, S]`
integers per micro-batch instead of the tables or the `[b, S, S]` mask on the wire).

The last stage returns the micro-batch's share of the global-batch loss (`[1]` FP32, see `StageLoss`); the
schedules' loss function takes it as the loss, and their gradient scaling is off (the share is already scaled).
"""

from __future__ import annotations

import torch
from torch import nn

from moe.layer.loss import loss_share
from moe.layer.moe_layer import MoELayer
from moe.trainer.pipeline.split import StageSplit


class LayerElsewhere(nn.Module):
    """Stands in the model's layer list for a decoder layer another pipeline rank holds (no parameters)."""

    mlp = None

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"decoder layer {self.layer_idx} is held by another pipeline rank")

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"


class StageLoss:
    """The loss a last stage returns for one micro-batch, and the sums behind it (read by the runner).

    `counts [1 + D] float64`: the global batch's next-token targets of the main head and of each MTP depth (set by
    the runner before every step). The micro-batch's loss is `moe.layer.loss.loss_share`'s, as in `Trainer`.
    """

    def __init__(self, mtp_loss_weight: float, num_mtp: int) -> None:
        self.mtp_loss_weight = float(mtp_loss_weight)
        self.num_mtp = int(num_mtp)
        self.counts: torch.Tensor | None = None
        self.sums: list[torch.Tensor] = []  # per micro-batch: [1 + D] float64 loss sums, detached

    def __call__(self, out) -> torch.Tensor:
        if self.counts is None:
            raise RuntimeError("StageLoss.counts is not set: the runner sets the global target counts every step")
        loss, sums = loss_share(out, self.counts, self.mtp_loss_weight, self.num_mtp)
        self.sums.append(sums)
        return loss


class DeepseekV3Stage(nn.Module):
    """Stage `stage` of `split` over a (possibly pruned, see `keep_stages`) `DeepseekV3ForCausalLM`.

    Registers the model's modules it runs (embedding on the first stage; its decoder layers under `layers.<i>`;
    final norm, output head and MTP modules on the last), so that `parameters()` are exactly its own. The model's
    methods (`embed`, `run_layers`, `head`) do the work, so a stage computes what the whole model computes.

    forward:
        first stage: `(input_ids [b, S] int64, *, tokens)`; other stages: `(h, emb, *, tokens)` (see the module
        docstring); optional keywords `labels` (the last stage's targets; default the tokens), `position_ids` and
        `document_ids` (`[b, S]` int64 each, packed documents: see `DeepseekV3ForCausalLM.forward`). Returns
        `(h, emb)`, or on the last stage the micro-batch's loss share (`[1]` FP32).
    """

    def __init__(self, model: nn.Module, stage: int, split: StageSplit, loss: StageLoss) -> None:
        super().__init__()
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == split.num_stages - 1
        self.layer_indices = split.layers(stage)
        self.loss = loss
        object.__setattr__(self, "model", model)  # not a submodule: its other stages' parameters are not ours
        if self.is_first:
            self.embed_tokens = model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_indices})
        if self.is_last:
            self.norm = model.norm
            self.lm_head = model.lm_head
            self.mtp = model.mtp
        self.moe_layers = [m for m in self.modules() if isinstance(m, MoELayer)]
        self.loads: list[torch.Tensor] = []  # per MoE layer of this stage: tokens per expert over the step, float64

    def reset_step(self) -> None:
        self.loads = [torch.zeros(m.config.num_moe_experts, dtype=torch.float64) for m in self.moe_layers]

    def forward(
        self,
        *args: torch.Tensor,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ):
        model = self.model
        seq_len = tokens.size(1)
        cos_SP, sin_SP, mask = model.attention_inputs(seq_len, tokens.device, position_ids, document_ids)
        if self.is_first:
            emb_BSH, h_BSH, shards = model.embed(args[0])
        else:
            h_BSH, emb_BSH = args
            shards = model.sequence_shards(seq_len)
        h_in = h_BSH
        h_BSH = model.run_layers(h_BSH, self.layer_indices, cos_SP, sin_SP, shards, mask)
        if self.is_last:
            targets = tokens.long() if labels is None else labels.long()
            out = model.head(h_BSH, emb_BSH, targets, cos_SP, sin_SP, shards, document_ids, mask)
            self._record_loads()
            return self.loss(out).reshape(1)  # [1]: the schedules concatenate the micro-batches' outputs
        self._record_loads()
        # A stage output must be a node of this stage's graph that torch may detach in place after the backward: a
        # stage without layers, or the emb passed along, would hand on its received input itself, and a view cannot
        # be detached in place; a copy can (one [b, S, H] per micro-batch in flight).
        if h_BSH is h_in and not self.is_first:
            h_BSH = h_BSH.clone()
        return h_BSH, emb_BSH if self.is_first else emb_BSH.clone()

    def _record_loads(self) -> None:
        if not self.loads:
            self.reset_step()
        for load, layer in zip(self.loads, self.moe_layers):
            load += layer.metrics.tokens_per_expert.double()


def keep_stages(model: nn.Module, split: StageSplit, stages: list[int]) -> None:
    """Drop from `model` (in place) what `stages` do not hold: the other decoder layers (replaced by
    `LayerElsewhere`), the embedding unless stage 0 is here, the final norm, output head and MTP modules unless the
    last stage is. Parameter names of what stays are unchanged (`layers.<i>.*`, ...)."""
    keep = {i for s in stages for i in split.layers(s)}
    model.pipeline_stages = list(stages)
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers[i] = LayerElsewhere(i)
    if 0 not in stages:
        model.embed_tokens = None
    if split.num_stages - 1 not in stages:
        model.norm = None
        model.lm_head = None
        model.mtp = nn.ModuleList()
