"""The topologies a conformance case runs on: ranks of this host, one node or split into nodes.

Intranode: one node of `world_size` ranks (`Buffer(group, ...)`, the default node size). Internode: nodes of
`ranks_per_node` consecutive ranks (`Buffer(group, ..., num_ranks_per_node=...)`), so both stages run: the network
stage over torch.distributed (gloo) and the node-local stage over shared memory. A `Topology` is pickled into the
rank processes with every case, with its placement (placement.py): the CPU executor, or GPU 0 for the GPU tests of
tests/cuda, which run the same cases on one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import mtdeepep as deep_ep

from .placement import CPU, Placement


@dataclass(frozen=True)
class Topology:
    world_size: int
    ranks_per_node: int | None = None  # None: one node of every rank (intranode)
    placement: Placement = CPU

    def __post_init__(self) -> None:
        if self.placement.on_gpu and self.internode:
            raise ValueError("the CUDA executor runs on one node: a GPU topology is intranode")

    def __str__(self) -> str:
        prefix = "" if self.placement == CPU else f"{self.placement}-"
        if self.ranks_per_node is None:
            return f"{prefix}intranode-{self.world_size}"
        return f"{prefix}internode-{self.num_nodes}x{self.ranks_per_node}"

    @property
    def internode(self) -> bool:
        return self.ranks_per_node is not None

    @property
    def node_size(self) -> int:
        return self.world_size if self.ranks_per_node is None else self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    def buffer_kwargs(self) -> dict:
        return {} if self.ranks_per_node is None else {"num_ranks_per_node": self.ranks_per_node}

    def buffer(self, ctx, num_nvl_bytes: int | None = None, **kwargs) -> deep_ep.Buffer:
        """One buffer per topology and size (None: the placement's default), kept in the rank's cache across the
        cases of its pool."""
        num_nvl_bytes = self.placement.default_nvl_bytes if num_nvl_bytes is None else num_nvl_bytes
        key = f"{self}-{num_nvl_bytes}-{sorted(kwargs.items())}"
        if key not in ctx.cache:
            ctx.cache[key] = self.new_buffer(ctx, num_nvl_bytes, **kwargs)
        return ctx.cache[key]

    def new_buffer(self, ctx, num_nvl_bytes: int, **kwargs) -> deep_ep.Buffer:
        assert ctx.world_size == self.world_size, (ctx.world_size, self)
        return self.placement.new_buffer(ctx, num_nvl_bytes, **self.buffer_kwargs(), **kwargs)


INTRANODE_2 = Topology(2)
INTRANODE_4 = Topology(4)
INTERNODE_2X2 = Topology(4, ranks_per_node=2)
INTERNODE_4X1 = Topology(4, ranks_per_node=1)

INTRANODE = [INTRANODE_2, INTRANODE_4]
INTERNODE = [INTERNODE_2X2, INTERNODE_4X1]
NORMAL = INTRANODE + INTERNODE  # normal (high-throughput) mode runs on all of them


def slow_except(quick: Topology, topologies: list[Topology] = NORMAL) -> list:
    """`topologies` as pytest parameters, all but `quick` marked slow: the timeout and overlap measurements cost
    seconds each, so the edit-test loop (`-m 'not slow'`) runs them on `quick`; the whole suite runs every one."""
    return [pytest.param(t, id=str(t), marks=[] if t is quick else [pytest.mark.slow]) for t in topologies]
