"""The `torch._scaled_mm` probe and operand padding of `moe.layer.fp8.gemm`, on the CPU, against a stand-in for the
block-scaled kernel that behaves as the H200 with torch 2.11 did (bench/gpu_runs.md, 2026-11-28, second session):

- it accepts only column-major 1x128 scales for the left operand, and for the right one column-major 128x128 scales
  (unpadded) or row-major 128x1 scales; anything else raises "Invalid scaling configuration.";
- it reads 128x128 scales as if `K/128` were rounded up to 4 (right at K = 512, wrong at K = 384);
- it rejects row counts and K that are not multiples of 16 (cuBLASLt's CUBLAS_STATUS_NOT_SUPPORTED).

The probe must find the one convention that is right on every shape (K padded to 512, rows to 16), and the padded
GEMM must equal the emulation (dequantise + FP32 matmul) for ragged shapes and transposed operands; a stand-in that
reads the scales as given must be probed to the unpadded convention.
"""

from __future__ import annotations

import pytest
import torch

from moe.layer.fp8 import ACT_TILE, COL_TILE, WEIGHT_TILE, cast_blockwise, gemm
from mtdeepep.utils.fp8 import dequantize_blocks


def stand_in(rounds_up_k_blocks: bool):
    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        M, K = a.shape
        if M % 16 or K % 16:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED")
        if scale_a.stride(0) != 1:
            raise RuntimeError("Invalid scaling configuration.")
        tile = COL_TILE if scale_b.size(1) == b.size(1) else WEIGHT_TILE
        if tile == WEIGHT_TILE:
            kb, nb = scale_b.shape
            if scale_b.stride() != (1, kb):
                raise RuntimeError("Invalid scaling configuration.")
            if rounds_up_k_blocks:  # read column j at j * round_up(kb, 4): the next columns' values, then past the end
                ld = -(-kb // 4) * 4
                flat = torch.cat([scale_b.t().reshape(-1), torch.full((nb * ld,), 7.0)])
                scale_b = torch.stack([flat[j * ld : j * ld + kb] for j in range(nb)]).t()
        elif not scale_b.is_contiguous():
            raise RuntimeError("Invalid scaling configuration.")
        product = dequantize_blocks(a, scale_a, ACT_TILE) @ dequantize_blocks(b, scale_b, tile)
        return product.to(out_dtype)

    return scaled_mm


@pytest.fixture
def cpu_scaled_mm(monkeypatch):
    def install(rounds_up_k_blocks: bool = True):
        monkeypatch.setattr(torch, "_scaled_mm", stand_in(rounds_up_k_blocks), raising=False)

    return install


def chosen(tile) -> gemm.Variant:
    report = gemm.probe_scaled_mm(torch.device("cpu"), tile)
    assert report and report[-1][1] == "ok", report
    return report[-1][0]


def test_probe_finds_the_convention_that_is_right_on_every_shape(cpu_scaled_mm):
    cpu_scaled_mm(rounds_up_k_blocks=True)
    weight = chosen(WEIGHT_TILE)
    assert (weight.a_scale_col_major, weight.b_scale, weight.row_align, weight.k_align) == (True, "col", 16, 512)
    column = chosen(COL_TILE)
    assert (column.a_scale_col_major, column.b_scale, column.row_align) == (True, "row", 16)
    # The unpadded column-major convention is accepted by the stand-in but wrong at K = 384: the probe saw that.
    outcomes = dict(gemm.probe_scaled_mm(torch.device("cpu"), WEIGHT_TILE))
    assert outcomes[gemm.Variant(True, "col", torch.float32, 1, 1)].startswith("mismatch")


def test_probe_keeps_k_unpadded_where_the_kernel_reads_the_scales_as_given(cpu_scaled_mm):
    cpu_scaled_mm(rounds_up_k_blocks=False)
    assert chosen(WEIGHT_TILE).k_align == 1


@pytest.mark.parametrize("M, K, N", [(1, 40, 256), (40, 384, 384), (100, 1408, 256), (128, 512, 512)])
def test_padded_gemm_equals_the_emulation_on_ragged_shapes(cpu_scaled_mm, M, K, N):
    cpu_scaled_mm(rounds_up_k_blocks=True)
    gen = torch.Generator().manual_seed(M + K + N)
    x, w, g = torch.randn(M, K, generator=gen), torch.randn(K, N, generator=gen), torch.randn(M, N, generator=gen)
    cases = {
        "forward (1x128 @ 128x128)": (cast_blockwise(x, ACT_TILE), cast_blockwise(w, WEIGHT_TILE)),
        "input grad (transposed weight operand)": (cast_blockwise(g, ACT_TILE), cast_blockwise(w, WEIGHT_TILE).t()),
        "weight grad (1x128 @ 128x1)": (cast_blockwise(x.t().contiguous(), ACT_TILE), cast_blockwise(g, COL_TILE)),
    }
    for name, (a, b) in cases.items():
        variant = chosen(b.tile)
        expected = a.dequantize() @ b.dequantize()
        got = gemm._scaled_mm(a, b, variant)
        assert got.shape == expected.shape, name
        # FP32 sums of the same products in another order (the padding adds exact zeros).
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()), msg=name)
