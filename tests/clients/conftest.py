"""The clients' rank processes: 2 ranks, started once per test module and running all its cases."""

from __future__ import annotations

import pytest

from mtdeepep.utils.testing import RankPool


@pytest.fixture(scope="module")
def pool():
    """The module's `RankPool` of 2 ranks (gloo on 127.0.0.1); a case may run 180 s."""
    ranks = RankPool(2, timeout_s=180)
    yield ranks
    ranks.close()
