"""Plans: collectives composed of phases on sub-communicators, written as data.

A plan is for one rank of a two-level topology (N nodes x L ranks per node). Its steps are:

  Phase       a collective on one level: "intra" (the ranks of this node) or "inter"
              (the ranks with this local index on every node), with a flat algorithm
              from the schedule library or the level transport's "native" collective
  Concurrent  phases on different levels that run at the same time (HO-Ring)
  Permute     the local shuffle, one pass: block i of src lands at block perm[i] of dst
  Fill        set blocks to the identity of the reduction (0 for sum, -inf for max, ...)
  Combine     dst = op(dst, src), element-wise

Buffers are named ("input", "output" or a workspace declared by the plan) and sliced in
blocks of the plan's block size m (one rank's share: the all-gather input, the
reduce-scatter output), so a plan depends only on (algorithm, N, L, rank) and is cached.
The plan executor runs these objects; the cost model evaluates the same objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Ref:
    """Blocks [start, start + count) of a named buffer."""

    buffer: str
    start: int
    count: int


@dataclass(frozen=True)
class Phase:
    collective: str    # all_gather | reduce_scatter
    level: str         # intra | inter
    algorithm: str     # a flat algorithm of pccl.algorithms, or "native"
    output: Ref
    input: Ref


@dataclass(frozen=True)
class Concurrent:
    phases: tuple[Phase, ...]


@dataclass(frozen=True)
class Permute:
    src: Ref
    dst: Ref
    perm: tuple[int, ...]   # dst block (within dst) of each src block


@dataclass(frozen=True)
class Fill:
    dst: Ref


@dataclass(frozen=True)
class Combine:
    dst: Ref
    src: Ref


Step = Union[Phase, Concurrent, Permute, Fill, Combine]


@dataclass(frozen=True)
class Plan:
    collective: str
    name: str
    nodes: int                 # N
    local: int                 # L, ranks per node
    rank: int                  # global rank (node-major: node * L + local index)
    steps: tuple[Step, ...]
    workspaces: tuple[tuple[str, int], ...] = field(default=())   # (name, blocks)

    def phases(self):
        """Every Phase, in order (those of a Concurrent step together)."""
        for step in self.steps:
            if isinstance(step, Phase):
                yield step
            elif isinstance(step, Concurrent):
                yield from step.phases
