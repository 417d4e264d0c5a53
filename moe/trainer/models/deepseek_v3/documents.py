"""Packed documents: several documents in one row of `[B, S]` tokens, each ending in the end-of-text (EOD) token.

Megatron's `--reset-attention-mask` and `--reset-position-ids` (megatron/core/datasets/gpt_dataset.py,
`_get_ltor_masks_and_position_ids`): the EOD token belongs to the document it ends, the token after it starts the
next one; with reset_attention_mask a token attends only to the earlier tokens of its own document, with
reset_position_ids its rotary position is its offset in its document. Here the caller describes the row by
`document_ids [B, S]` (`document_ids` below) and `position_ids [B, S]` (`positions_in_documents`), the keyword
arguments of `DeepseekV3ForCausalLM.forward`; this module builds what the model derives from them:

- `attention_mask`: `[B, 1, S, S]` bool, True where query s may attend key t (t <= s, same document), and
  `attention_bias`, the same as an additive 0 / -inf bias in the activations' dtype: built once per forward, SDPA's
  `attn_mask` as is and added to the unfused core's scores in every layer;
- `mtp_labels`: the labels of MTP depth k with the targets of positions whose input spans two documents ignored
  (see `DeepseekV3ForCausalLM.head`), and `target_counts`, the targets each head keeps (the trainer's loss
  normalisers).

Legend: B rows, S positions.
"""

from __future__ import annotations

import torch

from moe.layer.parallel.cross_entropy import IGNORE_INDEX
from moe.trainer.models.deepseek_v3.model_config import DeepseekV3Config


def document_ids(input_ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """`[B, S] int64`: the index of every token's document within its row, from 0. A document ends with (and
    includes) an EOD token: the token after an EOD starts the next document (Megatron's reset rule). A row without
    EOD is one document; tokens after the last EOD form a last, unterminated document.

    Args:
        input_ids: `[B, S]` integer tokens.
        eod_id: the end-of-text token id.
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be [B, S] int64, got {tuple(input_ids.shape)} {input_ids.dtype}")
    is_eod = (input_ids == int(eod_id)).long()
    # The EODs strictly before each token: an EOD counts for the tokens after it, not for itself.
    return is_eod.cumsum(dim=1) - is_eod


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """`[B, S] int64`: each token's offset within its document (0 at the first token of each document), for the
    `[B, S]` integer `document_ids` (a new document wherever the id changes along S)."""
    check_document_ids(document_ids)
    B, S = document_ids.shape
    index = torch.arange(S, device=document_ids.device).expand(B, S)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # The index of the latest document start at or before each token (the running maximum of the start indices).
    start_of = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_of


def check_document_ids(document_ids: torch.Tensor) -> None:
    """ValueError unless `document_ids` is `[B, S]` int64. Reads no values."""
    if document_ids.dim() != 2 or document_ids.dtype != torch.int64:
        raise ValueError(f"document_ids must be [B, S] int64, got {list(document_ids.shape)} {document_ids.dtype}")


def check_packed_inputs(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    config: DeepseekV3Config,
) -> None:
    """ValueError for `position_ids` / `document_ids` that do not fit `input_ids [B, S]`: not `[B, S]` int64 on its
    device, positions outside `[0, max_position_embeddings)`, document ids that decrease along S. One host
    synchronisation when either is given (the value checks), none otherwise."""
    checks: list[tuple[str, torch.Tensor]] = []
    for name, t in (("position_ids", position_ids), ("document_ids", document_ids)):
        if t is None:
            continue
        if t.shape != input_ids.shape or t.dtype != torch.int64:
            raise ValueError(
                f"{name} must be int64 of the shape of input_ids {list(input_ids.shape)}, got {list(t.shape)} {t.dtype}"
            )
        if t.device != input_ids.device:
            raise ValueError(f"{name} is on {t.device}, input_ids on {input_ids.device}")
    if position_ids is not None:
        limit = config.max_position_embeddings
        checks.append((f"position_ids must lie in [0, max_position_embeddings={limit})",
                       ((position_ids < 0) | (position_ids >= limit)).any()))  # fmt: skip
    if document_ids is not None:
        checks.append(("document_ids must not decrease along the sequence (dim 1)",
                       (document_ids[:, 1:] < document_ids[:, :-1]).any()))  # fmt: skip
    if checks:
        bad = torch.stack([flag for _, flag in checks]).tolist()  # the one synchronisation
        for (message, _), flag in zip(checks, bad):
            if flag:
                raise ValueError(message)


def attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """`[B, 1, S, S]` bool: True where query s may attend key t, i.e. t <= s within the same document (the
    head axis broadcasts). Every query may attend itself, so no softmax row is empty."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    S = document_ids.size(1)
    causal = torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


def attention_bias(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, 1, S, S]` in `dtype`: 0 where `attention_mask(document_ids)` allows, -inf elsewhere (an additive bias:
    SDPA takes it without converting a boolean mask in every layer, the unfused core adds it in place)."""
    allowed = attention_mask(document_ids)
    zero = torch.zeros((), dtype=dtype, device=document_ids.device)
    return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=dtype, device=document_ids.device))


def mtp_labels(labels: torch.Tensor, document_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """The labels `[B, S]` of MTP depth `depth` (its position i scores `labels[:, i + depth + 1]`) with the
    targets ignored (-100) where the depth's input spans two documents: the previous depth's state of token i and
    the embedding of token i + depth lie in different documents. Megatron's packed-sequence MTP (`roll_tensor`
    with `packed_seq_params`, rolling within each sequence) drops those targets the same way; the target that is
    the first token of a document (after the EOD) is the caller's to ignore, as for the main head."""
    S = labels.size(1)
    if depth + 1 >= S:
        return labels
    spans = document_ids[:, depth : S - 1] != document_ids[:, : S - 1 - depth]  # position i = 0 .. S-2-depth
    out = labels.clone()
    out[:, depth + 1 :] = labels[:, depth + 1 :].masked_fill(spans, IGNORE_INDEX)
    return out


def target_counts(labels: torch.Tensor, document_ids: torch.Tensor | None, num_mtp: int) -> torch.Tensor:
    """`[1 + num_mtp] float64`: the next-token targets the model's main head and each MTP depth keep in `labels
    [B, S]` (position t scores `labels[:, t + 1 + d]` at depth d; -100 ignored) with packed `document_ids` (MTP
    depths also ignore the targets of `mtp_labels`; None: no packing). The loss normalisers of a batch
    (`moe.layer.loss.loss_share`'s counts), equal to the forward's `num_tokens` and `mtp_num_tokens`."""
    counts = [float((labels[:, 1:] != IGNORE_INDEX).sum())]
    for depth in range(1, num_mtp + 1):
        kept = labels if document_ids is None else mtp_labels(labels, document_ids, depth)
        counts.append(float((kept[:, 1 + depth :] != IGNORE_INDEX).sum()))
    return torch.tensor(counts, dtype=torch.float64)
