"""algorithm="auto": a simple message-size rule until the cost-model tuner replaces it.

Small messages are latency-bound: pick the logarithmic algorithms. Large messages are
bandwidth-bound: the ring moves the minimum data with the fewest, simplest steps.
Thresholds are on the full buffer (all-gather output, reduce-scatter input).
"""
from __future__ import annotations

import os

from .algorithms import algorithms_for

LATENCY_BOUND_BYTES = 1 << 20        # all-gather, reduce-scatter
ALL_REDUCE_DOUBLING_BYTES = 64 << 10  # whole-buffer exchanges only pay off when tiny
ALL_REDUCE_RING_BYTES = 16 << 20


def choose(collective: str, nbytes: int, size: int) -> str:
    forced = os.environ.get(f"PCCL_{collective.upper()}_ALGO") or os.environ.get("PCCL_ALGO")
    if forced and forced in algorithms_for(collective) + ("native",):
        return forced
    pow2 = size & (size - 1) == 0
    if collective == "all_gather":
        if nbytes >= LATENCY_BOUND_BYTES:
            return "ring"
        return "recursive_doubling" if pow2 else "bruck"
    if collective == "reduce_scatter":
        return "ring" if nbytes >= LATENCY_BOUND_BYTES else "recursive_halving"
    if nbytes < ALL_REDUCE_DOUBLING_BYTES:
        return "recursive_doubling"
    return "ring" if nbytes >= ALL_REDUCE_RING_BYTES else "rabenseifner"
