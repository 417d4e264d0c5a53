"""torchtitan 0.3.0's DeepEP V2 backend (`torchtitan/distributed/deepep/deepep.py`), unmodified, on mtdeepep's
`ElasticBuffer` (`from deep_ep import ElasticBuffer` through the opt-in alias), 2 CPU ranks over gloo: `get_buffer`,
`dispatch_tokens`, `combine_tokens`, `sync_combine`, forward and backward (compact layout) and the inference
expanded layout, each against a float64 plain-PyTorch MoE layer (see client_cases.py).

torchtitan registers its custom ops for the CUDA key only; clients_env.py registers the same functions for CPU.
"""

import pytest

from . import client_cases as cases

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_training_round_trip(pool, dtype_name):
    pool.run(cases.torchtitan_training_round_trip, dtype_name)


def test_inference_expanded_layout(pool):
    pool.run(cases.torchtitan_inference_expanded_layout)


def test_backward_after_buffer_replaced(pool):
    """torchtitan's get_buffer replaces its buffer for a larger layer; the earlier layer's backward then runs its
    old handle on the new buffer (DeepEP accepts any handle of the group)."""
    pool.run(cases.torchtitan_backward_after_buffer_replaced)
