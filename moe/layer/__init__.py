"""The MoE layer room: what one Mixture-of-Experts layer is and how its tokens move, with nothing of training runs.

Router and balancing (`router.py`, `balancing.py`, `capacity.py`), the experts (`experts.py`), `MoELayer`
(`moe_layer.py`) and its loss, the token dispatchers over mtdeepep (`dispatcher/`), FP8 numerics (`fp8/`), the
tensor / sequence parallel building blocks (`parallel/`), and the layer's backward tools (`wgrad.py`,
`recompute.py`, `interleave.py`). It imports `mtdeepep` below it and never `moe.trainer` above it.
"""
