"""Recursive doubling: log2(p) exchanges with partners at distance 1, 2, 4, ...

All-gather: the data held doubles at every step. All-reduce: the whole buffer is
exchanged and reduced at every step (latency-optimal, not bandwidth-optimal). Worlds
that are not powers of two are folded (see folding.py): two extra steps.
"""
from __future__ import annotations

from pccl.algorithms.folding import Fold
from pccl.ir.schedule import Step, recv, recv_reduce, send


def doubling_steps(fold: Fold, r: int) -> list[Step]:
    """The all-gather exchanges among virtual ranks; virtual rank v starts with its own blocks."""
    v = fold.virtual(r)
    steps = []
    d = 1
    while d < fold.pow2:
        w = v ^ d
        mine, theirs = v & ~(d - 1), w & ~(d - 1)
        steps.append((
            send(fold.real(w), fold.blocks(mine, mine + d)),
            recv(fold.real(w), fold.blocks(theirs, theirs + d)),
        ))
        d *= 2
    return steps


def all_gather(p: int, r: int) -> list[Step]:
    fold = Fold(p)
    if fold.is_folded_out(r):
        return [(send(r + 1, [r]),), (recv(r + 1, [b for b in range(p) if b != r]),)]
    if r < 2 * fold.rem:
        return ([(recv(r - 1, [r - 1]),)] + doubling_steps(fold, r)
                + [(send(r - 1, [b for b in range(p) if b != r - 1]),)])
    return doubling_steps(fold, r)


def all_reduce(p: int, r: int) -> list[Step]:
    fold = Fold(p)
    every = range(p)
    if fold.is_folded_out(r):
        return [(send(r + 1, every),), (recv(r + 1, every),)]
    steps = [(recv_reduce(r - 1, every),)] if r < 2 * fold.rem else []
    v = fold.virtual(r)
    d = 1
    while d < fold.pow2:
        w = fold.real(v ^ d)
        steps.append((send(w, every), recv_reduce(w, every)))
        d *= 2
    if r < 2 * fold.rem:
        steps.append((send(r - 1, every),))
    return steps
