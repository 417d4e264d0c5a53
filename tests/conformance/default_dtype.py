"""Cases run with another default dtype in the rank processes, as DeepEP's own harnesses do
(`torch.set_default_dtype(torch.bfloat16)`): every output the library allocates must carry its documented dtype
(float32 weights, int32 counts, ...) whatever the caller's default is. The cases build their inputs with explicit
dtypes, as upstream's tests do, so only the library's own allocations can be affected."""

from __future__ import annotations

import contextlib

import torch

DEFAULT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@contextlib.contextmanager
def default_dtype(dtype_name: str):
    """`torch.set_default_dtype(dtype_name)` inside the block, the previous default restored after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DEFAULT_DTYPES[dtype_name])
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def under_default_dtype(ctx, dtype_name: str, case, *args):
    """`case(ctx, *args)` in a rank process with `dtype_name` as the default dtype."""
    with default_dtype(dtype_name):
        return case(ctx, *args)
