"""Fixtures of the GPU tests (see gpu.py): `cuda_pools`, rank processes that share the one GPU, started once per
module and world size through the one launcher. mtdeepep's timeout in the ranks (`gpu.TIMEOUT_S`) and the process
group's are shorter than a case's deadline, so a stuck kernel reports its own `CommTimeoutError` first, and a hung
rank is killed at the deadline with its stack dumped."""

from __future__ import annotations

import os

import pytest
import torch

from mtdeepep.utils.testing import cuda_executor_import_error

from ..ranks import pool_fixture
from .gpu import TIMEOUT_S


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_required(need_executor): must run on a machine with a GPU; skipping there is a failure"
    )


@pytest.fixture(autouse=True)
def _executor_built(request):
    """On a machine with a GPU, a test that needs mtdeepep's CUDA executor fails at once when it does not import
    (a CUDA build of torch without `_C_cuda` is a broken build, not a reason to skip)."""
    marker = request.node.get_closest_marker("gpu_required")
    if marker is not None and marker.args and marker.args[0] and torch.cuda.is_available():
        error = cuda_executor_import_error()
        if error is not None:
            pytest.fail(f"mtdeepep's CUDA executor does not import on this GPU machine: {error}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a machine with a GPU, a GPU test that skips (a missing package, a failed probe) fails instead: every one of
    them must run where it can, so that a run with skips cannot pass as a GPU check."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("gpu_required") is not None and torch.cuda.is_available():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped on a machine with a GPU, where every GPU test must run: {reason}"
    if report.failed and os.environ.get("MTDEEPEP_INSTAFAIL") == "1":
        # scripts/gpu_check.sh: the failure's report now, not at the end of a run that its time limit may cut.
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n[instafail] {item.nodeid} ({report.when})\n{report.longreprtext[-6000:]}")


# `cuda_pools[n]`: the module's pool of `n` rank processes on GPU 0 (spawned at first use). Two intra-op threads per
# rank for the host-side references; the process group waits twice mtdeepep's timeout, so a stuck kernel's own
# CommTimeoutError comes first. The executor: the CUDA one these cases were written for, unless MTDEEPEP_ENGINE names
# another (scripts/gpu_check.sh's `triton` stage runs them on the Triton executor, the GPU default).
cuda_pools = pool_fixture(
    comm_timeout_s=TIMEOUT_S, deadline_s=4 * TIMEOUT_S, pg_timeout_s=2 * TIMEOUT_S, threads=2, start_timeout_s=120,
    device="cuda", engine=os.environ.get("MTDEEPEP_ENGINE", "cuda"),
)  # fmt: skip
