"""The one parametrisation of the triton executor's conformance files: every case of a CPU-executor suite that
applies to a topology, a case the triton executor does not serve skipped with its reason."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest


def case_params(cases: Iterable[Callable], applies: Callable, topology, not_served: dict[Callable, str]) -> list:
    """`pytest.param(case, topology)` for every case that `applies(case, topology)`, id `<case>-<topology>`, marked
    skip with `not_served[case]` where the triton executor does not serve it."""
    return [
        pytest.param(case, topology, id=f"{case.__name__}-{topology}",
                     marks=[pytest.mark.skip(reason=not_served[case])] if case in not_served else [])
        for case in cases if applies(case, topology)
    ]  # fmt: skip
