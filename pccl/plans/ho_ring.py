"""PaRO's Hierarchical Overlapping Ring (HO-Ring, Section 3.4 and Figure 4).

All-gather: each rank sends its block around the inter-node ring (ranks with its local
index) and the intra-node ring at the same time, so both kinds of links are busy; then an
intra-node ring gathers the blocks the other local ranks brought from the other nodes.
Reduce-scatter is the mirror image: an intra-node ring reduces the blocks bound for
other nodes, then the inter-node ring and an intra-node ring for this node's own blocks
run at the same time, and their two partial results are combined.
"""
from __future__ import annotations

from pccl.core.topology import Topology
from pccl.ir.plan import Combine, Concurrent, Fill, Permute, Phase, Ref
from pccl.plans import hierarchical
from pccl.plans.layout import grid_perm, inverse


def node_slice(topology: Topology, node: int, buffer: str):
    """Ref to the node's blocks in a rank-ordered buffer, if they are contiguous there."""
    ranks = topology.nodes[node]
    return Ref(buffer, ranks[0], len(ranks)) if ranks == tuple(range(ranks[0], ranks[0] + len(ranks))) else None


def grid(topology: Topology, rank: int):
    """(N, L, p, this rank's node, the other nodes)."""
    n_nodes, n_local, node = topology.num_nodes, topology.ranks_per_node, topology.node_of(rank)
    return n_nodes, n_local, n_nodes * n_local, node, [k for k in range(n_nodes) if k != node]


def all_gather(topology: Topology, rank: int, src: str, dst: str):
    n_nodes, n_local, p, node, foreign = grid(topology, rank)
    if n_nodes == 1 or n_local == 1:  # one level only: a plain ring
        return hierarchical.all_gather(topology, rank, "ring", "ring", src, dst)
    spaces = {"column": n_nodes, "foreign": n_nodes - 1, "rest": n_local * (n_nodes - 1)}
    own = node_slice(topology, node, dst)
    steps: list = []
    if own is None:
        spaces["own"] = n_local
        own = Ref("own", 0, n_local)
        steps_after = [Permute(own, Ref(dst, 0, p), topology.nodes[node])]
    else:
        steps_after = []
    steps.append(Concurrent((
        Phase("all_gather", "inter", "ring", Ref("column", 0, n_nodes), Ref(src, 0, 1)),
        Phase("all_gather", "intra", "ring", own, Ref(src, 0, 1)),
    )))
    steps += steps_after
    # This node's block of the column is already in place: move on the others only.
    steps.append(Permute(Ref("column", 0, n_nodes), Ref("foreign", 0, n_nodes - 1),
                         tuple(-1 if k == node else k - (k > node) for k in range(n_nodes))))   # foreign.index(k)
    steps.append(Phase("all_gather", "intra", "ring", Ref("rest", 0, n_local * (n_nodes - 1)),
                       Ref("foreign", 0, n_nodes - 1)))
    steps.append(Permute(Ref("rest", 0, n_local * (n_nodes - 1)), Ref(dst, 0, p),
                         grid_perm(topology, foreign, list(range(n_local)))))
    return steps, spaces


def reduce_scatter(topology: Topology, rank: int, src: str, dst: str):
    n_nodes, n_local, p, node, foreign = grid(topology, rank)
    if n_nodes == 1 or n_local == 1:  # one level only: a plain ring
        return hierarchical.reduce_scatter(topology, rank, "ring", "ring", src, dst)
    rest = n_local * (n_nodes - 1)
    spaces = {"rest": rest, "partial": n_nodes - 1, "column": n_nodes, "mine": 1}
    steps: list = [
        # Blocks bound for other nodes, local-major, reduced over this node first.
        Permute(Ref(src, 0, p), Ref("rest", 0, rest), inverse(grid_perm(topology, foreign, list(range(n_local))), p)),
        Phase("reduce_scatter", "intra", "ring", Ref("partial", 0, n_nodes - 1), Ref("rest", 0, rest)),
        Permute(Ref("partial", 0, n_nodes - 1), Ref("column", 0, n_nodes), tuple(foreign)),
        # This node's share of the column comes from the concurrent intra-node ring.
        Fill(Ref("column", node, 1)),
    ]
    own = node_slice(topology, node, src)
    if own is None:
        spaces["own"] = n_local
        own = Ref("own", 0, n_local)
        steps.append(Permute(Ref(src, 0, p), own, inverse(topology.nodes[node], p)))
    steps.append(Concurrent((
        Phase("reduce_scatter", "inter", "ring", Ref(dst, 0, 1), Ref("column", 0, n_nodes)),
        Phase("reduce_scatter", "intra", "ring", Ref("mine", 0, 1), own),
    )))
    steps.append(Combine(Ref(dst, 0, 1), Ref("mine", 0, 1)))
    return steps, spaces
