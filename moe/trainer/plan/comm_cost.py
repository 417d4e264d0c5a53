"""Collective costs and where each group's ranks sit (same node or not), for the planner.

Rank order is the trainer's (moe/trainer/train/parallel_state.py): the dense mesh is `(pp, dp, tp)` with TP fastest and
the expert mesh `(pp, edp, ep, etp)` over the same ranks, so
- a TP group is `tp` consecutive ranks;
- an EP group is `ep` ranks `etp` apart inside a block of `ep * etp` consecutive ranks, and the dispatch and
  combine run over that whole block (the folded EP x ETP group, as Megatron's flex dispatcher does: a token for
  expert e goes to each of the `etp` consecutive ranks holding a shard of e);
- a DP group is `dp` ranks `tp` apart (a block of `dp * tp`), an EDP group spans the block of `dp * tp` too;
- the next pipeline stage is `dp * tp` ranks away.
Nodes hold `devices_per_node` consecutive ranks, so a group stays inside a node when its block fits in one.

Costs (ring algorithms, bus-bandwidth convention): all-gather and reduce-scatter move `(n-1)/n` of the whole
tensor through every rank's link, all-reduce twice that; each call also pays `comm_latency_us`.
"""

from __future__ import annotations

import math

from moe.trainer.plan.devices import DeviceSpec


def intra_node(block: int, spec: DeviceSpec) -> bool:
    """Whether a group whose ranks lie in `block` consecutive ranks stays inside one node."""
    return block <= spec.devices_per_node


def ring_time(kind: str, nbytes: float, n: int, block: int, spec: DeviceSpec) -> float:
    """Seconds of one collective of `kind` ('all_gather', 'reduce_scatter', 'all_reduce') over `n` ranks on a tensor
    of `nbytes` (the whole, unsharded tensor), whose ranks lie in `block` consecutive ranks. 0 for one rank.
    A spec with `reduce_scatter_as_all_reduce` (gloo) pays an all-reduce for a reduce-scatter."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}[kind]
    if kind == "reduce_scatter" and spec.reduce_scatter_as_all_reduce:
        factor = 2.0
    bw = spec.link_bytes_per_s(intra_node(block, spec), op=kind, group=n)
    return factor * (n - 1) / n * nbytes / bw + spec.comm_latency_us * 1e-6


def p2p_time(nbytes: float, intra: bool, spec: DeviceSpec) -> float:
    """Seconds of one point-to-point send of `nbytes`."""
    if nbytes <= 0:
        return 0.0
    return nbytes / spec.link_bytes_per_s(intra, op="p2p", group=2) + spec.comm_latency_us * 1e-6


def expected_distinct(groups: int, num_experts: int, topk: int) -> float:
    """Expected number of distinct groups (ranks or nodes, each holding `num_experts / groups` experts) among a
    token's `topk` experts drawn uniformly without replacement (node-limited routing would lower it)."""
    if groups <= 1:
        return 1.0
    per = num_experts // groups
    miss = math.comb(num_experts - per, topk) / math.comb(num_experts, topk) if num_experts - per >= topk else 0.0
    return groups * (1.0 - miss)


def dispatch_destinations(ep: int, etp: int, num_experts: int, topk: int) -> tuple[float, float]:
    """`(destinations, off_rank)`: the expected distinct ranks one token is sent to by a dispatch over the folded
    group of `ep * etp` ranks, and how many of them are not its own rank.

    Its `topk` experts fall on `expected_distinct(ep, ...)` EP indices; each EP index is `etp` ranks, one shard
    each, and every shard gets the row (deduplicated per rank, not per expert). A given rank of the group holds a
    shard of one EP index, which the token picks with probability `distinct / ep`: that is the row that stays."""
    distinct = expected_distinct(ep, num_experts, topk)
    destinations = distinct * etp
    return destinations, destinations - distinct / ep


def all_to_all_time(
    tokens: float,
    row_bytes: float,
    ep: int,
    etp: int,
    num_experts: int,
    topk: int,
    spec: DeviceSpec,
    *,
    per_expert: bool = False,
) -> float:
    """Seconds of one dispatch (or combine) of `tokens` local tokens of `row_bytes` each over the folded EP x ETP
    group of `ep * etp` consecutive ranks (`dispatch_destinations`: each token reaches the `etp` shards of each of
    its experts' ranks).

    DeepEP sends a token once per destination rank (not per expert). When the group fits in a node the rows leave
    through the intra-node link; with a group larger than a node, a token crosses the NIC once per other
    destination node and is forwarded inside it to that node's destination ranks (at least the `etp` shards of
    one expert, at most the node), and the slower of the two paths bounds the time.

    per_expert: a row per (token, expert) pair instead (Megatron's 'alltoall' dispatcher: `topk * etp` rows per
    token, `(group - 1) / group` of them leave the rank; with capacity padding exactly so).
    """
    group = ep * etp
    if group <= 1 or tokens <= 0:
        return 0.0
    _, off_rank = dispatch_destinations(ep, etp, num_experts, topk)
    if per_expert:
        off_rank = topk * etp * (group - 1) / group
    node = spec.devices_per_node
    if group <= node:
        bw = spec.link_bytes_per_s(True, expert_parallel=True, op="all_to_all", group=group)
        return tokens * off_rank * row_bytes / bw + spec.comm_latency_us * 1e-6
    distinct = expected_distinct(ep, num_experts, topk)
    nodes = math.ceil(group / node)
    span = math.ceil(etp / node)  # nodes one EP index's shards occupy
    if span == 1:  # a node holds node // etp EP indices with all their shards
        other_nodes = expected_distinct(nodes, num_experts, topk) * (nodes - 1) / nodes
    else:  # every chosen EP index is its own `span` nodes; the token's own node is one of them w.p. distinct / ep
        other_nodes = distinct * span - distinct / ep
    own_node_peers = distinct * (node - 1) / ep  # each other rank of the node is a destination w.p. distinct / ep
    local_peers = min(off_rank, own_node_peers + other_nodes * min(etp, node))  # intra-node hops incl. forwarding
    if per_expert:  # NCCL's direct all-to-all: each row crosses the NIC or NVLink once, no forwarding
        rows = topk * etp
        other_nodes, local_peers = rows * (group - node) / group, rows * (node - 1) / group
    inter = tokens * other_nodes * row_bytes / spec.link_bytes_per_s(False, op="all_to_all", group=group)
    intra = tokens * local_peers * row_bytes / spec.link_bytes_per_s(True, expert_parallel=True, op="all_to_all",
                                                                     group=group)  # fmt: skip
    return max(inter, intra) + 2 * spec.comm_latency_us * 1e-6
