"""FP8 dispatch through the 'flex' (mtdeepep) dispatcher on 2 ranks (the one launcher's `RankPool`): the buffer
receives E4M3 data with float32 1x128 scales, and the layer's output, input gradients and router gradient equal
the one-process layer's with the same E4M3 round trip. Block-wise FP8 experts keep that parity (their scales are
per row / per expert block); the delayed recipe's per-tensor scales of the local rows do not, by design."""

from __future__ import annotations

import pytest

from ..ranks import pool_fixture
from .dispatch_cases import case_apply_fp8, case_fp8_dispatch

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 30


pool = pool_fixture(world_size=2, comm_timeout_s=TIMEOUT_S, deadline_s=2 * TIMEOUT_S)


def test_flex_dispatch_sends_fp8(pool):
    sent = pool.run(case_fp8_dispatch)
    assert len(sent) == 2 and all(s for s in sent)


def test_apply_fp8_blockwise_dispatches_fp8_on_two_ranks(pool):
    pool.run(case_apply_fp8, "blockwise")
