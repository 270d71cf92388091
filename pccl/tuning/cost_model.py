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
only and are cached; sizes are a vector. One rank per class of pccl.tuning.symmetry is
evaluated: where a translation of whole nodes maps the groups onto themselves and the
algorithm's schedules onto each other (rotations for the ring, Bruck and pairwise exchange,
XORs for recursive doubling and halving on powers of two), one node's ranks stand for every
node's, and their tables come from member 0's schedule, so a 131072-rank ring costs one
schedule, not 131072. Steps alike on every evaluated rank are kept once with a count (a
ring's p-1 steps are one column). Elsewhere every rank is evaluated (`exact`), the reference
tests hold the classes to.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import numpy as np
import torch

from pccl import plans
from pccl.algorithms import NATIVES, schedule, symmetry_of
from pccl.compression.codecs import codec as codec_of
from pccl.compression.codecs import per_level
from pccl.core.dtypes import reduction_class
from pccl.core.topology import Topology
from pccl.ir.compressed import compress
from pccl.ir.plan import Combine, Concurrent, Fill, Permute, Phase
from pccl.ir.schedule import Kind
from pccl.ir.schedule import runs as runs_of
from pccl.tuning import symmetry
from pccl.tuning.profiles import Profile, for_group
from pccl.tuning.symmetry import Level


@dataclass(frozen=True)
class StepCounts:
    """Per evaluated rank (rows) and distinct step (columns), in units of one block of the
    collective; a step that recurs (the ring's are all alike) is kept once, with the number
    of times it occurs in `repeats`."""

    intra_msgs: np.ndarray
    intra_blocks: np.ndarray
    inter_msgs: np.ndarray        # to other nodes of this rank's network group: (sent, received)
    global_msgs: np.ndarray       # to other network groups: (sent, received)
    inter_blocks: np.ndarray      # this rank's own inter-node blocks (max of sent, received)
    nic_blocks: np.ndarray        # the blocks through this rank's NIC, over all ranks on it
    node_blocks: np.ndarray       # the blocks through all NICs of this rank's node
    group_blocks: np.ndarray      # the blocks between this rank's network group and others, over its ranks
    reduce_blocks: np.ndarray
    native: bool                  # the transport's own collective (see group_counts)
    nics_per_node: int
    nodes_per_group: int          # nodes per network group (all nodes: one group)
    repeats: np.ndarray           # per column: how many steps it stands for
    codec: Optional[str] = None   # compressed: the codec's name, and what it encodes and decodes
    encode_blocks: Optional[np.ndarray] = None
    decode_blocks: Optional[np.ndarray] = None
    codec_calls: Optional[np.ndarray] = None   # encode and decode calls, one per block coded

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
        global_alpha = profile.network.alpha if profile.network else profile.inter.alpha
        latency = (profile.inter.alpha * self.inter_msgs + global_alpha * self.global_msgs).max(axis=0)  # duplex
        inter = latency + wire * np.maximum(
            np.maximum(profile.inter.stream_beta * own, profile.inter.beta * nic),
            profile.group_beta(self.nodes_per_group) * self.group_blocks)
        step = np.maximum(intra, inter) + local
        return step.max(axis=1) @ self.repeats


@lru_cache(maxsize=64)
def _codec(name: str):
    return codec_of(name)


def wire_ratio(name: str, block_bytes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Encoded bytes per byte of values, for blocks of `block_bytes` (the codec's exact size)."""
    c, size = _codec(name), torch.empty((), dtype=dtype).element_size()
    n = np.maximum(np.rint(block_bytes / size), 1).astype(np.int64)
    return np.array([c.encoded_nbytes(int(k), dtype) for k in n], float) / (n * size)


@lru_cache(maxsize=64)
def places(topology: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(node, NIC, network group) of every rank; NICs numbered across the whole machine."""
    node, local = np.empty(topology.size, np.int64), np.empty(topology.size, np.int64)
    width = np.zeros(topology.size, np.int64)
    for n, ranks in enumerate(topology.nodes):
        node[list(ranks)], local[list(ranks)], width[list(ranks)] = n, np.arange(len(ranks)), len(ranks)
    nics = topology.nics_per_node
    nic = np.where(width >= nics, local * nics // width, local % nics)   # as Topology.nic_of
    return node, node * nics + nic, node // (topology.nodes_per_group or topology.num_nodes)


@dataclass(frozen=True, eq=False)
class Transfers:
    """One member's schedule as a table, one row per transfer: its step, kind, peer (member
    index), blocks, messages (contiguous runs) and cyclic runs (a run through the last
    block into block 0 counted once); the cyclic runs a rotation could carry across the
    buffer's end (transfer row, first block, count); and per step, what a codec encodes,
    decodes and how many calls that takes."""

    step: np.ndarray
    kind: np.ndarray
    peer: np.ndarray
    blocks: np.ndarray
    messages: np.ndarray
    cyclic: np.ndarray
    wrap_row: np.ndarray
    wrap_first: np.ndarray
    wrap_count: np.ndarray
    encode: np.ndarray
    decode: np.ndarray
    calls: np.ndarray

    @property
    def num_steps(self) -> int:
        return len(self.encode)

    def rotated_messages(self, size: int, indices: np.ndarray) -> list[np.ndarray]:
        """The messages per transfer of this member rotated to each of `indices`, one array
        per distinct outcome: a run whose rotation crosses the buffer's end splits in two."""
        if not len(self.wrap_row):
            return [self.cyclic]
        start = (size - self.wrap_count + 1 - self.wrap_first) % size   # the indices that carry it across
        splits = (indices[:, None] - start[None, :]) % size < self.wrap_count - 1
        return [self.cyclic + np.bincount(self.wrap_row[pattern], minlength=len(self.cyclic))
                for pattern in np.unique(splits, axis=0)]


@lru_cache(maxsize=4096)
def member_transfers(collective: str, algorithm: str, size: int, index: int, codec: Optional[str]) -> Transfers:
    """The table of member `index`'s schedule on `size` members."""
    sched = schedule.__wrapped__(collective, algorithm, size, index)   # the table is what is kept
    rows, wraps = [], []
    for i, step in enumerate(sched.steps):
        for t in step:
            runs = cyclic = list(runs_of(t.blocks))
            if len(runs) > 1 and runs[0][0] == 0 and sum(runs[-1]) == size:
                cyclic = runs[1:-1] + [(runs[-1][0], runs[-1][1] + runs[0][1])]
            wraps += [(len(rows), f, c) for f, c in cyclic if 1 < c < size]
            rows.append((i, int(t.kind), t.peer, len(t.blocks), len(runs), len(cyclic)))
    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    wrap = np.array(wraps, dtype=np.int64).reshape(-1, 3)
    encode, decode, calls = (np.zeros(sched.num_steps) for _ in range(3))
    if codec is not None:
        plan = compress(sched, codec.startswith("p2p:"))
        coded_work(plan, encode, decode, 1.0)
        coded_work(plan, calls, calls, 1.0)   # one call per block coded
    return Transfers(*table.T, *wrap.T, encode, decode, calls)


# Where a message goes: within the node, to another node of the network group, to another group.
REACHES = ("intra", "inter", "global")
# The rows of one rank's per-step tallies, in the order rank_steps makes them.
TALLIES = tuple(f"{reach}_{direction}_{what}" for reach in REACHES for what in ("msgs", "blocks")
                for direction in ("send", "recv")) + ("reduce", "encode", "decode", "calls")


def rank_steps(t: Transfers, reach: np.ndarray, messages: np.ndarray, scale: float, steps: int) -> np.ndarray:
    """One rank's TALLIES per step, shape (len(TALLIES), steps), from its transfers `t`,
    where each goes (an index of REACHES), and the messages each takes."""
    slot = (reach * 2 + (t.kind != Kind.SEND)) * steps + t.step   # (reach, direction, step)
    shape = (len(REACHES), 1, 2, steps)
    sent = [np.bincount(slot, w, minlength=len(REACHES) * 2 * steps).reshape(shape) for w in (messages, t.blocks)]
    reducing = t.kind == Kind.RECV_REDUCE
    rows = [np.concatenate([sent[0], sent[1] * scale], axis=1).reshape(len(REACHES) * 4, steps),
            np.bincount(t.step[reducing], t.blocks[reducing] * scale, minlength=steps)[None]]
    for coded in (t.encode * scale, t.decode * scale, t.calls):
        rows.append(np.r_[coded, np.zeros(steps - t.num_steps)][None])
    return np.concatenate(rows)


@lru_cache(maxsize=256)
def member_segments(collective: str, algorithm: str, size: int, codec: Optional[str]) -> tuple[Transfers, np.ndarray]:
    """Member 0's table with each run of alike consecutive steps (the same transfers but for
    which blocks, no run a rotation could split) kept once, and each run's length: the
    ring's steps are one, so every rotation of it costs one step's work."""
    t = member_transfers(collective, algorithm, size, 0, codec)
    per_step = np.bincount(t.step, minlength=t.num_steps)
    if t.num_steps < 2 or (per_step != per_step[0]).any():
        return t, np.ones(t.num_steps)
    k = int(per_step[0])
    fields = np.stack([t.kind, t.peer, t.blocks, t.messages, t.cyclic], axis=1).reshape(t.num_steps, -1)
    fields = np.concatenate([fields, np.stack([t.encode, t.decode, t.calls], axis=1)], axis=1)
    changes = np.r_[True, (fields[1:] != fields[:-1]).any(axis=1)]
    wrapped = np.unique(t.step[t.wrap_row])
    changes[wrapped] = True
    changes[np.minimum(wrapped + 1, t.num_steps - 1)] = True
    starts = np.flatnonzero(changes)
    keep = (starts[:, None] * k + np.arange(k)).ravel()   # rows of the steps kept
    remap = np.full(len(t.step), -1)
    remap[keep] = np.arange(len(keep))
    lengths = np.diff(np.r_[starts, t.num_steps]).astype(np.float64)
    return Transfers(np.repeat(np.arange(len(starts)), k), t.kind[keep], t.peer[keep], t.blocks[keep],
                     t.messages[keep], t.cyclic[keep], remap[t.wrap_row], t.wrap_first, t.wrap_count,
                     t.encode[starts], t.decode[starts], t.calls[starts]), lengths


def group_counts(collective: str, algorithm: str, topology: Topology, level: Level,
                 scale: float, natives: tuple, codec: Optional[str] = None, exact: bool = False) -> StepCounts:
    """Counts of a flat collective run by every group of `level` at once ("world": one
    group of all ranks; "intra", "inter"; a partition: any equal-sized groups, tuples of
    ranks in group order), one rank per class of pccl.tuning.symmetry (`exact`: every rank,
    each from its own schedule); `scale` converts the group schedule's blocks into caller
    blocks. "native" (either form, NATIVES) is opaque: it is counted as the schedule `natives` names for the
    collective (the profile's native algorithms; of a pair, by whether the group's size is a power of two),
    else as the ring. `codec`: the blocks travel compressed with it (collective-level, or per message for a
    "p2p:" codec)."""
    native = algorithm in NATIVES
    lay = symmetry.layout(topology, level)
    if native:
        algorithm = for_group(dict(natives).get(collective, "ring"), lay.size)
    size, kind = lay.size, "none" if exact else symmetry_of(algorithm, lay.size)
    cls = symmetry.classes(topology, lay, kind, exact)
    node, nic, group = places(topology)
    if kind != "none":   # every representative's table is member 0's
        first, lengths = member_segments(collective, algorithm, size, codec)
    rows = []   # (evaluated rank, its member's table, peers, messages): several where rotations split runs
    for rank, orbit in zip(cls.ranks, cls.orbits):
        index, members = int(lay.index_of[rank]), lay.groups[lay.group_of[rank]]
        if kind == "rotation":   # member i's schedule is member 0's shifted by i
            peer = members[(first.peer + index) % size]
            rows += [(rank, first, peer, messages) for messages in first.rotated_messages(size, orbit)]
        elif kind == "xor":      # member i's is member 0's XORed with i (its runs alike: tested)
            rows.append((rank, first, members[first.peer ^ index], first.messages))
        else:
            t = member_transfers(collective, algorithm, size, index, codec)
            rows.append((rank, t, members[t.peer], t.messages))
    steps = max(t.num_steps for _, t, _, _ in rows)
    if kind == "none":   # each rank's own table, step by step
        lengths = np.ones(steps)
    # Each row's steps, run-length compressed as they are made (a ring's are all alike),
    # then cut wherever any row's change, so that a column stands for steps alike on all.
    runs = []
    for rank, t, peer, messages in rows:
        reach = np.where(group[peer] != group[rank], 2, (node[peer] != node[rank]).astype(np.int64))
        table = rank_steps(t, reach, messages, scale, steps)
        starts = change_points(table)
        runs.append((starts, table[:, starts]))
    starts = np.unique(np.concatenate([s for s, _ in runs]))
    repeats = np.add.reduceat(lengths, starts) if steps else np.zeros(0)
    count = dict(zip(TALLIES, np.stack([v[:, np.searchsorted(s, starts, "right") - 1] for s, v in runs], axis=1)))

    sent = count["inter_send_blocks"] + count["global_send_blocks"]   # through the NIC
    received = count["inter_recv_blocks"] + count["global_recv_blocks"]

    ranks = np.array([rank for rank, *_ in rows])
    once = np.unique(ranks, return_index=True)[1]   # a rank's rows differ in messages only

    def busiest(owner: np.ndarray, sent: np.ndarray, received: np.ndarray) -> np.ndarray:
        """Per row: max(sent, received) blocks summed over the ranks with its owner (the
        evaluated ranks are whole nodes, and whole groups where the network has them, so an
        owner's ranks are all among them)."""
        ids, owner = np.unique(owner, return_inverse=True)
        out, back = np.zeros((len(ids), len(starts))), np.zeros((len(ids), len(starts)))
        np.add.at(out, owner[once], sent[once])
        np.add.at(back, owner[once], received[once])
        return np.maximum(out, back)[owner]

    return StepCounts(
        intra_msgs=np.maximum(count["intra_send_msgs"], count["intra_recv_msgs"]),
        intra_blocks=np.maximum(count["intra_send_blocks"], count["intra_recv_blocks"]),
        inter_msgs=np.stack([count["inter_send_msgs"], count["inter_recv_msgs"]]),
        global_msgs=np.stack([count["global_send_msgs"], count["global_recv_msgs"]]),
        inter_blocks=np.maximum(sent, received),
        nic_blocks=busiest(nic[ranks], sent, received), node_blocks=busiest(node[ranks], sent, received),
        group_blocks=busiest(group[ranks], count["global_send_blocks"], count["global_recv_blocks"]),
        reduce_blocks=count["reduce"], native=native, nics_per_node=topology.nics_per_node,
        nodes_per_group=topology.nodes_per_group or topology.num_nodes, repeats=repeats, codec=codec,
        encode_blocks=count["encode"], decode_blocks=count["decode"], codec_calls=count["calls"])


def change_points(table: np.ndarray) -> np.ndarray:
    """The columns where a run of equal consecutive columns starts."""
    return np.flatnonzero(np.r_[table.shape[1] > 0, (table[:, 1:] != table[:, :-1]).any(axis=0)])


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


def phase_counts(phase: Phase, topology: Topology, natives: tuple, coded: dict, exact: bool) -> StepCounts:
    """A phase is a flat collective on each level group; its buffer of `count` blocks splits
    into one block per group member."""
    full = phase.output if phase.collective == "all_gather" else phase.input
    size = symmetry.layout(topology, phase.level).size   # group_counts lays the level out too (cached)
    return group_counts(phase.collective, phase.algorithm, topology, phase.level, full.count / size, natives,
                        coded.get(phase.level), exact)


@lru_cache(maxsize=512)
def parts(collective: str, algorithm, topology: Topology, natives: tuple = (), coded: tuple = (),
          exact: bool = False) -> tuple[Part, ...]:
    """The cost parts of `algorithm` ("ring", ..., "native" or a plan spec) on `topology`,
    in blocks of one rank's share of the buffer; `natives` as in group_counts; `coded`:
    ((level, codec name), ...), the levels ("flat", "intra", "inter") that compress; `exact`:
    every rank evaluated (the reference the symmetric classes are tested against)."""
    spec, coded = plans.spec_of(algorithm), dict(coded)
    if spec is None:
        return (group_counts(collective, algorithm, topology, "world", 1.0, natives, coded.get("flat"), exact),)
    plan = plans.build(spec, collective, topology, 0)
    out: list[Part] = []
    for step in plan.steps:
        if isinstance(step, Phase):
            out.append(phase_counts(step, topology, natives, coded, exact))
        elif isinstance(step, Concurrent):
            out.append(tuple(phase_counts(p, topology, natives, coded, exact) for p in step.phases))
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
    if algorithm in NATIVES or plans.spec_of(algorithm) is not None:
        return profile.native_bands(sizes)
    return [(tuple((c, profile.native_algorithm(c)) for c, _ in profile.native_algorithms), np.arange(len(sizes)))]


def predict(collective: str, algorithm, topology: Topology, profile: Profile, nbytes, compression=None,
            dtype: torch.dtype = torch.float32, exact: bool = False):
    """Predicted seconds of `collective` with `algorithm` on `topology` for a buffer of
    `nbytes` (the all-gather output, the reduce-scatter input, the all-reduce tensor) of
    `dtype` values; `nbytes` may be a number or an array of them. `compression` as the
    collectives take it (a codec, or one per plan level). Uncompressed, the profile's
    calibration of the algorithm (measured/predicted, Profile.efficiency) scales it.
    `exact`: every rank evaluated rather than one per class (tests)."""
    sizes = _sizes(nbytes)
    block_bytes = sizes / topology.size
    total = np.zeros_like(sizes)
    coded = coded_levels(compression)
    for natives, where in _by_native_band(profile, algorithm, sizes):
        for part in parts(collective, algorithm, topology, natives, coded, exact):
            total[where] += part_seconds(part, profile, block_bytes[where], dtype)
    if not coded and profile.calibration:
        total *= profile.efficiency(collective, name_of(algorithm), sizes, reduction_class(dtype))
    return total if np.ndim(nbytes) else float(total[0])


def predict_groups(collective: str, algorithm: str, topology: Topology, groups: tuple, profile: Profile, nbytes,
                   exact: bool = False, dtype: torch.dtype = torch.float32):
    """Predicted seconds of a flat `collective` (an algorithm name or "native") run at once
    by every group of `groups`, a partition of `topology`'s ranks into equal-sized groups
    (tuples of ranks in group order), each on its own buffer of `nbytes`: the groups share
    the nodes' NICs as they do when a sharded engine's inter-group communicators all run
    together."""
    sizes = _sizes(nbytes)
    total = np.zeros_like(sizes)
    for natives, where in _by_native_band(profile, algorithm, sizes):
        counts = _partition_counts(collective, algorithm, topology, groups, natives, exact)
        total[where] = counts.seconds(profile, sizes[where] / len(groups[0]), dtype)
    if profile.calibration:
        total *= profile.efficiency(collective, algorithm, sizes, reduction_class(dtype))
    return total if np.ndim(nbytes) else float(total[0])


@lru_cache(maxsize=1024)   # the planner asks for many strategies' partitions of one world
def _partition_counts(collective: str, algorithm: str, topology: Topology, groups: tuple,
                      natives: tuple, exact: bool) -> StepCounts:
    """The counts of a partition, checked once per partition (this is cached)."""
    if sorted(r for g in groups for r in g) != list(range(topology.size)) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"groups must be equal-sized and hold each rank 0..{topology.size - 1} once")
    return group_counts(collective, algorithm, topology, groups, 1.0, natives, exact=exact)


def calibrated(profile: Profile, topology: Topology, measured: dict, where: str) -> Profile:
    """`profile` with the calibration of the collectives `measured` on `topology`:
    {(collective, reduction class, algorithm name): [(bytes, seconds), ...]}; each point
    keeps measured / predicted, the prediction made without a calibration. Entries of
    `profile`'s own calibration that `measured` does not replace are kept.

    A ratio needs two positive, finite times: a point without them (a world of one rank,
    which the model predicts moves nothing in no time; a time that is not one) says nothing
    about the model's error and is left out, and an algorithm left with no point keeps its
    uncalibrated prediction."""
    plain = dataclasses.replace(profile, calibration=())
    calibration = {(c, k, name): points for c, k, name, points in profile.calibration}
    for (collective, klass, name), points in measured.items():
        sizes = np.array([n for n, _ in points], float)
        predicted = predict(collective, plans.NAMED.get(name, name), topology, plain, sizes)
        ratios = tuple((int(n), float(m / p)) for (n, m), p in zip(points, predicted)
                       if 0 < m < math.inf and 0 < p < math.inf)
        if ratios:
            calibration[(collective, klass, name)] = ratios
    sources = {**profile.sources, "calibration": where}
    return dataclasses.replace(profile, calibration=tuple((*key, points) for key, points in calibration.items()),
                               sources=sources)
