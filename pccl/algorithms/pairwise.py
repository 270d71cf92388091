"""Pairwise-exchange reduce-scatter: p-1 steps; at step s a rank sends block r+s straight
to its owner and reduces the block r+s sends it (Thakur, Rabenseifner and Gropp 2005).

Every block travels once, directly, so the bandwidth term is the ring's; it is MPICH's
reduce-scatter for long messages, which the cost model uses for MPI's native one. Peers
change every step (not neighbours), so on nodes it crosses nodes more than the ring.
"""
from __future__ import annotations

from pccl.ir.schedule import Step, recv_reduce, send


def reduce_scatter(p: int, r: int) -> list[Step]:
    return [
        (send((r + s) % p, [(r + s) % p]), recv_reduce((r - s) % p, [r]))
        for s in range(1, p)
    ]
