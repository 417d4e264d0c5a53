"""The DeepEP clients' cases (tests/clients/client_cases.py, unchanged: Megatron-core 0.19.2's fused dispatch /
combine and flex dispatcher, torchtitan 0.3.0's V2 backend) on the triton executor under Triton's interpreter, 2
rank processes: the very tests of tests/clients/test_megatron_deepep.py and test_torchtitan_deepep.py (imported, so
the same parametrisations and pass counts as the CPU executor), run on this module's `pool` of triton ranks."""

from __future__ import annotations

import pytest

from ..clients import test_megatron_deepep as megatron
from ..clients import test_torchtitan_deepep as torchtitan
from ..ranks import pool_fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pool = pool_fixture(world_size=2, deadline_s=240, engine="triton")  # what the imported tests below run on

test_megatron_fused_dispatch_combine = megatron.test_fused_dispatch_combine
test_megatron_flex_dispatcher_round_trip = megatron.test_flex_dispatcher_round_trip
test_megatron_backward_after_buffer_replaced = megatron.test_backward_after_buffer_replaced
test_torchtitan_training_round_trip = torchtitan.test_training_round_trip
test_torchtitan_inference_expanded_layout = torchtitan.test_inference_expanded_layout
test_torchtitan_backward_after_buffer_replaced = torchtitan.test_backward_after_buffer_replaced
