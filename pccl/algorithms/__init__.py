"""The schedule library: one generator per (collective, algorithm), cached per (p, rank)."""
from __future__ import annotations

from functools import lru_cache

from pccl.algorithms import bruck, pairwise, rabenseifner, recursive_doubling, recursive_halving, ring
from pccl.core.collectives import COLLECTIVES
from pccl.ir.schedule import Schedule

GENERATORS = {
    "all_gather": {
        "ring": ring.all_gather,
        "recursive_doubling": recursive_doubling.all_gather,
        "bruck": bruck.all_gather,
    },
    "reduce_scatter": {
        "ring": ring.reduce_scatter,
        "recursive_halving": recursive_halving.reduce_scatter,
        "pairwise": pairwise.reduce_scatter,
    },
    "all_reduce": {
        "ring": ring.all_reduce,
        "recursive_doubling": recursive_doubling.all_reduce,
        "rabenseifner": rabenseifner.all_reduce,
    },
}

# How the schedules of one algorithm's ranks relate (tests hold every claim, rank by rank):
#   rotation  rank i's schedule is rank 0's with every peer and block index shifted by i (mod p)
#   xor       on a power-of-two p, rank 0's with every peer and block index XORed with i
# Algorithms not named here, and xor ones on other p (folded), are not assumed symmetric.
SYMMETRY = {"ring": "rotation", "bruck": "rotation", "pairwise": "rotation",
            "recursive_doubling": "xor", "recursive_halving": "xor", "rabenseifner": "xor"}


def symmetry_of(algorithm: str, size: int) -> str:
    """"rotation", "xor" or "none": what `algorithm`'s schedules on `size` ranks are known to share."""
    kind = SYMMETRY.get(algorithm, "none")
    return "none" if kind == "xor" and size & (size - 1) else kind


# The transport's own collective, and MPI's nonblocking form of it, polled so that it can
# time out (the whole vocabulary of algorithm names: pccl/vocabulary.py).
NATIVES = ("native", "native_nonblocking")


def algorithms_for(collective: str) -> tuple[str, ...]:
    """Schedule algorithms available for a collective."""
    return tuple(GENERATORS[collective])


@lru_cache(maxsize=4096)
def schedule(collective: str, algorithm: str, size: int, rank: int) -> Schedule:
    """The cached schedule of `algorithm` for `collective` on rank `rank` of `size`."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    table = GENERATORS[collective]
    if algorithm not in table:
        raise ValueError(
            f"algorithm {algorithm!r} does not implement {collective}; "
            f"expected one of {tuple(table)}")
    if not (isinstance(size, int) and size >= 1 and 0 <= rank < size):
        raise ValueError(f"need size >= 1 and 0 <= rank < size, got size={size}, rank={rank}")
    steps = tuple(tuple(step) for step in table[algorithm](size, rank))
    return Schedule(collective, algorithm, size, rank, steps)
