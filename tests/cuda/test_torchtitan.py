"""torchtitan 0.3.0's DeepEP V2 backend run unmodified on mtdeepep's `ElasticBuffer` with 2 ranks sharing GPU 0 (the
client cases of tests/clients/client_cases.py with the GPU placement). Skipped, with one reason, without a CUDA device
or without mtdeepep's CUDA executor, or without torchtitan (installed with --no-deps by scripts/env.sh; carried as
wheels by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest

from ..clients import client_cases as cases
from ..conformance.placement import CUDA
from .gpu import skip_unless_cuda

pytestmark = [*skip_unless_cuda(), pytest.mark.timeout(300)]


@pytest.fixture(scope="module", autouse=True)
def _torchtitan_installed():
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed")


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_training_round_trip(cuda_pools, dtype_name):
    cuda_pools[2].run(cases.torchtitan_training_round_trip, dtype_name, CUDA)


def test_inference_expanded_layout(cuda_pools):
    cuda_pools[2].run(cases.torchtitan_inference_expanded_layout, CUDA)
