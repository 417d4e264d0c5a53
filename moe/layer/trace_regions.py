"""Named regions of the MoE layer in a `torch.profiler` trace (Perfetto / Chrome JSON, TensorBoard's profiler).

    moe/router        the router's scores and top-k
    moe/dispatch      the token dispatch (`dispatch_begin`, then `dispatch_end`: two slices when the shared expert
                      runs while the tokens are in flight)
    moe/expert_gemm   the local experts' grouped GEMMs (fc1, SwiGLU, fc2) over the received rows
    moe/combine       the weighted combine back to the source ranks (`combine_begin`, then `combine_end`)
    moe/shared_experts

They bracket the forward. The backward shows up under autograd's own names for the same operations (the dispatch
and combine functions' backward nodes, `_grouped_mm`'s backward).

Off costs nothing measurable: `region` enters a `record_function` only while a profiler records (one C call to ask,
about 0.3 us); a `record_function` entered with no profiler running costs tens of microseconds on a CPU, which is
why it is not entered unconditionally (bench/observe_overhead.py measures both).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from moe.layer.phase_timer import NULL_PHASE

ROUTER = "moe/router"
DISPATCH = "moe/dispatch"
EXPERT_GEMM = "moe/expert_gemm"
COMBINE = "moe/combine"
SHARED_EXPERTS = "moe/shared_experts"
REGIONS = (ROUTER, DISPATCH, EXPERT_GEMM, COMBINE, SHARED_EXPERTS)


def region(name: str):
    """`record_function(name)` while a `torch.profiler` records, else a no-op context."""
    return record_function(name) if torch.autograd._profiler_enabled() else NULL_PHASE
