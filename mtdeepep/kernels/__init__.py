"""The Triton kernels of the `triton` executor (`mtdeepep.engines.triton`): one kernel source for NVIDIA, AMD and
Moore Threads GPUs (through FlagTree's backends), run on CPU tensors by Triton's interpreter (`TRITON_INTERPRET=1`).

One module per operation family, each with its host launch wrappers:

- `sync`: the bounded waits and the flag signals every kernel uses, the status word (kind, phase, peer, rank) and
  its translation into `CommTimeoutError` / `CommError`, the wait bound (spins or a clock), the mailbox exchange
  (counts, barrier). No kernel of this package spins anywhere else.
- `layout`: `get_dispatch_layout` (per-rank and per-expert counts, `is_token_in_rank`).
- `intranode`: normal-mode dispatch (rows, scales, top-k into the peers' receive areas) and combine (rows sent back,
  summed in FP32 per source token).
- `low_latency`: DeepEP's low-latency dispatch (BF16, FP8 cast in the kernel) and combine; `fp8`: the E4M3 casts.
- `aot`: every module's `AOT_SPECS` compiled ahead of time for cuda:90 and hip:gfx942, the flags' memory ordering
  checked in the machine code.

Peers are reached through a table of int64 base addresses (every rank's region as mapped in this process): on the
CPU the shared-memory segments of `mtdeepep._C.Runtime`, on a GPU the buffers opened through CUDA IPC.

Importing this package imports Triton: set `TRITON_INTERPRET=1` before it on a machine without a GPU.
"""
