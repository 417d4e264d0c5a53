"""mtdeepep's DeepEP V2 facade (`mtdeepep.elastic.ElasticBuffer`) at 2 CPU ranks, against the plain-PyTorch
reference: non-expanded and expanded layouts, cached dispatch, no-CPU-sync padding, FP8, combine with weights and
biases, the handle's V2 fields, bad inputs; and the opt-in `deep_ep` alias (`mtdeepep.compat`), in this process.
"""

import sys
import types

import pytest

import mtdeepep
from mtdeepep import compat

from . import client_cases as cases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: DeepEP V2 clients on 2 ranks


@pytest.mark.parametrize(
    "case",
    [
        cases.elastic_dispatch_matches_reference,
        cases.elastic_expanded_layout_matches_reference,
        cases.elastic_combine_matches_reference,
        cases.elastic_fp8_dispatch,
        cases.elastic_bad_inputs_raise_value_error,
        cases.elastic_domains_and_lifetime,
    ],
    ids=lambda case: case.__name__,
)
def test_elastic_case(pool, case):
    pool.run(case)


def test_elastic_dispatch_over_two_nodes(pool):
    """Each rank its own node: the handle is V1's internode one; the V2 fields must not change."""
    pool.run(cases.elastic_dispatch_matches_reference, 1)


@pytest.fixture
def clean_alias():
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == compat.ALIAS_NAME}
    for name in saved:
        del sys.modules[name]
    yield
    compat.uninstall_deep_ep_alias()
    sys.modules.update(saved)


def test_alias_exports_mtdeepep_objects(clean_alias):
    top = compat.install_deep_ep_alias()
    assert compat.install_deep_ep_alias() is top  # idempotent
    import deep_ep
    import deep_ep.utils
    import deep_ep.utils.event
    from deep_ep import Buffer, ElasticBuffer, EPHandle, EventOverlap, topk_idx_t
    from deep_ep.utils import EventHandle, check_nvlink_connections

    assert deep_ep is top and Buffer is mtdeepep.Buffer and EventOverlap is mtdeepep.EventOverlap
    assert EventHandle is mtdeepep.EventHandle and topk_idx_t is mtdeepep.topk_idx_t
    assert ElasticBuffer is mtdeepep.elastic.ElasticBuffer and EPHandle is mtdeepep.elastic.EPHandle
    assert deep_ep.utils.event.EventOverlap is EventOverlap and callable(check_nvlink_connections)
    # Megatron builds EventOverlap(EventHandle()) as a previous event: it must be a complete mtdeepep event.
    assert deep_ep.utils.EventOverlap(EventHandle()).query()
    # What mtdeepep lacks stays missing, so clients take their fallbacks.
    with pytest.raises(ImportError):
        from deep_ep import HybridEPBuffer  # noqa: F401
    with pytest.raises(ImportError):
        import deep_ep.hybrid_ep_buffer  # noqa: F401
    compat.uninstall_deep_ep_alias()
    assert "deep_ep" not in sys.modules and not compat.is_deep_ep_alias_installed()


def test_alias_refuses_to_shadow_a_real_deep_ep(clean_alias):
    sys.modules["deep_ep"] = types.ModuleType("deep_ep")
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            compat.install_deep_ep_alias()
    finally:
        del sys.modules["deep_ep"]


_PLAIN_IMPORT = """
import sys

import mtdeepep as deep_ep

assert deep_ep.ElasticBuffer is __import__("mtdeepep.elastic").elastic.ElasticBuffer
assert deep_ep.EPHandle is __import__("mtdeepep.elastic").elastic.EPHandle
sys.modules["deep_ep"] = deep_ep  # what `import mtdeepep as deep_ep` promises: the package itself as deep_ep
from deep_ep import Buffer, Config, ElasticBuffer, EPHandle, EventOverlap  # noqa: E402,F401

import torchtitan.distributed.deepep.deepep as titan  # noqa: E402

assert titan.ElasticBuffer is ElasticBuffer, "torchtitan did not take mtdeepep's ElasticBuffer"
print("ok")
"""


def test_v2_names_on_a_plain_import():
    """Issue 23, item 6: `import mtdeepep as deep_ep` (the README's first line, no alias installed) gives DeepEP V2's
    `ElasticBuffer` and `EPHandle` too, so torchtitan 0.3.0's DeepEP backend imports with mtdeepep as `deep_ep`. In a
    fresh interpreter: no alias of another test may help."""
    import subprocess

    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed")
    done = subprocess.run([sys.executable, "-c", _PLAIN_IMPORT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
