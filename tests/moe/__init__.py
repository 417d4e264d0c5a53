"""Tests of the MoE layer (`moe/`): single-process against plain references, multi-process against EP 1."""
