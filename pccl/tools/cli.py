"""Helpers the command-line tools share: size options and sweeps, comma lists, and timing
one call across ranks."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from mpi4py import MPI

from pccl.util.sizes import parse_size


def round_size(nbytes: int, ranks: int, element_size: int) -> int:
    """`nbytes` rounded down so the buffer splits into `ranks` equal blocks of whole elements."""
    unit = ranks * element_size
    return nbytes - nbytes % unit


def size_sweep(minbytes: int, maxbytes: int, factor: int, ranks: int, element_size: int) -> list[int]:
    """The buffer sizes to run: minbytes, minbytes*factor, ... up to maxbytes, each rounded
    with `round_size`; sizes that round to 0 and repeats are dropped."""
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
    `repeats` timed loops. `synchronize` waits for a device's queued work (GPU buffers:
    the clock starts once earlier work is done and stops once the loop's is, so a loop
    times the collectives, not only their launch)."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        synchronize()
        world.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        synchronize()
        samples.append(world.allreduce((time.perf_counter() - start) / iters, op=MPI.MAX))
    return statistics.median(samples)


def size_arg(text: str) -> int:
    """An argparse type: `parse_size` with its message shown on bad input."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def comma_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from `choices`."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected a comma list from {', '.join(choices)}, got {text!r}")
        return names
    return parse
