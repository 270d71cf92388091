"""Schedules: a collective algorithm for one rank, written as data.

A schedule works on one buffer of ``size`` blocks (one block is one rank's share).
It is a list of steps; each step is a set of transfers with peers that are all posted
together and completed before the next step begins. Sends read the buffer as it was at
the start of the step; receives land (copy) or are reduced into it when the step ends.

Before the first step and after the last, the buffer means, per collective:

  all_gather      before: block ``rank`` holds this rank's input   after: block i holds rank i's input
  reduce_scatter  before: every block holds this rank's input     after: block ``rank`` holds the reduction
  all_reduce      before: every block holds this rank's input     after: every block holds the reduction

Executors (C++/MPI, mpi4py, torch.distributed), the symbolic verifier and the cost model
all read the same objects, so every algorithm is written exactly once.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np


class Kind(enum.IntEnum):
    """What a transfer does. The values are shared with the C++ executor."""

    SEND = 0
    RECV = 1          # receive and copy into the blocks
    RECV_REDUCE = 2   # receive into scratch, then reduce into the blocks


def runs(blocks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Coalesce sorted block indices into (first block, block count) runs."""
    if blocks and blocks[-1] - blocks[0] == len(blocks) - 1:   # one run (sorted and distinct)
        return ((blocks[0], len(blocks)),)
    out: list[list[int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return tuple((s, c) for s, c in out)


class Transfer(NamedTuple):
    """One transfer with a peer. A named tuple: cheap to make (schedules of 100k-rank rings
    hold a million of these) and immutable; made by send, recv and recv_reduce."""
    kind: Kind
    peer: int
    blocks: tuple[int, ...]   # sorted, distinct block indices

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """Contiguous runs of blocks; each run travels as its own message, in this order."""
        return runs(self.blocks)


def transfer(kind: Kind, peer: int, blocks) -> Transfer:
    b = tuple(sorted(blocks))
    if len(b) > 1 and len(set(b)) != len(b):
        raise ValueError(f"transfer blocks must be distinct, got {b}")
    return Transfer(kind, peer, b)


def send(peer: int, blocks) -> Transfer:
    return transfer(Kind.SEND, peer, blocks)


def recv(peer: int, blocks) -> Transfer:
    return transfer(Kind.RECV, peer, blocks)


def recv_reduce(peer: int, blocks) -> Transfer:
    return transfer(Kind.RECV_REDUCE, peer, blocks)


Step = tuple[Transfer, ...]


@dataclass(frozen=True)
class Schedule:
    collective: str
    algorithm: str
    size: int
    rank: int
    steps: tuple[Step, ...] = field(repr=False)

    @cached_property
    def ops(self) -> np.ndarray:
        """Flat int64 table, one row per message: (step, kind, peer, first block, block count).

        Within a step, receives come before sends so they are posted first. This is the
        form the C++ executor consumes.
        """
        rows = [(i, t.kind, t.peer, first, count)
                for i, step in enumerate(self.steps)
                for receives in (True, False)
                for t in step if (t.kind != Kind.SEND) == receives
                for first, count in runs(t.blocks)]
        return np.asarray(rows, dtype=np.int64).reshape(-1, 5)

    @property
    def num_steps(self) -> int:
        return len(self.steps)
