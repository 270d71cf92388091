"""Block layouts shared by the two-level plan builders."""
from __future__ import annotations

from pccl.core.topology import Topology
from pccl.ir.plan import Permute, Ref


def grid_perm(topology: Topology, nodes: list[int], locals_: list[int]) -> tuple[int, ...]:
    """Global rank of each block of a local-major grid: block i*len(nodes) + j holds the
    data of rank (node nodes[j], local index locals_[i])."""
    return tuple(topology.nodes[n][l] for l in locals_ for n in nodes)


def inverse(perm: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The inverse of a partial permutation onto range(size); blocks no one maps to get -1."""
    out = [-1] * size
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


def permute_or_direct(src: Ref, dst: Ref, perm: tuple[int, ...]) -> list:
    """A Permute step, or nothing when src already is dst in the right order."""
    if src == dst and perm == tuple(range(len(perm))):
        return []
    return [Permute(src, dst, perm)]
