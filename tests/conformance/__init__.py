"""Conformance of `mtdeepep.Buffer` to DeepEP's semantics: cases written once, run on every topology they apply to
(`topology.py`); the topology-specific cases (internode-only, low-latency-only) live beside them."""
