"""The triton executor against the CPU executor, call by call, on the same inputs in the same rank processes
(tests/triton/parity_cases.py): dispatch outputs and handles bit-identical, combine bit-identical (same summation
order, bf16 rounded to nearest even as the CPU does)."""

from __future__ import annotations

import pytest

from ..conformance.topology import INTRANODE_2
from . import parity_cases as cases

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.parametrize("topology", [INTRANODE_2], ids=str)
@pytest.mark.parametrize(
    "dtype_name, num_worst_tokens, expert_alignment, with_bias",
    [("bfloat16", 0, 1, False), ("bfloat16", 100, 4, True), ("float16", 0, 1, True), ("float32", 0, 8, False)],
)
def test_dispatch_and_combine_match_cpu(pool, topology, dtype_name, num_worst_tokens, expert_alignment, with_bias):
    pool.run(cases.dispatch_and_combine_match_cpu, dtype_name, num_worst_tokens, expert_alignment, with_bias)


@pytest.mark.parametrize("topology", [INTRANODE_2], ids=str)
def test_fp8_and_cached_dispatch_match_cpu(pool, topology):
    pool.run(cases.fp8_and_cached_dispatch_match_cpu)
