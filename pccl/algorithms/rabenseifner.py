"""Rabenseifner all-reduce: recursive-halving reduce-scatter, then recursive-doubling
all-gather. Bandwidth-optimal like the ring, 2*log2(p) latency. Other p are folded: the
folded-out ranks give their input away first and get the whole result back at the end.
"""
from __future__ import annotations

from pccl.algorithms.folding import Fold
from pccl.algorithms.recursive_doubling import doubling_steps
from pccl.algorithms.recursive_halving import fold_in, halving_steps
from pccl.ir.schedule import Step, recv, send


def all_reduce(p: int, r: int) -> list[Step]:
    fold = Fold(p)
    if fold.is_folded_out(r):
        return fold_in(fold, r) + [(recv(r + 1, range(p)),)]
    steps = fold_in(fold, r) + halving_steps(fold, r) + doubling_steps(fold, r)
    if r < 2 * fold.rem:
        steps.append((send(r - 1, range(p)),))
    return steps
