"""Conformance of `mtdeepep.Buffer` to DeepEP's semantics: cases written once, run on every topology they apply to
(`topology.py`) and, those the GPU tests of tests/cuda share, on GPU 0 too (`placement.py`); the topology-specific
cases (internode-only, low-latency-only) live beside them."""
