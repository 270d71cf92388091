"""Bruck all-gather: ceil(log2 p) steps for any p, no folding.

After the step with distance d a rank holds the d blocks that follow its own (mod p);
it sends them to rank r-d and receives the next ones from rank r+d. Blocks are indexed by
their origin, so data lands in its final place and no final rotation is needed; a range
that wraps around the end travels as two messages.
"""
from __future__ import annotations

from pccl.ir.schedule import Step, recv, send


def all_gather(p: int, r: int) -> list[Step]:
    steps = []
    d = 1
    while d < p:
        count = min(d, p - d)
        steps.append((
            send((r - d) % p, [(r + i) % p for i in range(count)]),
            recv((r + d) % p, [(r + d + i) % p for i in range(count)]),
        ))
        d *= 2
    return steps
