"""PCCL's hierarchical all-gather and reduce-scatter (the Big Send-off, Section 4).

All-gather on N nodes of L ranks: the inter-node all-gather among the ranks with the same
local index (all L of them at once, so every NIC is busy) leaves each rank with its
column of N blocks; the intra-node all-gather of those columns leaves every rank with all
blocks in local-major order; one local shuffle puts them in rank order. Reduce-scatter is
the mirror image: shuffle, intra-node reduce-scatter, inter-node reduce-scatter.
Inter-node traffic per rank is that of an N-rank collective on one block, and its latency
log2(N) with recursive doubling/halving.
"""
from __future__ import annotations

from pccl.core.topology import Topology
from pccl.ir.plan import Phase, Ref
from pccl.plans.layout import grid_perm, inverse, permute_or_direct


def single_level(topology: Topology, inter: str, intra: str) -> tuple[str, str]:
    """With one node, or one rank per node, the plan is one flat collective on one level."""
    return ("intra", intra) if topology.num_nodes == 1 else ("inter", inter)


def all_gather(topology: Topology, rank: int, inter: str, intra: str, src: str, dst: str):
    n_nodes, n_local = topology.num_nodes, topology.ranks_per_node
    p = n_nodes * n_local
    perm = grid_perm(topology, list(range(n_nodes)), list(range(n_local)))
    direct = perm == tuple(range(p))
    grid = Ref(dst, 0, p) if direct else Ref("grid", 0, p)
    spaces = {} if direct else {"grid": p}
    if n_nodes == 1 or n_local == 1:
        level, algorithm = single_level(topology, inter, intra)
        steps = [Phase("all_gather", level, algorithm, grid, Ref(src, 0, 1))]
    else:
        spaces["column"] = n_nodes
        steps = [Phase("all_gather", "inter", inter, Ref("column", 0, n_nodes), Ref(src, 0, 1)),
                 Phase("all_gather", "intra", intra, grid, Ref("column", 0, n_nodes))]
    return steps + permute_or_direct(grid, Ref(dst, 0, p), perm), spaces


def reduce_scatter(topology: Topology, rank: int, inter: str, intra: str, src: str, dst: str):
    n_nodes, n_local = topology.num_nodes, topology.ranks_per_node
    p = n_nodes * n_local
    perm = inverse(grid_perm(topology, list(range(n_nodes)), list(range(n_local))), p)
    direct = perm == tuple(range(p))
    grid = Ref(src, 0, p) if direct else Ref("grid", 0, p)
    spaces = {} if direct else {"grid": p}
    steps = permute_or_direct(Ref(src, 0, p), grid, perm)
    if n_nodes == 1 or n_local == 1:
        level, algorithm = single_level(topology, inter, intra)
        steps.append(Phase("reduce_scatter", level, algorithm, Ref(dst, 0, 1), grid))
    else:
        spaces["column"] = n_nodes
        steps += [Phase("reduce_scatter", "intra", intra, Ref("column", 0, n_nodes), grid),
                  Phase("reduce_scatter", "inter", inter, Ref(dst, 0, 1), Ref("column", 0, n_nodes))]
    return steps, spaces
