"""Megatron-core 0.19.2's DeepEP path, unmodified, on mtdeepep (`import deep_ep` through the opt-in alias), 2 CPU
ranks over gloo: `fused_dispatch` / `fused_combine` (forward and backward, `async_finish` on and off) and the 'flex'
`MoEFlexTokenDispatcher` round trip, each against a float64 plain-PyTorch MoE layer (see client_cases.py).

How Megatron is imported on CPU (fake Triton during its import, TorchDynamo disabled, no global parallel state):
clients_env.py. The rank processes start once for the module and run every case.
"""

import pytest

from . import client_cases as cases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: megatron-core's DeepEP client on 2 ranks


@pytest.mark.parametrize(
    "dtype_name, async_finish, allocate_on_comm_stream",
    [("bfloat16", False, False), ("bfloat16", True, True), ("bfloat16", True, False), ("float32", True, True),
     ("float32", False, False)],
)  # fmt: skip
def test_fused_dispatch_combine(pool, dtype_name, async_finish, allocate_on_comm_stream):
    pool.run(cases.megatron_fused_dispatch_combine, dtype_name, async_finish, allocate_on_comm_stream)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_flex_dispatcher_round_trip(pool, dtype_name):
    pool.run(cases.megatron_flex_dispatcher_round_trip, dtype_name)


def test_backward_after_buffer_replaced(pool):
    """Megatron's get_buffer replaces its buffer for a larger layer; the earlier layer's backward then uses its old
    handle on the new buffer (DeepEP accepts any handle of the group)."""
    pool.run(cases.megatron_backward_after_buffer_replaced)
