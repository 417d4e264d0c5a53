"""What the trainer asks of its data, whichever path made it, and the labels and document ids built from a batch.

`DataSource` is the trainer's view: `TokenBatches` (moe/trainer/data/token_file.py: the built-in corpus's token file)
and
`BlendedBatches` (moe/trainer/data/blended_batches.py: indexed datasets, Megatron's `--data-path`) implement it. A batch
is a function of (seed, step) alone, so every layout reads the same tokens and a run resumed at step `s` reads what an
uninterrupted one would have; `identity()` names what the order depends on, which `DataPosition` saves with every
checkpoint and a resumed run must share.

Megatron's end-of-document options, on a batch `[B, S]` of packed documents (each document ends in `eod_id`):
- eod_mask_loss: no loss where the INPUT token is the end-of-text token (Megatron's `loss_mask[tokens == eod] =
  0`: the prediction of the next document's first token from the last one). In transformers' shifted convention,
  where position t is trained on `labels[t + 1]`: `labels[t + 1] = -100` where `tokens[t] == eod_id`. The MTP
  depths read the same labels further along, as Megatron rolls its loss mask.
- reset_position_ids / reset_attention_mask: the document of every position (a new document after every
  end-of-text token; moe/trainer/models/deepseek_v3/documents.py), from which the model restarts the positions and masks
  attention across documents (the trainer passes them, moe/trainer/train/trainer.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from moe.layer.parallel.cross_entropy import IGNORE_INDEX


class DataSource(Protocol):
    """Global batches of `[global_batch, seq_len]` int64 tokens in an order fixed by the seed.

    seq_len, global_batch: the batch's shape. num_train: training windows (the epoch's length; a blend: all
    datasets' together). eod_id: the end-of-text id that ends every document (None: unknown).
    """

    seq_len: int
    global_batch: int
    num_train: int
    eod_id: int | None

    def global_batch_tokens(self, step: int) -> torch.Tensor:
        """`[global_batch, seq_len] int64` of optimizer step `step` (1-based)."""

    def local_batch(self, step: int, dp_rank: int, dp: int) -> torch.Tensor:
        """`[global_batch / dp, seq_len] int64`: data-parallel rank `dp_rank`'s rows of step `step`."""

    def val_tokens(self) -> torch.Tensor:
        """`[V, seq_len] int64`: held-out windows, never in a training batch."""

    def identity(self) -> dict[str, Any]:
        """JSON-able facts the order depends on besides the seed, the batch and seq_len (a fingerprint of the
        data); a checkpoint records them and a resume on other data is refused."""


def rank_rows(global_batch: int, dp_rank: int, dp: int) -> slice:
    """The rows of a global batch that data-parallel rank `dp_rank` of `dp` trains on: `[r G / dp, (r + 1) G / dp)`.
    ValueError when `dp` does not divide the batch."""
    if global_batch % dp:
        raise ValueError(f"global_batch={global_batch} is not divisible by dp={dp}")
    per_rank = global_batch // dp
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def eod_masked_labels(tokens_BS: torch.Tensor, eod_id: int) -> torch.Tensor:
    """`[B, S] int64` labels for `tokens_BS [B, S]`: the tokens, with -100 at `t + 1` wherever `tokens[t]` is
    `eod_id` (Megatron's --eod-mask-loss in the shifted convention)."""
    labels = tokens_BS.clone()
    labels[:, 1:].masked_fill_(tokens_BS[:, :-1] == eod_id, IGNORE_INDEX)
    return labels
