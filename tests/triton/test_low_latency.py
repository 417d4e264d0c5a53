"""The Triton low-latency kernels (`mtdeepep.kernels.low_latency`) under Triton's interpreter, on 2 ranks of
`tests/ranks.py`'s pool, against the CPU executor's low-latency mode (cases in ll_cases.py), and their element casts
against torch's on every bfloat16 input."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from mtdeepep.kernels import low_latency  # noqa: E402
from tests.ranks import pool_fixture  # noqa: E402

from . import ll_cases as cases  # noqa: E402

pytestmark = pytest.mark.timeout(300)
pool = pool_fixture(world_size=2, comm_timeout_s=40, deadline_s=150)


def test_casts_match_torch_on_every_bfloat16_input():
    """E4M3 (saturated at 448, round to nearest even, subnormals) and bfloat16 rounding, with integer operations:
    bitwise torch's. A kernel rounding like the interpreter's native `.to(tl.float8e4nv)` or `.to(tl.bfloat16)`
    fails here."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = values[values.isfinite()]
    expected = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(low_latency.cast_bits(values, to_e4m3=True), expected)
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(1 << 16, generator=generator) * torch.exp2(
        torch.randint(-40, 12, (1 << 16,), generator=generator).float()
    )
    assert torch.equal(low_latency.cast_bits(wide, to_e4m3=True), wide.clamp(-448, 448).to(torch.float8_e4m3fn).view(
        torch.uint8))  # fmt: skip
    assert torch.equal(low_latency.cast_bits(wide, to_e4m3=False), wide.bfloat16().view(torch.int16))


def test_layout_matches_the_cpu_executor_and_fits_its_size_hint():
    from mtdeepep import _C

    for args in ((128, 7168, 8, 256), (32, 512, 2, 8), (64, 100, 4, 12)):
        tokens, hidden, ranks, experts = args
        layout = low_latency.HalfLayout(tokens, hidden, ranks, experts)
        control = low_latency.ControlLayout(ranks)
        assert control.end <= control.halves
        assert control.halves + 2 * layout.bytes == _C.LowLatencyProtocol.size_hint(*args)


def test_dispatch_and_combine_match_cpu(pool):
    assert pool.run(cases.dispatch_and_combine_match_cpu) == ["ok", "ok"]


def test_zero_copy_and_out(pool):
    assert pool.run(cases.zero_copy_and_out) == ["ok", "ok"]


def test_two_results_alive(pool):
    assert pool.run(cases.two_results_alive) == ["ok", "ok"]


@pytest.mark.slow  # 24 rounds on both executors: ~50 s on 2 loaded cores
def test_peer_runs_ahead_double_buffer(pool):
    seqs = pool.run(cases.peer_runs_ahead)
    assert seqs[0] == seqs[1] and seqs[0] >= 48


def test_missing_rank_times_out_then_clean_recovers(pool):
    assert pool.run(cases.missing_rank_times_out_then_clean_recovers) == [["timeout", "mismatch"], ["mismatch"]]
