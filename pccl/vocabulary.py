"""Every name an `algorithm=` argument takes, and what it stands for: the one registry that
the communicator's checks, the tuner's environment overrides, pccl-bench and shard-train's
preflight ask.

    "auto"                          chosen per call (pccl.tuning.selection)
    "native", "native_nonblocking"  the transport's own collective (MPI's nonblocking form,
                                    polled so that it can time out)
    a schedule's name               pccl.algorithms.GENERATORS[collective]
    a plan's name, or a plan spec   pccl.plans.NAMED (the two- and three-level plans, HO-Ring)
"""
from __future__ import annotations

from typing import Optional

from pccl import plans
from pccl.algorithms import GENERATORS, NATIVES

AUTO = "auto"
COLLECTIVES = tuple(GENERATORS)
KINDS = ("auto", "native", "schedule", "plan")


def names(collective: Optional[str] = None, auto: bool = True) -> tuple[str, ...]:
    """The names `collective` takes, or (None) that any collective takes: auto (unless
    auto=False), the natives, the schedules, the plans."""
    if collective is not None and collective not in GENERATORS:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    schedules = GENERATORS[collective] if collective else {n: None for table in GENERATORS.values() for n in table}
    return ((AUTO,) if auto else ()) + NATIVES + tuple(schedules) + tuple(plans.NAMED)


def kind(algorithm) -> Optional[str]:
    """"auto", "native", "schedule" or "plan" (a plan's name or spec); None for anything
    the vocabulary does not hold."""
    if plans.spec_of(algorithm) is not None:
        return "plan"
    if not isinstance(algorithm, str):
        return None
    if algorithm == AUTO:
        return "auto"
    if algorithm in NATIVES:
        return "native"
    return "schedule" if any(algorithm in table for table in GENERATORS.values()) else None


def check(collective: str, algorithm) -> str:
    """`algorithm`'s kind, where it runs `collective`; else a ValueError saying what it takes."""
    found = kind(algorithm)
    if found is None:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {names()}")
    if found == "schedule" and algorithm not in GENERATORS[collective]:
        raise ValueError(f"algorithm {algorithm!r} does not implement {collective}; expected one of "
                         f"{names(collective)}")
    return found


__all__ = ["AUTO", "COLLECTIVES", "KINDS", "names", "kind", "check"]
