"""Fixtures shared by the whole suite: `rank_pools` (tests/ranks.py), `one_thread`, and time limits that stretch with
the load."""

from __future__ import annotations

import os

# Before any CUDA use: the GPU tests run ranks as threads of one process (tests/cuda/test_local_ranks.py), whose
# kernels wait for each other; CUDA's lazy module loading would synchronise the context at a kernel's first launch
# and stop them all until the timeout (mtdeepep.utils.local_ranks). No effect without a GPU.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton's interpreter is chosen when Triton is first imported (its standard library, `tl.max` and the like, is
# decorated then): on a machine without a GPU it is set here, before any test module imports Triton, so that every
# in-process Triton kernel runs on CPU tensors whatever the collection order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mtdeepep.utils.testing import start_counts  # noqa: E402

from .ranks import pool_fixture  # noqa: E402

# A test's time limit catches a hang; it is no speed requirement. On a busy machine (CI beside other jobs) every test
# runs slower, so the limits stretch with the load the session starts under: the 1-minute load average over the
# cores, at least 1, at most 4 (MTDEEPEP_TEST_TIMEOUT_SCALE sets it instead).
_MAX_TIMEOUT_SCALE = 4.0


def timeout_scale() -> float:
    explicit = os.environ.get("MTDEEPEP_TEST_TIMEOUT_SCALE")
    if explicit:
        return max(1.0, float(explicit))
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(_MAX_TIMEOUT_SCALE, max(1.0, load / (os.cpu_count() or 1)))


def pytest_configure(config):
    # The suite's own process computes with one intra-op thread, as every rank process does: on 2 cores its rank
    # pools and subprocesses run beside it, and two OpenMP threads that find their core taken spin-wait for each other
    # (tests/models/test_dsv3_model.py at load ~30: 2.6x the CPU time and 3.9x the wall time of one thread; a CPU
    # `torch._grouped_mm` forward + backward of tiny's experts: 20x the CPU time). Tests that need more set it.
    torch.set_num_threads(1)
    scale = timeout_scale()
    config._mtdeepep_timeout_scale = scale
    if scale > 1.0 and getattr(config.option, "timeout", None):
        config.option.timeout = float(config.option.timeout) * scale


def pytest_collection_modifyitems(config, items):
    scale = getattr(config, "_mtdeepep_timeout_scale", 1.0)
    if scale <= 1.0:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            item.add_marker(pytest.mark.timeout(float(marker.args[0]) * scale), append=False)


def pytest_report_header(config):
    return f"mtdeepep: test time limits x{getattr(config, '_mtdeepep_timeout_scale', 1.0):.2f} (load-based)"


def pytest_terminal_summary(terminalreporter):
    # How the rank processes started (mtdeepep.utils.testing): a spawned rank costs ~2.5 s of CPU more than a forked
    # one, so a run that stops forking shows it here, with the reason, instead of only taking longer.
    counts = start_counts()
    if counts:
        terminalreporter.write_line(
            "mtdeepep rank processes: " + "; ".join(f"{n} {how}" for how, n in sorted(counts.items()))
        )


# `rank_pools[n]`: the module's pool of `n` rank processes (spawned once, at first use; gloo on 127.0.0.1).
rank_pools = pool_fixture()


@pytest.fixture
def load_scale(request) -> float:
    """The factor the time limits are stretched by (>= 1): for a test whose own budgets are in seconds."""
    return getattr(request.config, "_mtdeepep_timeout_scale", 1.0)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, as every training rank has (two threads on the loaded 2-core machine run
    ~10x slower); the previous count restored after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
