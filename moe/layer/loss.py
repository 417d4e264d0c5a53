"""A micro-batch's share of the global-batch training loss (the trainer's loop and the last pipeline stage both
take it from here, so a pipelined run computes what the plain one does). It sits below both: the pipeline layer does
not import the trainer."""

from __future__ import annotations

import torch


def loss_share(out, counts: torch.Tensor, mtp_loss_weight: float, num_mtp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(loss, sums)` of one micro-batch's model output `out` (`lm_loss_sum`, `mtp_loss_sums`).

    counts: `[1 + D] float64`, the global batch's next-token targets of the main head and of each MTP depth.
    loss: 0-d, `lm_loss_sum / counts[0] + mtp_loss_weight / D * sum_d mtp_loss_sum_d / counts[1 + d]`.
    sums: `[1 + D] float64`, the micro-batch's loss sums, detached (for the reported losses).
    RuntimeError if the model returned another number of MTP depths than `num_mtp`.
    """
    mtp_sums = list(out.mtp_loss_sums or [])
    if len(mtp_sums) != num_mtp:
        raise RuntimeError(f"the model returned {len(mtp_sums)} MTP losses, expected {num_mtp}")
    loss = out.lm_loss_sum / counts[0].item()
    for d, mtp_sum in enumerate(mtp_sums):
        loss = loss + (mtp_loss_weight / num_mtp) * mtp_sum / counts[1 + d].item()
    sums = torch.stack([out.lm_loss_sum.detach(), *[s.detach() for s in mtp_sums]]).double()
    return loss, sums
