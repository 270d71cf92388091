"""Where ranks live: nodes, local indices, NICs and, optionally, groups of nodes.

A topology lists the ranks of each node in local order; the hierarchical plans need
every node to hold the same number of ranks. It is detected (pccl.runtime.detect) from MPI's shared-memory
split (checked against Slurm's, Open MPI's or torchrun's ranks-per-node variables) or
given explicitly: ``Topology.regular(size, ranks_per_node)`` treats consecutive groups of
ranks as nodes, which lets hierarchical plans run, and be tested, on one machine.

NICs: the local ranks of a node are spread over its NICs in consecutive groups, as on
Frontier (8 GCDs, 4 NICs, GCD pairs 0-1, 2-3, 4-5, 6-7 share a NIC) or Perlmutter (4 GPUs,
4 NICs). ``nic_mapping()`` writes the MPICH_OFI_NIC_MAPPING string that pins each local
rank's traffic to its NIC.

Groups: above the node, large networks are not flat. `nodes_per_group` consecutive nodes
form a group (a dragonfly group on Slingshot, a pod or scalable unit of a fat-tree) whose
links to other groups are fewer or slower than those within it. Two more plan levels
follow: "group", the ranks with this local index on the nodes of this group, and "global",
the ranks with this local index and this node's place in its group, one per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

# Node types the launch scripts name; the same shapes as the machine profiles
# (pccl/tuning/profiles/<name>.json, with sources; a test holds them equal). This module stays
# free of imports from pccl, so that launch scripts can read it alone.
MACHINES = {
    "frontier": dict(ranks_per_node=8, nics_per_node=4),   # 4 MI250X = 8 GCDs, 4 Slingshot NICs
    "perlmutter": dict(ranks_per_node=4, nics_per_node=4),  # 4 A100, 4 Slingshot NICs
    "dgx-h100": dict(ranks_per_node=8, nics_per_node=8),    # 8 H100, 8 ConnectX-7 NICs
}

# Environment the PCCL paper uses on Frontier (Section 3.1), with the NIC mapping filled in.
FRONTIER_ENV = {
    "MPICH_OFI_NIC_POLICY": "USER",
    "MPICH_OFI_NIC_MAPPING": "0:0-1;1:2-3;2:4-5;3:6-7",
    "MPICH_GPU_SUPPORT_ENABLED": "1",
    "FI_CXI_RDZV_THRESHOLD": "0",
    "FI_CXI_RDZV_GET_MIN": "0",
    "FI_CXI_RDZV_EAGER_SIZE": "0",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "HSA_ENABLE_SDMA": "0",
}


class TopologyError(ValueError):
    """A topology that is inconsistent, or that a plan cannot use."""


@dataclass(frozen=True)
class Topology:
    nodes: tuple[tuple[int, ...], ...]   # the global ranks of each node, in local order
    nics_per_node: int = 1
    nodes_per_group: Optional[int] = None   # consecutive nodes per network group; None: one group

    def __post_init__(self) -> None:
        ranks = sorted(r for node in self.nodes for r in node)
        if not self.nodes or any(not node for node in self.nodes):
            raise TopologyError(f"every node needs at least one rank, got {self.nodes}")
        if ranks != list(range(len(ranks))):
            raise TopologyError(f"the nodes must hold each rank 0..{len(ranks) - 1} exactly once, got {self.nodes}")
        if self.nics_per_node < 1:
            raise TopologyError(f"nics_per_node must be >= 1, got {self.nics_per_node}")
        if self.nodes_per_group is not None and not (
                isinstance(self.nodes_per_group, int) and self.nodes_per_group >= 1
                and len(self.nodes) % self.nodes_per_group == 0):
            raise TopologyError(f"nodes_per_group must be a positive divisor of the {len(self.nodes)} nodes, "
                                f"got {self.nodes_per_group!r}")

    @classmethod
    def regular(cls, size: int, ranks_per_node: int, nics_per_node: int = 1,
                nodes_per_group: Optional[int] = None) -> "Topology":
        """Consecutive groups of `ranks_per_node` ranks form the nodes (and consecutive
        `nodes_per_group` nodes the network's groups)."""
        if not (isinstance(ranks_per_node, int) and ranks_per_node >= 1):
            raise TopologyError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if size % ranks_per_node:
            raise TopologyError(f"world size {size} is not divisible by ranks_per_node={ranks_per_node}; "
                                f"expected a divisor of {size}")
        return cls(tuple(tuple(range(n * ranks_per_node, (n + 1) * ranks_per_node))
                         for n in range(size // ranks_per_node)), nics_per_node, nodes_per_group)

    @classmethod
    def machine(cls, name: str, nodes: int) -> "Topology":
        """The topology of `nodes` nodes of a known machine (see MACHINES)."""
        if name not in MACHINES:
            raise TopologyError(f"unknown machine {name!r}; expected one of {tuple(MACHINES)}")
        spec = MACHINES[name]
        return cls.regular(nodes * spec["ranks_per_node"], spec["ranks_per_node"], spec["nics_per_node"])

    @cached_property
    def size(self) -> int:
        return sum(len(node) for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @cached_property
    def is_uniform(self) -> bool:
        return len({len(node) for node in self.nodes}) == 1

    @property
    def ranks_per_node(self) -> int:
        if not self.is_uniform:
            raise TopologyError(f"nodes hold different numbers of ranks: {[len(n) for n in self.nodes]}")
        return len(self.nodes[0])

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {r: (n, l) for n, node in enumerate(self.nodes) for l, r in enumerate(node)}

    def node_of(self, rank: int) -> int:
        return self._where[rank][0]

    def local_of(self, rank: int) -> int:
        return self._where[rank][1]

    @property
    def has_groups(self) -> bool:
        """Whether the network has more than one group (a third level above the node)."""
        return self.nodes_per_group is not None and self.nodes_per_group < self.num_nodes

    def group_of(self, rank: int) -> int:
        """The network group of `rank`'s node (0 without groups)."""
        return self.node_of(rank) // (self.nodes_per_group or self.num_nodes)

    def intra_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks on `rank`'s node, in local order."""
        return self.nodes[self.node_of(rank)]

    def inter_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks with `rank`'s local index on every node, in node order."""
        local = self.local_of(rank)
        return tuple(node[local] for node in self.nodes if local < len(node))

    def level_ranks(self, level: str, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s group on a plan level: "intra", "inter", "group" or "global"."""
        if level == "intra":
            return self.intra_ranks(rank)
        if level == "inter":
            return self.inter_ranks(rank)
        return next(tuple(g) for g in self.level_groups(level) if rank in g)

    def level_groups(self, level: str) -> list[list[int]]:
        """The partition of all ranks into the groups of a plan level, each group in its
        level order: "intra" one group per node, "inter" one per local index, "group" one
        per (network group, local index), "global" one per (node place in its group, local
        index) (uniform topologies)."""
        if level == "intra":
            return [list(node) for node in self.nodes]
        if level == "inter":
            return [[node[local] for node in self.nodes] for local in range(self.ranks_per_node)]
        size = self.nodes_per_group or self.num_nodes
        starts = range(0, self.num_nodes, size)
        if level == "group":
            return [[self.nodes[n][local] for n in range(first, first + size)]
                    for first in starts for local in range(self.ranks_per_node)]
        if level == "global":
            return [[self.nodes[first + place][local] for first in starts]
                    for place in range(size) for local in range(self.ranks_per_node)]
        raise TopologyError(f"unknown level {level!r}; expected intra, inter, group or global")

    def nic_of(self, rank: int) -> int:
        """The NIC a rank's traffic uses: consecutive local ranks share a NIC."""
        local, count = self.local_of(rank), len(self.intra_ranks(rank))
        return local * self.nics_per_node // count if count >= self.nics_per_node else local % self.nics_per_node

    def ranks_per_nic(self) -> int:
        return max(1, -(-self.ranks_per_node // self.nics_per_node))

    def nic_mapping(self) -> str:
        """MPICH_OFI_NIC_MAPPING for one node, e.g. "0:0-1;1:2-3;2:4-5;3:6-7" on Frontier."""
        node = self.nodes[0]
        groups: dict[int, list[int]] = {}
        for local, rank in enumerate(node):
            groups.setdefault(self.nic_of(rank), []).append(local)
        return ";".join(f"{nic}:{locals_[0]}-{locals_[-1]}" if len(locals_) > 1 else f"{nic}:{locals_[0]}"
                        for nic, locals_ in sorted(groups.items()))

    def restrict(self, ranks) -> "Topology":
        """The topology of a sub-group: `ranks` (this topology's ranks) become 0..len-1 in
        the order given; each node keeps the members it has, in that order. A sub-group's
        topology has no network groups (its nodes need not fill them alike)."""
        position = {r: i for i, r in enumerate(ranks)}
        if len(position) != len(ranks) or any(r not in self._where for r in ranks):
            raise TopologyError(f"a sub-group needs distinct ranks of 0..{self.size - 1}, got {list(ranks)}")
        nodes = [sorted(position[r] for r in node if r in position) for node in self.nodes]
        nodes = sorted((n for n in nodes if n), key=lambda n: n[0])
        return Topology(tuple(tuple(n) for n in nodes), self.nics_per_node)

    def describe(self) -> str:
        shape = f"{self.num_nodes}x{self.ranks_per_node}" if self.is_uniform else str([len(n) for n in self.nodes])
        groups = f", groups of {self.nodes_per_group} nodes" if self.has_groups else ""
        return f"Topology({shape} ranks, {self.nics_per_node} NIC(s) per node{groups})"


def from_hosts(hosts: list, nics_per_node: Optional[int]) -> Topology:
    """Ranks that report the same host form a node; nodes ordered by their lowest rank."""
    order = list(dict.fromkeys(hosts))
    nodes = tuple(tuple(r for r, h in enumerate(hosts) if h == host) for host in order)
    return Topology(nodes, nics_per_node or 1)

