"""The hierarchical all-gather and reduce-scatter on three levels: node, network group, world.

On a network whose groups of nodes (dragonfly groups, pods) are joined by fewer or slower
links than those within them, PCCL's two-level plan generalizes to one more level. All-gather
on K groups of G nodes of L ranks: the "global" all-gather among the ranks with this local
index and this node's place in its group, one per group (every rank of every group at once,
so all groups' links to the others are busy, and each carries one block per rank, the least
any plan sends between groups), leaves each rank K blocks; the "group" all-gather among the
ranks with this local index on the nodes of this group gathers those into G*K; the "intra"
all-gather of the node gathers everything, local-major; one shuffle puts it in rank order.
Reduce-scatter is the mirror image. Without groups (one group, or one node per group) it is
the two-level plan.
"""
from __future__ import annotations

from pccl.core.topology import Topology
from pccl.ir.plan import Phase, Ref
from pccl.plans import hierarchical
from pccl.plans.layout import grid_perm, inverse, permute_or_direct


def shape(topology: Topology) -> tuple[int, int, int, list[int]]:
    """(K groups, G nodes per group, p, the node of each column block: place-major, then group)."""
    per_group = topology.nodes_per_group
    groups = topology.num_nodes // per_group
    order = [k * per_group + q for q in range(per_group) for k in range(groups)]
    return groups, per_group, topology.size, order


def applies(topology: Topology) -> bool:
    return topology.has_groups and topology.nodes_per_group > 1 and topology.ranks_per_node > 1


def all_gather(topology: Topology, rank: int, inter: str, intra: str, src: str, dst: str):
    if not applies(topology):
        return hierarchical.all_gather(topology, rank, inter, intra, src, dst)
    groups, per_group, p, order = shape(topology)
    perm = grid_perm(topology, order, list(range(topology.ranks_per_node)))
    direct = perm == tuple(range(p))
    grid = Ref(dst, 0, p) if direct else Ref("grid", 0, p)
    spaces = {"across": groups, "column": topology.num_nodes, **({} if direct else {"grid": p})}
    steps = [Phase("all_gather", "global", inter, Ref("across", 0, groups), Ref(src, 0, 1)),
             Phase("all_gather", "group", inter, Ref("column", 0, topology.num_nodes), Ref("across", 0, groups)),
             Phase("all_gather", "intra", intra, grid, Ref("column", 0, topology.num_nodes))]
    return steps + permute_or_direct(grid, Ref(dst, 0, p), perm), spaces


def reduce_scatter(topology: Topology, rank: int, inter: str, intra: str, src: str, dst: str):
    if not applies(topology):
        return hierarchical.reduce_scatter(topology, rank, inter, intra, src, dst)
    groups, per_group, p, order = shape(topology)
    perm = inverse(grid_perm(topology, order, list(range(topology.ranks_per_node))), p)
    direct = perm == tuple(range(p))
    grid = Ref(src, 0, p) if direct else Ref("grid", 0, p)
    spaces = {"across": groups, "column": topology.num_nodes, **({} if direct else {"grid": p})}
    steps = permute_or_direct(Ref(src, 0, p), grid, perm)
    steps += [Phase("reduce_scatter", "intra", intra, Ref("column", 0, topology.num_nodes), grid),
              Phase("reduce_scatter", "group", inter, Ref("across", 0, groups), Ref("column", 0, topology.num_nodes)),
              Phase("reduce_scatter", "global", inter, Ref(dst, 0, 1), Ref("across", 0, groups))]
    return steps, spaces
