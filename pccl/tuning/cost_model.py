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

Compressed (pccl.ir.compressed), a step's messages carry the codec's encodings (the
codec's exact size for the block), and the reduction term becomes the codec's work: the
blocks it encodes at the step's rate of encoding, the blocks it decodes (and reduces) at
the rate of decoding, both from the profile's measured codec speeds, plus the fixed cost of
each codec call (one per block); the end's decodes count in the last step. Encoding is
charged in full, not as overlapping the messages.

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
from typing import Optional, Union

import numpy as np
import torch

from pccl import plans
from pccl.algorithms import schedule
from pccl.compression.codecs import codec as codec_of
from pccl.compression.codecs import per_level
from pccl.core.topology import Topology
from pccl.ir.compressed import compress
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
    codec: Optional[str] = None   # compressed: the codec's name, and what it encodes and decodes
    encode_blocks: Optional[np.ndarray] = None
    decode_blocks: Optional[np.ndarray] = None
    codec_calls: Optional[np.ndarray] = None   # encode and decode calls, one per block

    def inter_loads(self, profile: Profile) -> tuple[np.ndarray, np.ndarray]:
        """(this rank's blocks per NIC it uses, blocks through the busiest such NIC): its own
        NIC, or an even share of all the node's NICs for the native collective of a library
        that stripes (NCCL's and RCCL's channels)."""
        if self.native and profile.native_stripes_nics:
            return self.inter_blocks / self.nics_per_node, self.node_blocks / self.nics_per_node
        return self.inter_blocks, self.nic_blocks

    def seconds(self, profile: Profile, block_bytes: np.ndarray, dtype: torch.dtype = torch.float32) -> np.ndarray:
        """Time of the whole collective for each block size (bytes) in `block_bytes` of
        `dtype` values."""
        m = np.asarray(block_bytes, dtype=np.float64)[:, None, None]
        local = profile.gamma * m * self.reduce_blocks
        wire = m
        if self.codec is not None:
            rate = profile.codec_rate(self.codec.removeprefix("p2p:"))
            wire = m * wire_ratio(self.codec, np.asarray(block_bytes, float), dtype)[:, None, None]
            local = m * (self.encode_blocks / rate.encode + self.decode_blocks / rate.decode) + \
                rate.call * self.codec_calls
        intra = profile.intra.alpha * self.intra_msgs + profile.intra.beta * wire * self.intra_blocks
        own, nic = self.inter_loads(profile)
        inter = profile.inter.alpha * self.inter_msgs + wire * np.maximum(
            profile.inter.stream_beta * own, profile.inter.beta * nic)
        step = np.maximum(intra, inter) + local
        return step.max(axis=1).sum(axis=1)


@lru_cache(maxsize=64)
def _codec(name: str):
    return codec_of(name)


def wire_ratio(name: str, block_bytes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Encoded bytes per byte of values, for blocks of `block_bytes` (the codec's exact size)."""
    c, size = _codec(name), torch.empty((), dtype=dtype).element_size()
    n = np.maximum(np.rint(block_bytes / size), 1).astype(np.int64)
    return np.array([c.encoded_nbytes(int(k), dtype) for k in n], float) / (n * size)


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
                 scale: float, natives: tuple, codec: Optional[str] = None) -> StepCounts:
    """Counts of a flat collective run by every group of `level` at once ("world": one
    group of all ranks; a partition: any equal-sized groups, every rank evaluated, as no
    symmetry is assumed); `scale` converts the group schedule's blocks into caller blocks.
    "native" is opaque: it is counted as the schedule `natives` names for the collective
    (the profile's native algorithms), else as the ring. `codec`: the blocks travel
    compressed with it (collective-level, or per message for a "p2p:" codec)."""
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
        sched = schedule(collective, algorithm, len(members), int(np.flatnonzero(members == r)[0]))
        rows.append((sched.ops, members, sched))
    steps = max((int(ops[:, 0].max()) + 1 if len(ops) else 0) for ops, _, _ in rows)
    shape = (len(ranks), steps)
    count = {key: np.zeros(shape) for key in
             ("intra_send_msgs", "intra_recv_msgs", "intra_sent", "intra_recv",
              "inter_send_msgs", "inter_recv_msgs", "inter_sent", "inter_recv", "reduce", "encode", "decode",
              "calls")}
    for i, (r, (ops, members, sched)) in enumerate(zip(ranks, rows)):
        if not len(ops):
            continue
        if codec is not None:
            plan = compress(sched, codec.startswith("p2p:"))
            coded_work(plan, count["encode"][i], count["decode"][i], scale)
            coded_work(plan, count["calls"][i], count["calls"][i], 1.0)   # one call per block coded
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
        reduce_blocks=count["reduce"], native=native, nics_per_node=topology.nics_per_node,
        codec=codec, encode_blocks=count["encode"], decode_blocks=count["decode"], codec_calls=count["calls"])


def coded_work(plan, encode: np.ndarray, decode: np.ndarray, scale: float) -> None:
    """Add the blocks a compressed schedule encodes and decodes, per step (the end's
    decodes in the last), to `encode` and `decode`."""
    for i, step in enumerate(plan.steps):
        received = [*step.reduces, *(step.keeps if step.unpack else ())]
        encode[i] += len(step.encode) * scale
        decode[i] += (len(step.thaw) + sum(len(t.blocks) for t in received)) * scale
    if plan.steps:
        encode[len(plan.steps) - 1] += len(plan.seal) * scale
        decode[len(plan.steps) - 1] += len({*plan.decode, *plan.settle, *plan.seal}) * scale


@dataclass(frozen=True)
class LocalCost:
    """A plan's local step: `blocks` blocks at copy or reduction bandwidth."""

    blocks: int
    reduces: bool

    def seconds(self, profile: Profile, block_bytes: np.ndarray, dtype: torch.dtype = torch.float32) -> np.ndarray:
        return (profile.gamma if self.reduces else profile.copy_beta) * self.blocks * np.asarray(block_bytes, float)


Part = Union[StepCounts, LocalCost, tuple]   # a tuple: concurrent parts, the slowest counts


def local_cost(step) -> LocalCost:
    if isinstance(step, Permute):
        return LocalCost(sum(1 for j in step.perm if j >= 0), reduces=False)
    if isinstance(step, Fill):
        return LocalCost(step.dst.count, reduces=False)
    return LocalCost(step.dst.count, reduces=True)


def phase_counts(phase: Phase, topology: Topology, natives: tuple, coded: dict) -> StepCounts:
    """A phase is a flat collective on each level group; its buffer of `count` blocks splits
    into one block per group member."""
    full = phase.output if phase.collective == "all_gather" else phase.input
    size = len(topology.level_ranks(phase.level, 0))
    return group_counts(phase.collective, phase.algorithm, topology, phase.level, full.count / size, natives,
                        coded.get(phase.level))


@lru_cache(maxsize=512)
def parts(collective: str, algorithm, topology: Topology, natives: tuple = (), coded: tuple = ()) -> tuple[Part, ...]:
    """The cost parts of `algorithm` ("ring", ..., "native" or a plan spec) on `topology`,
    in blocks of one rank's share of the buffer; `natives` as in group_counts; `coded`:
    ((level, codec name), ...), the levels ("flat", "intra", "inter") that compress."""
    spec, coded = plans.spec_of(algorithm), dict(coded)
    if spec is None:
        return (group_counts(collective, algorithm, topology, "world", 1.0, natives, coded.get("flat")),)
    plan = plans.build(spec, collective, topology, 0)
    out: list[Part] = []
    for step in plan.steps:
        if isinstance(step, Phase):
            out.append(phase_counts(step, topology, natives, coded))
        elif isinstance(step, Concurrent):
            out.append(tuple(phase_counts(p, topology, natives, coded) for p in step.phases))
        elif isinstance(step, (Permute, Fill, Combine)):
            out.append(local_cost(step))
        else:
            raise TypeError(f"unknown plan step {step!r}")
    return tuple(out)


def part_seconds(part: Part, profile: Profile, block_bytes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    if isinstance(part, tuple):
        return np.max([part_seconds(p, profile, block_bytes, dtype) for p in part], axis=0)
    return part.seconds(profile, block_bytes, dtype)


def _sizes(nbytes) -> np.ndarray:
    sizes = np.atleast_1d(np.asarray(nbytes, dtype=np.float64))
    if (sizes < 0).any():
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return sizes


def coded_levels(compression) -> tuple:
    """((level, codec name), ...) of a collective's `compression` argument (as the
    communicator reads it: pccl.compression.codecs.per_level)."""
    return tuple(sorted((level, c.name) for level, c in per_level(compression).items()))


def name_of(algorithm) -> Optional[str]:
    """The name a calibration is kept under: a flat algorithm's, "native", or a named plan's
    (a plan spec with other levels has none)."""
    if isinstance(algorithm, str):
        return algorithm
    return next((name for name, spec in plans.NAMED.items() if spec == algorithm), None)


def _by_native_band(profile: Profile, algorithm, sizes: np.ndarray) -> list[tuple[tuple, np.ndarray]]:
    """[(natives, indices of sizes), ...]: what the native collectives run at each size, for
    algorithms that run them (native itself; a plan's native level phases, which take the
    band of the whole buffer); one group for the rest."""
    if algorithm == "native" or plans.spec_of(algorithm) is not None:
        return profile.native_bands(sizes)
    return [(tuple((c, profile.native_algorithm(c)) for c, _ in profile.native_algorithms), np.arange(len(sizes)))]


def predict(collective: str, algorithm, topology: Topology, profile: Profile, nbytes, compression=None,
            dtype: torch.dtype = torch.float32):
    """Predicted seconds of `collective` with `algorithm` on `topology` for a buffer of
    `nbytes` (the all-gather output, the reduce-scatter input, the all-reduce tensor) of
    `dtype` values; `nbytes` may be a number or an array of them. `compression` as the
    collectives take it (a codec, or one per plan level). Uncompressed, the profile's
    calibration of the algorithm (measured/predicted, Profile.efficiency) scales it."""
    sizes = _sizes(nbytes)
    block_bytes = sizes / topology.size
    total = np.zeros_like(sizes)
    coded = coded_levels(compression)
    for natives, where in _by_native_band(profile, algorithm, sizes):
        for part in parts(collective, algorithm, topology, natives, coded):
            total[where] += part_seconds(part, profile, block_bytes[where], dtype)
    if not coded and profile.calibration:
        total *= profile.efficiency(collective, name_of(algorithm), sizes)
    return total if np.ndim(nbytes) else float(total[0])


def predict_groups(collective: str, algorithm: str, topology: Topology, groups: tuple, profile: Profile, nbytes):
    """Predicted seconds of a flat `collective` (an algorithm name or "native") run at once
    by every group of `groups`, a partition of `topology`'s ranks into equal-sized groups
    (tuples of ranks in group order), each on its own buffer of `nbytes`: the groups share
    the nodes' NICs as they do when a sharded engine's inter-group communicators all run
    together."""
    sizes = _sizes(nbytes)
    total = np.zeros_like(sizes)
    for natives, where in _by_native_band(profile, algorithm, sizes):
        counts = _partition_counts(collective, algorithm, topology, groups, natives)
        total[where] = counts.seconds(profile, sizes[where] / len(groups[0]))
    if profile.calibration:
        total *= profile.efficiency(collective, algorithm, sizes)
    return total if np.ndim(nbytes) else float(total[0])


@lru_cache(maxsize=1024)   # the planner asks for many strategies' partitions of one world
def _partition_counts(collective: str, algorithm: str, topology: Topology, groups: tuple,
                      natives: tuple) -> StepCounts:
    """The counts of a partition, checked once per partition (this is cached)."""
    if sorted(r for g in groups for r in g) != list(range(topology.size)) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"groups must be equal-sized and hold each rank 0..{topology.size - 1} once")
    return group_counts(collective, algorithm, topology, groups, 1.0, natives)
