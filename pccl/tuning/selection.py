"""algorithm="auto": the algorithm the cost model predicts fastest.

For (collective, buffer bytes) on a communicator's topology and machine profile, every
candidate (the flat schedules of the collective and, on two levels, the two-level plans)
is predicted with pccl.tuning.cost_model and the fastest is taken. Decisions are cached per size
bucket (four per doubling, each decided at its lower edge), so the model runs once per
bucket, and every rank decides alike from the same profile and topology.

PCCL_ALGO, or PCCL_<COLLECTIVE>_ALGO (e.g. PCCL_ALL_GATHER_ALGO), forces a choice, as
NCCL_ALGO does for NCCL: a flat name, "native", "hierarchical" or "ho_ring". PCCL_ALGO is
ignored for a collective the named algorithm does not implement, and a plan named by
either is ignored where plans cannot run (one node; a sub-communicator whose levels
cannot be built): auto chooses among the flat algorithms there.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from pccl import plans
from pccl.algorithms import GENERATORS, algorithms_for
from pccl.core.topology import Topology
from pccl.tuning import cost_model
from pccl.tuning.profiles import Profile

BUCKETS_PER_DOUBLING = 4
PLAN_NAMES = tuple(plans.NAMED)


def forced(collective: str) -> Optional[str]:
    """The algorithm the environment forces for `collective`, if any."""
    valid = algorithms_for(collective) + ("native",) + PLAN_NAMES
    for variable in (f"PCCL_{collective.upper()}_ALGO", "PCCL_ALGO"):
        name = os.environ.get(variable)
        if not name:
            continue
        if name in valid:
            return name
        if variable != "PCCL_ALGO" or name not in set(valid).union(*GENERATORS.values()):
            raise ValueError(f"{variable}={name!r} is not an algorithm of {collective}; expected one of {valid}")
    return None


def bucket(nbytes: int) -> int:
    return math.floor(BUCKETS_PER_DOUBLING * math.log2(nbytes)) if nbytes > 0 else -1


class Tuner:
    """Chooses algorithms for one topology and profile, caching per size bucket."""

    def __init__(self, topology: Topology, profile: Profile, with_plans: bool = True):
        """with_plans: whether the two-level plans may be chosen (their level communicators
        can be built)."""
        self.topology, self.profile, self.with_plans = topology, profile, with_plans
        self._decisions: dict[tuple[str, int], str] = {}

    @property
    def plans_apply(self) -> bool:
        """Whether the two-level plans are candidates: their levels can be built, and the
        topology has several nodes of several ranks each."""
        t = self.topology
        return self.with_plans and t.is_uniform and t.num_nodes > 1 and t.ranks_per_node > 1

    def candidates(self, collective: str) -> tuple:
        names = algorithms_for(collective)
        return names + PLAN_NAMES if self.plans_apply else names

    def predictions(self, collective: str, nbytes) -> dict:
        """Predicted seconds of every candidate, by name, for `nbytes` (a number or an array)."""
        return {name: cost_model.predict(collective, plans.NAMED.get(name, name), self.topology,
                                         self.profile, nbytes)
                for name in self.candidates(collective)}

    def name(self, collective: str, nbytes: int) -> str:
        """The name (as the API takes it) of what auto runs for `nbytes`."""
        name = forced(collective)
        if name in PLAN_NAMES and not self.plans_apply:
            name = None
        if name is None:
            key = (collective, bucket(nbytes))
            if key not in self._decisions:
                edge = 2 ** (key[1] / BUCKETS_PER_DOUBLING) if nbytes > 0 else 0
                times = self.predictions(collective, edge)
                self._decisions[key] = min(times, key=times.get)
            name = self._decisions[key]
        return name

    def choose(self, collective: str, nbytes: int):
        """A flat algorithm's name, "native", or a plan spec (pccl.Hierarchical, pccl.HORing)."""
        name = self.name(collective, nbytes)
        return plans.NAMED.get(name, name)
