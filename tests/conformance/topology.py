"""The topologies a conformance case runs on: ranks of this host, one node or split into nodes.

Intranode: one node of `world_size` ranks (`Buffer(group, ...)`, the default node size). Internode: nodes of
`ranks_per_node` consecutive ranks (`Buffer(group, ..., num_ranks_per_node=...)`), so both stages run: the network
stage over torch.distributed (gloo) and the node-local stage over shared memory. A `Topology` is pickled into the
rank processes with every case.
"""

from __future__ import annotations

from dataclasses import dataclass

import mtdeepep as deep_ep


@dataclass(frozen=True)
class Topology:
    world_size: int
    ranks_per_node: int | None = None  # None: one node of every rank (intranode)

    def __str__(self) -> str:
        if self.ranks_per_node is None:
            return f"intranode-{self.world_size}"
        return f"internode-{self.num_nodes}x{self.ranks_per_node}"

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

    def buffer(self, ctx, num_nvl_bytes: int = 64 << 20, **kwargs) -> deep_ep.Buffer:
        """One buffer per topology and size, kept in the rank's cache across the cases of its pool."""
        key = f"{self}-{num_nvl_bytes}-{sorted(kwargs.items())}"
        if key not in ctx.cache:
            ctx.cache[key] = self.new_buffer(ctx, num_nvl_bytes, **kwargs)
        return ctx.cache[key]

    def new_buffer(self, ctx, num_nvl_bytes: int, **kwargs) -> deep_ep.Buffer:
        assert ctx.world_size == self.world_size, (ctx.world_size, self)
        return deep_ep.Buffer(ctx.group, num_nvl_bytes, **self.buffer_kwargs(), **kwargs)


INTRANODE_2 = Topology(2)
INTRANODE_4 = Topology(4)
INTERNODE_2X2 = Topology(4, ranks_per_node=2)
INTERNODE_4X1 = Topology(4, ranks_per_node=1)

INTRANODE = [INTRANODE_2, INTRANODE_4]
INTERNODE = [INTERNODE_2X2, INTERNODE_4X1]
NORMAL = INTRANODE + INTERNODE  # normal (high-throughput) mode runs on all of them
