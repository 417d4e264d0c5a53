"""The DeepEP clients' cases (tests/clients/client_cases.py, unchanged: Megatron-core 0.19.2's fused dispatch /
combine and flex dispatcher, torchtitan 0.3.0's V2 backend) on the triton executor under Triton's interpreter, 2
rank processes, with the parametrisations of tests/clients/test_megatron_deepep.py and test_torchtitan_deepep.py
(the same pass counts as the CPU executor)."""

from __future__ import annotations

import pytest

from ..clients import client_cases as cases
from ..ranks import pool_fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pool = pool_fixture(world_size=2, deadline_s=240, engine="triton")


@pytest.mark.parametrize(
    "dtype_name, async_finish, allocate_on_comm_stream",
    [("bfloat16", False, False), ("bfloat16", True, True), ("bfloat16", True, False), ("float32", True, True),
     ("float32", False, False)],
)  # fmt: skip
def test_megatron_fused_dispatch_combine(pool, dtype_name, async_finish, allocate_on_comm_stream):
    pool.run(cases.megatron_fused_dispatch_combine, dtype_name, async_finish, allocate_on_comm_stream)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_megatron_flex_dispatcher_round_trip(pool, dtype_name):
    pool.run(cases.megatron_flex_dispatcher_round_trip, dtype_name)


def test_megatron_backward_after_buffer_replaced(pool):
    pool.run(cases.megatron_backward_after_buffer_replaced)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_torchtitan_training_round_trip(pool, dtype_name):
    pool.run(cases.torchtitan_training_round_trip, dtype_name)


def test_torchtitan_inference_expanded_layout(pool):
    pool.run(cases.torchtitan_inference_expanded_layout)


def test_torchtitan_backward_after_buffer_replaced(pool):
    pool.run(cases.torchtitan_backward_after_buffer_replaced)
