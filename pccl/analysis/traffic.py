"""Bytes one rank sends to each peer in a collective, read off the same schedule and plan
objects the executors run (for the training engine's accounting and the emulated-node
validation of the cost model).

The transport's native collectives are opaque; they are counted as the ring, the
bandwidth-optimal algorithm MPI libraries and NCCL use for large messages.
"""
from __future__ import annotations

from collections import Counter

from pccl import plans
from pccl.algorithms import NATIVES, schedule
from pccl.core.topology import Topology
from pccl.ir.blocks import block_offsets
from pccl.ir.schedule import Kind


def sent(collective: str, algorithm, topology: Topology, rank: int, count: int, itemsize: int) -> Counter:
    """{peer: bytes this rank sends} for `collective` over a buffer of `count` elements
    (the all-gather output, the reduce-scatter input, the all-reduce tensor), with
    `algorithm` resolved: a flat name, "native", or a plan spec."""
    p = topology.size
    if collective != "all_reduce" and count % p:
        raise ValueError(f"{collective} needs a buffer divisible by {p} ranks, got {count} elements")
    spec = plans.spec_of(algorithm)
    if spec is not None:
        return _plan(spec, collective, topology, rank, -(-count // p), itemsize)
    name = "ring" if algorithm in NATIVES else algorithm
    offsets = block_offsets(count, p)
    out: Counter = Counter()
    for step in schedule(collective, name, p, rank).steps:
        for t in step:
            if t.kind == Kind.SEND:
                out[t.peer] += sum(offsets[b + 1] - offsets[b] for b in t.blocks) * itemsize
    return out


def _plan(spec, collective: str, topology: Topology, rank: int, block: int, itemsize: int) -> Counter:
    """Traffic of a two-level plan: each phase is a flat collective on one level."""
    out: Counter = Counter()
    for phase in plans.build(spec, collective, topology, rank).phases():
        members = topology.level_ranks(phase.level, rank)
        full = phase.output if phase.collective == "all_gather" else phase.input
        level = Topology.regular(len(members), len(members))
        for peer, nbytes in sent(phase.collective, phase.algorithm, level, members.index(rank),
                                 full.count * block, itemsize).items():
            out[members[peer]] += nbytes
    return out
