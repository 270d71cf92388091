"""The cost model: predicted time of a collective, read off the schedule and plan objects
the executors run, so every algorithm is predicted without being described again.

A schedule step costs its slowest rank. A rank's step costs

    max(intra, inter) + gamma * bytes reduced
    intra = alpha_intra * messages + beta_intra * bytes          (to ranks of its node)
    inter = alpha_inter * messages + max(beta_stream * bytes,     (to ranks of other nodes)
                                         beta_nic * bytes through its NIC)

with bytes the larger of what it sends and receives (links are full duplex), and the NIC's
bytes summed over every rank that shares the NIC in that step: that is where a flat ring
(one rank per node crossing nodes) and a two-level plan (every local rank at once) differ.
Steps are aligned by index across ranks: exact for the symmetric algorithms, and for the
folded non-power-of-two worlds the fold's extra steps are charged as whole steps.

A plan costs the sum of its steps: a phase is a flat collective on each level group at
once (all groups of a node in the same step, so they share the node's NICs), concurrent
phases cost the slower one (they use different links), a shuffle costs its bytes at copy
bandwidth, a combine its bytes at reduction bandwidth.

Speed: the per-step message and block counts depend on (collective, algorithm, topology)
only and are cached; sizes are a vector. Only the ranks of a few nodes are evaluated where
the algorithm treats nodes alike: the ring, Bruck and pairwise exchange are the same on
every rank up to a rotation, recursive doubling and halving on a power-of-two group up to an XOR with the
member index, so any node stands for all. Folded (non-power-of-two) groups single out
many members in different ways; there every node is evaluated, which is cheap for their
logarithmic step counts. Tests hold the sample against every node.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Union

import numpy as np

from pccl import plans
from pccl.algorithms import schedule
from pccl.core.topology import Topology
from pccl.ir.plan import Combine, Concurrent, Fill, Permute, Phase
from pccl.ir.schedule import Kind
from pccl.tuning.profiles import Profile

EVALUATE_ALL_NODES = 8   # up to this many nodes, every node is evaluated
ROTATION_SYMMETRIC = ("ring", "bruck", "pairwise")   # rank r+1 runs rank r's schedule shifted by one


@dataclass(frozen=True)
class StepCounts:
    """Per evaluated rank (rows) and step (columns), in units of one block of the collective."""

    intra_msgs: np.ndarray
    intra_blocks: np.ndarray
    inter_msgs: np.ndarray
    inter_blocks: np.ndarray      # this rank's own inter-node blocks (max of sent, received)
    nic_blocks: np.ndarray        # the blocks through this rank's NIC, over all ranks on it
    node_blocks: np.ndarray       # the blocks through all NICs of this rank's node
    reduce_blocks: np.ndarray
    native: bool                  # the transport's own collective (see group_counts)
    nics_per_node: int

    def inter_loads(self, profile: Profile) -> tuple[np.ndarray, np.ndarray]:
        """(this rank's blocks per NIC it uses, blocks through the busiest such NIC): its own
        NIC, or an even share of all the node's NICs for the native collective of a library
        that stripes (NCCL's and RCCL's channels)."""
        if self.native and profile.native_stripes_nics:
            return self.inter_blocks / self.nics_per_node, self.node_blocks / self.nics_per_node
        return self.inter_blocks, self.nic_blocks

    def seconds(self, profile: Profile, block_bytes: np.ndarray) -> np.ndarray:
        """Time of the whole collective for each block size (bytes) in `block_bytes`."""
        m = np.asarray(block_bytes, dtype=np.float64)[:, None, None]
        intra = profile.intra.alpha * self.intra_msgs + profile.intra.beta * m * self.intra_blocks
        own, nic = self.inter_loads(profile)
        inter = profile.inter.alpha * self.inter_msgs + m * np.maximum(
            profile.inter.stream_beta * own, profile.inter.beta * nic)
        step = np.maximum(intra, inter) + profile.gamma * m * self.reduce_blocks
        return step.max(axis=1).sum(axis=1)


def sampled_nodes(topology: Topology) -> tuple[int, ...]:
    """The nodes whose ranks stand for all (see the module docstring)."""
    n = topology.num_nodes
    if n <= EVALUATE_ALL_NODES:
        return tuple(range(n))
    return tuple(sorted({0, 1, n // 2, n - 2, n - 1}))


def evaluated_ranks(topology: Topology, every_node: bool = False) -> tuple[int, ...]:
    nodes = range(topology.num_nodes) if every_node else sampled_nodes(topology)
    return tuple(r for node in nodes for r in topology.nodes[node])


Level = Union[str, tuple]   # "world", "intra", "inter", or a partition: a tuple of groups of ranks


def group_size(topology: Topology, level: Level) -> int:
    if isinstance(level, tuple):
        return len(level[0])
    return {"world": topology.size, "inter": topology.num_nodes}.get(level, len(topology.nodes[0]))


def level_members(topology: Topology, level: Level, rank: int) -> tuple[int, ...]:
    """The ranks of `rank`'s group on `level`, in their group order."""
    if level == "world":
        return tuple(range(topology.size))
    if isinstance(level, tuple):
        return next(g for g in level if rank in g)
    return topology.level_ranks(level, rank)


@lru_cache(maxsize=64)
def places(topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """(node, NIC) of every rank; NICs numbered across the whole machine."""
    node = np.array([topology.node_of(r) for r in range(topology.size)])
    nic = np.array([topology.node_of(r) * topology.nics_per_node + topology.nic_of(r)
                    for r in range(topology.size)])
    return node, nic


def group_counts(collective: str, algorithm: str, topology: Topology, level: Level,
                 scale: float, natives: tuple) -> StepCounts:
    """Counts of a flat collective run by every group of `level` at once ("world": one
    group of all ranks; a partition: any equal-sized groups, every rank evaluated, as no
    symmetry is assumed); `scale` converts the group schedule's blocks into caller blocks.
    "native" is opaque: it is counted as the schedule `natives` names for the collective
    (the profile's native algorithms), else as the ring."""
    native = algorithm == "native"
    if native:
        algorithm = dict(natives).get(collective, "ring")
    size = group_size(topology, level)
    folded = size & (size - 1) and algorithm not in ROTATION_SYMMETRIC
    ranks = evaluated_ranks(topology, every_node=bool(folded) or isinstance(level, tuple))
    node, nic = places(topology)
    rows = []
    for r in ranks:
        members = np.array(level_members(topology, level, r))
        ops = schedule(collective, algorithm, len(members), int(np.flatnonzero(members == r)[0])).ops
        rows.append((ops, members))
    steps = max((int(ops[:, 0].max()) + 1 if len(ops) else 0) for ops, _ in rows)
    shape = (len(ranks), steps)
    count = {key: np.zeros(shape) for key in
             ("intra_send_msgs", "intra_recv_msgs", "intra_sent", "intra_recv",
              "inter_send_msgs", "inter_recv_msgs", "inter_sent", "inter_recv", "reduce")}
    for i, (r, (ops, members)) in enumerate(zip(ranks, rows)):
        if not len(ops):
            continue
        step, kind, blocks = ops[:, 0], ops[:, 1], ops[:, 4] * scale
        crossing = node[members[ops[:, 2]]] != node[r]
        sending = kind == Kind.SEND
        for where, mask in (("intra", ~crossing), ("inter", crossing)):
            for direction, sel in (("send", mask & sending), ("recv", mask & ~sending)):
                count[f"{where}_{direction}_msgs"][i] = np.bincount(step[sel], minlength=steps)
                key = f"{where}_sent" if direction == "send" else f"{where}_recv"
                count[key][i] = np.bincount(step[sel], weights=blocks[sel], minlength=steps)
        reducing = kind == Kind.RECV_REDUCE
        count["reduce"][i] = np.bincount(step[reducing], weights=blocks[reducing], minlength=steps)
    def busiest(owner: np.ndarray) -> np.ndarray:
        """Per rank: max(sent, received) blocks summed over the ranks with its owner."""
        sent, recv = np.zeros((owner.max() + 1, steps)), np.zeros((owner.max() + 1, steps))
        np.add.at(sent, owner, count["inter_sent"])
        np.add.at(recv, owner, count["inter_recv"])
        return np.maximum(sent, recv)[owner]

    return StepCounts(
        intra_msgs=np.maximum(count["intra_send_msgs"], count["intra_recv_msgs"]),
        intra_blocks=np.maximum(count["intra_sent"], count["intra_recv"]),
        inter_msgs=np.maximum(count["inter_send_msgs"], count["inter_recv_msgs"]),
        inter_blocks=np.maximum(count["inter_sent"], count["inter_recv"]),
        nic_blocks=busiest(nic[list(ranks)]),
        node_blocks=busiest(node[list(ranks)]),
        reduce_blocks=count["reduce"], native=native, nics_per_node=topology.nics_per_node)


@dataclass(frozen=True)
class LocalCost:
    """A plan's local step: `blocks` blocks at copy or reduction bandwidth."""

    blocks: int
    reduces: bool

    def seconds(self, profile: Profile, block_bytes: np.ndarray) -> np.ndarray:
        return (profile.gamma if self.reduces else profile.copy_beta) * self.blocks * np.asarray(block_bytes, float)


Part = Union[StepCounts, LocalCost, tuple]   # a tuple: concurrent parts, the slowest counts


def local_cost(step) -> LocalCost:
    if isinstance(step, Permute):
        return LocalCost(sum(1 for j in step.perm if j >= 0), reduces=False)
    if isinstance(step, Fill):
        return LocalCost(step.dst.count, reduces=False)
    return LocalCost(step.dst.count, reduces=True)


def phase_counts(phase: Phase, topology: Topology, natives: tuple) -> StepCounts:
    """A phase is a flat collective on each level group; its buffer of `count` blocks splits
    into one block per group member."""
    full = phase.output if phase.collective == "all_gather" else phase.input
    size = len(topology.level_ranks(phase.level, 0))
    return group_counts(phase.collective, phase.algorithm, topology, phase.level, full.count / size, natives)


@lru_cache(maxsize=512)
def parts(collective: str, algorithm, topology: Topology, natives: tuple = ()) -> tuple[Part, ...]:
    """The cost parts of `algorithm` ("ring", ..., "native" or a plan spec) on `topology`,
    in blocks of one rank's share of the buffer; `natives` as in group_counts."""
    spec = plans.spec_of(algorithm)
    if spec is None:
        return (group_counts(collective, algorithm, topology, "world", 1.0, natives),)
    plan = plans.build(spec, collective, topology, 0)
    out: list[Part] = []
    for step in plan.steps:
        if isinstance(step, Phase):
            out.append(phase_counts(step, topology, natives))
        elif isinstance(step, Concurrent):
            out.append(tuple(phase_counts(p, topology, natives) for p in step.phases))
        elif isinstance(step, (Permute, Fill, Combine)):
            out.append(local_cost(step))
        else:
            raise TypeError(f"unknown plan step {step!r}")
    return tuple(out)


def part_seconds(part: Part, profile: Profile, block_bytes: np.ndarray) -> np.ndarray:
    if isinstance(part, tuple):
        return np.max([part_seconds(p, profile, block_bytes) for p in part], axis=0)
    return part.seconds(profile, block_bytes)


def _sizes(nbytes) -> np.ndarray:
    sizes = np.atleast_1d(np.asarray(nbytes, dtype=np.float64))
    if (sizes < 0).any():
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return sizes


def predict(collective: str, algorithm, topology: Topology, profile: Profile, nbytes):
    """Predicted seconds of `collective` with `algorithm` on `topology` for a buffer of
    `nbytes` (the all-gather output, the reduce-scatter input, the all-reduce tensor);
    `nbytes` may be a number or an array of them."""
    sizes = _sizes(nbytes)
    block_bytes = sizes / topology.size
    total = np.zeros_like(sizes)
    for part in parts(collective, algorithm, topology, profile.native_algorithms):
        total = total + part_seconds(part, profile, block_bytes)
    return total if np.ndim(nbytes) else float(total[0])


def predict_groups(collective: str, algorithm: str, topology: Topology, groups: tuple, profile: Profile, nbytes):
    """Predicted seconds of a flat `collective` (an algorithm name or "native") run at once
    by every group of `groups`, a partition of `topology`'s ranks into equal-sized groups
    (tuples of ranks in group order), each on its own buffer of `nbytes`: the groups share
    the nodes' NICs as they do when a sharded engine's inter-group communicators all run
    together."""
    sizes = _sizes(nbytes)
    counts = _partition_counts(collective, algorithm, topology, groups, profile.native_algorithms)
    total = counts.seconds(profile, sizes / len(groups[0]))
    return total if np.ndim(nbytes) else float(total[0])


@lru_cache(maxsize=64)
def _partition_counts(collective: str, algorithm: str, topology: Topology, groups: tuple,
                      natives: tuple) -> StepCounts:
    """The counts of a partition, checked once per partition (this is cached)."""
    if sorted(r for g in groups for r in g) != list(range(topology.size)) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"groups must be equal-sized and hold each rank 0..{topology.size - 1} once")
    return group_counts(collective, algorithm, topology, groups, 1.0, natives)
