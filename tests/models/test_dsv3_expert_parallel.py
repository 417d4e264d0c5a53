"""DeepSeek-V3 at expert parallelism 2 (the 'flex' mtdeepep dispatcher over gloo) against the one-process model."""

from __future__ import annotations

import pytest

from .dsv3_ep_cases import ep_matches_one_process

pytestmark = pytest.mark.timeout(300)


def test_ep2_matches_one_process(ep_pools):
    ep_pools[2].run(ep_matches_one_process)
