"""Targets of `run_processes` (processes that a pool cannot host: one SIGKILLs itself) on the one GPU.

A killed peer: the processes set up a CUDA buffer (IPC handles of every peer's memory opened), dispatch and combine
once together, then one SIGKILLs itself. The survivors' next dispatch waits on the GPU for a peer that will never
write: the bounded device-side wait must end it and the host must raise `CommTimeoutError` (or `CommError` if the
executor learns of the death sooner) naming the dead rank, and the GPU must stay usable (a synchronisation returns,
local work is right), and the buffer can still be destroyed.
"""

from __future__ import annotations

import os
import signal
import time

import torch

import mtdeepep as deep_ep

from ..conformance.common import layout_and_dispatch, make_inputs
from . import gpu

VICTIM = 1


def killed_peer(proc, timeout_s: float):
    """Returns `(error type, ranks the message names, seconds to the error, GPU usable afterwards, destroy seconds)`
    from each survivor; the victim dies by SIGKILL."""
    group = proc.init_group()

    class Ctx:  # what gpu.new_buffer and make_inputs read of a pool's RankContext
        rank = proc.rank

    Ctx.group = group
    buffer = gpu.new_buffer(Ctx, 64 << 20, explicitly_destroy=True, timeout_s=timeout_s)
    x, topk_idx, topk_weights = make_inputs(Ctx, 256, 1024, 8 * proc.num_processes, 4, seed=130)
    x_d, idx_d, w_d = gpu.cuda(x, topk_idx, topk_weights)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buffer, x_d, idx_d, w_d, 8 * proc.num_processes)
    buffer.combine(recv_x, handle)
    gpu.synchronize()
    torch.distributed.barrier(group=group)  # everyone has mapped everyone's memory and moved rows once
    if proc.rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # the victim is gone before the survivors start
    start = time.perf_counter()
    try:
        layout_and_dispatch(buffer, x_d, idx_d, w_d, 8 * proc.num_processes)
        gpu.synchronize()
    except (deep_ep.CommTimeoutError, deep_ep.CommError) as error:
        outcome = (type(error).__name__, gpu.named_ranks(str(error)) or str(error), time.perf_counter() - start)
    else:
        outcome = ("no error", [], time.perf_counter() - start)
    # The GPU is not hung: a synchronisation returns and local work is right.
    gpu.synchronize()
    probe = gpu.cuda(torch.arange(1000, dtype=torch.float32))
    usable = bool((probe * 2).sum().item() == 999_000.0)
    start = time.perf_counter()
    buffer.destroy()
    return (*outcome, usable, time.perf_counter() - start)


def killed_peer_on_cpu(proc, timeout_s: float):
    """`killed_peer` with the CPU executor standing in for the GPU (see `gpu.run_on_cpu`)."""
    return gpu.run_on_cpu(proc, killed_peer, timeout_s)
