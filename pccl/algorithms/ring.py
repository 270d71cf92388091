"""Ring algorithms: p-1 steps, each rank talks to its two neighbours only.

Bandwidth-optimal for every p; latency grows linearly with p (alpha * (p-1)).
"""
from __future__ import annotations

from pccl.ir.schedule import Step, recv, recv_reduce, send


def all_gather(p: int, r: int) -> list[Step]:
    right, left = (r + 1) % p, (r - 1) % p
    return [
        (send(right, [(r - s) % p]), recv(left, [(r - s - 1) % p]))
        for s in range(p - 1)
    ]


def reduce_scatter(p: int, r: int) -> list[Step]:
    # Block (r - s - 1) leaves at step s; after p-1 steps block r has visited every rank.
    right, left = (r + 1) % p, (r - 1) % p
    return [
        (send(right, [(r - s - 1) % p]), recv_reduce(left, [(r - s - 2) % p]))
        for s in range(p - 1)
    ]


def all_reduce(p: int, r: int) -> list[Step]:
    return reduce_scatter(p, r) + all_gather(p, r)
