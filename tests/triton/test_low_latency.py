"""The Triton low-latency kernels (`mtdeepep.kernels.low_latency`) under Triton's interpreter, on 2 ranks of
`tests/ranks.py`'s pool, against the CPU executor's low-latency mode (cases in ll_cases.py), and their element casts
against torch's on every bfloat16 input."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

from mtdeepep.kernels import fp8, low_latency  # noqa: E402
from tests.ranks import pool_fixture  # noqa: E402

from . import ll_cases as cases  # noqa: E402

pytestmark = pytest.mark.timeout(300)
pool = pool_fixture(world_size=2, comm_timeout_s=40, deadline_s=150)


def test_bfloat16_rounding_matches_torch():
    """The combine's FP32 -> bfloat16 rounding with integer operations (round to nearest even, NaN kept): bitwise
    torch's, on every bfloat16 value and its neighbours halfway and beyond, and on random float32 of every range. The
    interpreter's native `.to(tl.bfloat16)` truncates and fails here. (The FP8 cast is `mtdeepep.kernels.fp8`'s, tested
    in test_fp8_cast.py; the FP8 dispatch below is bitwise the CPU executor's.)"""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bits = patterns.view(torch.int32)
    values = torch.cat([patterns, (bits + 0x8000).view(torch.float32), (bits + 0x8001).view(torch.float32),
                        (bits + 0x7FFF).view(torch.float32)])  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(1 << 16, generator=generator) * torch.exp2(
        torch.randint(-140, 120, (1 << 16,), generator=generator).float()
    )
    for x in (values, wide):
        expected = x.bfloat16().view(torch.int16)
        got = low_latency.bf16_bits(x)
        nan = x.isnan()
        assert torch.equal(got[~nan], expected[~nan])
        assert bool(got[nan].view(torch.bfloat16).isnan().all())


def test_layout_matches_the_cpu_executor_and_fits_its_size_hint():
    from mtdeepep import _C

    for args in ((128, 7168, 8, 256), (32, 512, 2, 8), (64, 100, 4, 12)):
        tokens, hidden, ranks, experts = args
        layout = low_latency.HalfLayout(tokens, hidden, ranks, experts)
        control = low_latency.ControlLayout(ranks)
        assert control.end <= control.halves
        assert control.halves + 2 * layout.bytes == _C.LowLatencyProtocol.size_hint(*args)


@pytest.mark.slow  # 2 interpreted ranks: keeps `-m 'not slow'` under 5 minutes
def test_dispatch_and_combine_match_cpu(pool):
    assert pool.run(cases.dispatch_and_combine_match_cpu) == ["ok", "ok"]


@pytest.mark.slow  # 2 interpreted ranks: keeps `-m 'not slow'` under 5 minutes
def test_zero_copy_and_out(pool):
    assert pool.run(cases.zero_copy_and_out) == ["ok", "ok"]


@pytest.mark.slow  # 2 interpreted ranks: keeps `-m 'not slow'` under 5 minutes
def test_two_results_alive(pool):
    assert pool.run(cases.two_results_alive) == ["ok", "ok"]


@pytest.mark.slow  # 24 rounds on both executors: ~50 s on 2 loaded cores
def test_peer_runs_ahead_double_buffer(pool):
    seqs = pool.run(cases.peer_runs_ahead)
    assert seqs[0] == seqs[1] and seqs[0] >= 48


@pytest.mark.slow  # 2 interpreted ranks: keeps `-m 'not slow'` under 5 minutes
def test_missing_rank_times_out_then_clean_recovers(pool):
    outcomes = pool.run(cases.missing_rank_times_out_then_clean_recovers)
    assert outcomes == [["timeout", "mismatch", "peer-destroyed"], ["mismatch", "destroyed"]]


def test_dispatch_kernel_uses_the_fp8_module_cast():
    """The FP8 dispatch casts with `mtdeepep.kernels.fp8` (integer-op E4M3, exact scales), never Triton's own
    `.to(tl.float8e4nv)`, which rounds wrongly in the interpreter."""
    import inspect

    source = inspect.getsource(low_latency)
    assert "fp8.quantize_blocks(" in source
    quantize = inspect.getsource(fp8.quantize_blocks.fn)
    assert "e4m3_bits_from_f32(" in quantize and "block_scale(" in quantize
    assert "float8e4nv" not in source.replace("`.to(tl.float8e4nv)`", "")
