"""Recursive halving reduce-scatter: log2(p) exchanges at distance p/2, p/4, ..., 1.

At each step a rank keeps the half of its current block range that contains its own
blocks, sends the other half to its partner and reduces the half it receives.
Bandwidth term as the ring's, latency log2(p). Other p are folded (see folding.py).
"""
from __future__ import annotations

from pccl.algorithms.folding import Fold
from pccl.ir.schedule import Step, recv, recv_reduce, send


def halving_steps(fold: Fold, r: int) -> list[Step]:
    """Exchanges among virtual ranks; virtual rank v ends with its blocks fully reduced."""
    v = fold.virtual(r)
    steps = []
    d = fold.pow2 // 2
    while d >= 1:
        w = v ^ d
        mine, theirs = v & ~(d - 1), w & ~(d - 1)
        steps.append((
            send(fold.real(w), fold.blocks(theirs, theirs + d)),
            recv_reduce(fold.real(w), fold.blocks(mine, mine + d)),
        ))
        d //= 2
    return steps


def fold_in(fold: Fold, r: int) -> list[Step]:
    """Folded-out ranks hand their whole input to their partner, which reduces it."""
    if fold.is_folded_out(r):
        return [(send(r + 1, range(fold.size)),)]
    if r < 2 * fold.rem:
        return [(recv_reduce(r - 1, range(fold.size)),)]
    return []


def reduce_scatter(p: int, r: int) -> list[Step]:
    fold = Fold(p)
    if fold.is_folded_out(r):
        return fold_in(fold, r) + [(recv(r + 1, [r]),)]
    steps = fold_in(fold, r) + halving_steps(fold, r)
    if r < 2 * fold.rem:
        steps.append((send(r - 1, [r - 1]),))
    return steps
