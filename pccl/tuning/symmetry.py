"""Which ranks stand for all: the classes of ranks the cost model evaluates once each.

A flat collective run by every group of a level (the world, each node, the ranks with one
local index, any partition into equal groups) costs, per step, its slowest rank. Ranks that
a symmetry of the machine maps onto each other cost the same, so one per class is evaluated.

The symmetries are translations of a regular topology (node k holds ranks kL..kL+L-1):
shifting every rank by m nodes (r -> r + mL mod p) or, on a power-of-two world, XORing it
with multiples of mL. Both move whole nodes and keep every rank's local index, so they keep
which messages cross nodes, which NIC each rank uses and who shares it; on a network with
groups of nodes, only translations by whole groups are used, so they keep those too. A translation is a
symmetry of a collective when it maps every group onto a group and each member's index by a
map the algorithm's schedules commute with (pccl.algorithms.SYMMETRY): the identity (any
algorithm), a rotation (ring, Bruck, pairwise) or an XOR (recursive doubling and halving,
Rabenseifner on a power-of-two group). With the smallest m that works, the ranks of nodes
0..m-1 stand for all: node k's ranks behave as node (k mod m)'s.

One difference within a class is counted exactly rather than assumed away: a run of
consecutive blocks that a rotation carries across the end of the buffer travels as two
messages, so rotated ranks can differ by one message in a step. Each class keeps the
member indices it stands for (`orbits`), and the cost model evaluates its representative
once for each distinct way those indices split runs.

Where no translation is a symmetry (nodes of different sizes or not consecutive, a folded
group whose members a translation permutes), every node is evaluated: the exact evaluation,
which tests hold the classes against.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import numpy as np

from pccl.core.topology import Topology

Level = Union[str, tuple]   # "world", "intra", "inter", or a partition: a tuple of groups of ranks

# The member-index maps each kind of algorithm commutes with.
COMMUTES = {"rotation": ("identity", "rotation"), "xor": ("identity", "xor"), "none": ("identity",)}


@dataclass(frozen=True, eq=False)
class Layout:
    """The groups of a level: groups[g, i] is member i of group g; group_of and index_of
    invert it, per rank."""

    groups: np.ndarray
    group_of: np.ndarray
    index_of: np.ndarray

    @property
    def size(self) -> int:
        return self.groups.shape[1]


@lru_cache(maxsize=256)
def layout(topology: Topology, level: Level) -> Layout:
    if level == "world":
        groups = np.arange(topology.size)[None, :]
    elif isinstance(level, tuple):
        groups = np.array(level, dtype=np.int64)
    else:
        groups = np.array(topology.level_groups(level), dtype=np.int64)
    group_of, index_of = np.empty(topology.size, np.int64), np.empty(topology.size, np.int64)
    group_of[groups] = np.arange(len(groups))[:, None]
    index_of[groups] = np.arange(groups.shape[1])[None, :]
    return Layout(groups, group_of, index_of)


def regular_width(topology: Topology) -> Optional[int]:
    """L where node k holds ranks kL..kL+L-1 in local order, else None."""
    if not topology.is_uniform:
        return None
    width = topology.ranks_per_node
    nodes = np.array(topology.nodes)
    return width if (nodes == np.arange(topology.size).reshape(nodes.shape)).all() else None


def index_maps(lay: Layout, image: np.ndarray) -> set:
    """How the translation rank -> image[rank] maps members: the kinds among "identity",
    "rotation" and "xor" (a constant shift or XOR of the index within each group) it is;
    empty when it does not map every group onto a group by one of them."""
    moved = image[lay.groups]
    target = lay.group_of[moved]
    if (target != target[:, :1]).any():
        return set()
    new, old = lay.index_of[moved], np.arange(lay.size)
    shift, flip = (new - old) % lay.size, new ^ old
    kinds = {"xor"} if (flip == flip[:, :1]).all() else set()
    if (shift == shift[:, :1]).all():
        kinds |= {"rotation"} if shift.any() else {"rotation", "identity"}
    return kinds


@dataclass(frozen=True, eq=False)
class Classes:
    """The ranks evaluated (whole nodes, node-major) and, per evaluated rank, the sorted
    member indices of the ranks it stands for."""

    ranks: np.ndarray
    orbits: tuple


def classes(topology: Topology, lay: Layout, kind: str, exact: bool = False) -> Classes:
    """The classes of `lay`'s ranks for an algorithm of symmetry `kind`; `exact`: one class
    per rank."""
    width = None if exact else regular_width(topology)
    if width is None:
        ranks = np.arange(topology.size)
        return Classes(ranks, tuple(lay.index_of[ranks, None]))
    unit = topology.nodes_per_group if topology.has_groups else 1   # translations move whole groups
    period, orbit = translation_period(topology.num_nodes, width, lay, COMMUTES[kind], unit)
    ranks = np.arange(period * width)
    return Classes(ranks, tuple(np.unique(lay.index_of[orbit(r)]) for r in ranks))


def translation_period(nodes: int, width: int, lay: Layout, allowed: tuple, unit: int = 1):
    """(m, orbit): the fewest nodes m (a multiple of `unit`) whose ranks stand for all under
    shifts or XORs by multiples of m nodes that map members by `allowed` maps, and
    orbit(rank), the ranks a representative stands for."""
    p = nodes * width
    ranks = np.arange(p)

    def works(image) -> bool:
        return bool(index_maps(lay, image) & set(allowed))

    for m in range(unit, nodes, unit):
        if nodes % m == 0 and works((ranks + m * width) % p):
            shift = m
            break
    else:
        shift = nodes
    flip = nodes
    if (p & (p - 1)) == 0:
        flip = next((m for m in (1 << k for k in range(nodes.bit_length())) if m < nodes and m % unit == 0 and all(
            works(ranks ^ (m * width << t)) for t in range((nodes // m).bit_length() - 1))), nodes)
    if flip < shift:
        return flip, lambda r: r ^ (np.arange(nodes // flip) * flip * width)
    return shift, lambda r: (r + np.arange(nodes // shift) * shift * width) % p
