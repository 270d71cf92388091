"""Helpers the command-line tools share: size options and sweeps, comma lists, and timing
one call across ranks."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Optional

from mpi4py import MPI

from runkit.args import comma_names
from runkit.sizes import parse_size


def round_size(nbytes: int, ranks: int, element_size: int) -> int:
    """`nbytes` rounded down so the buffer splits into `ranks` equal blocks of whole elements."""
    unit = ranks * element_size
    return nbytes - nbytes % unit


def size_sweep(minbytes: int, maxbytes: int, factor: int, ranks: int, element_size: int) -> list[int]:
    """The buffer sizes to run: minbytes, minbytes*factor, ... up to maxbytes, each rounded
    with `round_size`; sizes that round to 0 and repeats are dropped."""
    if minbytes < 1 or factor < 2:
        raise ValueError(f"a sweep needs minbytes >= 1 and factor >= 2, got {minbytes} and {factor}")
    sizes = []
    nbytes = minbytes
    while nbytes <= maxbytes:
        rounded = round_size(nbytes, ranks, element_size)
        if rounded > 0 and rounded not in sizes:
            sizes.append(rounded)
        nbytes *= factor
    return sizes


def time_per_call(call: Callable[[], None], iters: int, warmup: int, repeats: int, world: MPI.Comm,
                  synchronize: Callable[[], None] = lambda: None) -> float:
    """Seconds per call: the slowest rank's mean over `iters` timed calls, median over
    `repeats` timed loops, after `warmup` calls. `synchronize` waits for a device's queued
    work (GPU buffers: the clock starts once earlier work is done and stops once the loop's
    is, so a loop times the collectives, not only their launch)."""
    return time_calls([call], iters, warmup, repeats, world, synchronize)[0]


def time_calls(calls: list[Callable[[], None]], iters: int, warmup: int, repeats: int, world: MPI.Comm,
               synchronize: Callable[[], None] = lambda: None,
               refill: Optional[Callable[[], None]] = None) -> list[float]:
    """time_per_call of each of `calls`, their repeats taking turns (every call's loop once,
    then every call's again): a burst of other work slows one loop of each, which the median
    drops, instead of every loop of one, so calls compared in one run are timed alike. A
    call's later loops start with one untimed call: switching from another call costs
    something (caches, MPI's state) that a loop of one call does not pay. `refill`, where
    the calls change their own input (an in-place sum grows p-fold a call), restores it
    before each loop, untimed."""
    samples: list[list[float]] = [[] for _ in calls]
    for r in range(repeats):
        for call, mine in zip(calls, samples):
            if refill is not None:
                refill()
            for _ in range(warmup if r == 0 else min(1, len(calls) - 1)):
                call()
            synchronize()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            synchronize()
            mine.append(world.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX))
    return [statistics.median(s) for s in samples]


def size_arg(text: str) -> int:
    """An argparse type: `parse_size`, at least 1 byte (a sweep from 0 never grows), with
    its message shown on bad input."""
    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return size


def comma_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from `choices`."""
    def parse(text: str) -> list[str]:
        names = comma_names(text)
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected a comma list from {', '.join(choices)}, got {text!r}")
        return names
    return parse
