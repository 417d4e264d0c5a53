"""The DeepEP clients' cases (tests/clients/client_cases.py, unchanged: Megatron-core 0.19.2's fused dispatch /
combine and flex dispatcher, torchtitan 0.3.0's V2 backend) on the triton executor under Triton's interpreter, 2
rank processes. One representative parametrisation each: every case costs interpreter seconds."""

from __future__ import annotations

import pytest

from ..clients import client_cases as cases
from ..ranks import pool_fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pool = pool_fixture(world_size=2, deadline_s=240, engine="triton")


def test_megatron_fused_dispatch_combine(pool):
    pool.run(cases.megatron_fused_dispatch_combine, "bfloat16", True, False)


def test_megatron_flex_dispatcher_round_trip(pool):
    pool.run(cases.megatron_flex_dispatcher_round_trip, "bfloat16")


def test_torchtitan_training_round_trip(pool):
    pool.run(cases.torchtitan_training_round_trip, "bfloat16")
