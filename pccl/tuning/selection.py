"""algorithm="auto": the algorithm the cost model predicts fastest.

For (collective, buffer bytes, reduction class) on a communicator's topology and machine
profile, every candidate (the flat schedules of the collective, the transport's own
collective "native" and, over MPI, its nonblocking form "native_nonblocking", and, on two
levels, the two-level plans) is predicted with pccl.tuning.cost_model and the fastest is
taken. Native is predicted as the schedule its library's documentation says it
runs at that size (the profile's native bands), and every candidate is scaled by the
profile's calibration where it has one (measured/predicted per size: the fixed cost of a
call, a shared-memory fast path), so auto takes MPI's or NCCL's own collective wherever
that was measured faster. Where they are close, native is kept: a schedule or plan must
be predicted at least 5% faster (GAIN_OVER_NATIVE), about what a calibration's figures
move between runs on a loaded machine (a larger margin gives away what it guards).

Until a measurement exists (trust_native: the profile is the built-in default, which
describes no machine in particular, and has no calibration of the collective and class),
auto trusts the library that is tuned for the machine: the transport's own collective,
unless a two-level plan is predicted to take at most half its time (GAIN_UNMEASURED). The
self-calibration (pccl.tuning.self_calibration) supplies the measurement on MPI
communicators; pccl-bench --calibrate, a full profile.

Decisions are cached per size bucket (four per doubling, each decided at its lower edge),
so the model runs once per bucket, and every rank decides alike from the same profile and
topology.

compression="auto" (choose_compressed) lets the model choose a codec too: each of
AUTO_CODECS that takes the payload and whose speed the profile holds, or none, jointly with
the algorithm, where it is predicted at least 10% faster than the fastest uncompressed
choice (GAIN_FOR_LOSS: a lossy result must clearly pay); never by algorithm="auto" alone.
Compressed, a plan compresses its inter-node level, and HO-Ring's all-gather and
all-reduce are no candidates (plans.compresses_consistently says why).

PCCL_ALGO, or PCCL_<COLLECTIVE>_ALGO (e.g. PCCL_ALL_GATHER_ALGO), forces a choice, as
NCCL_ALGO does for NCCL, and like it is read when the tuner (its communicator) is made: a
flat name, "native", "native_nonblocking", "hierarchical" or "ho_ring". PCCL_ALGO is
ignored for a collective the named algorithm does not implement, and a plan named by
either is ignored where plans cannot run (one node; a sub-communicator whose levels
cannot be built): auto chooses among the flat algorithms there.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache
from typing import Optional

import torch

from pccl import plans, vocabulary
from pccl.algorithms import NATIVES, algorithms_for
from pccl.compression.codecs import codec, per_level
from pccl.core.collectives import COLLECTIVES
from pccl.core.dtypes import reduction_class
from pccl.core.topology import Topology
from pccl.plans import three_level
from pccl.tuning import cost_model
from pccl.tuning.profiles import Profile

BUCKETS_PER_DOUBLING = 4
PLAN_NAMES = tuple(plans.NAMED)
AUTO_CODECS = ("int8", "bf16")   # the native codecs, run inside the C++ executor
GAIN_FOR_LOSS = 0.9   # a lossy codec is chosen only where predicted at most 0.9x the exact time
GAIN_OVER_NATIVE = 0.95  # a schedule or plan is chosen over native only where predicted at most 0.95x its time
GAIN_UNMEASURED = 0.5    # unmeasured (trust_native), a plan is chosen over native only where predicted at most half


def forced(collective: str) -> Optional[str]:
    """The algorithm the environment forces for `collective`, if any."""
    valid = vocabulary.names(collective, auto=False)
    for variable in (f"PCCL_{collective.upper()}_ALGO", "PCCL_ALGO"):
        name = os.environ.get(variable)
        if not name:
            continue
        if name in valid:
            return name
        # PCCL_ALGO may name another collective's schedule: it forces that one only
        if variable != "PCCL_ALGO" or name not in vocabulary.names(auto=False):
            raise ValueError(f"{variable}={name!r} is not an algorithm of {collective}; expected one of {valid}")
    return None


def compresses(algorithm, collective: str, compression="int8") -> bool:
    """Whether `algorithm` (a name or plan spec) can run `collective` compressed as
    `compression` asks (compression_problem)."""
    return not compression_problem(algorithm, collective, compression)


def compression_problem(algorithm, collective: str, compression) -> str:
    """Why `algorithm` (a name or plan spec) cannot run `collective` compressed with
    `compression` (a codec, or one per level as the collectives take it: "flat" for a flat
    schedule, "intra"/"inter" for a plan's levels), or "": the transport's own collective
    has nothing to encode in, nor a plan level whose phases run it; a codec must name a
    level the algorithm has (one codec is the flat schedule's and a plan's inter level's);
    HO-Ring's all-gather and all-reduce would leave ranks with different values
    (plans.compresses_consistently); a three-level plan's network levels are not
    compressed (a codec given for "inter" ran exact there, silently)."""
    if algorithm in NATIVES:
        return f"{algorithm!r} is the transport's own collective, which pccl cannot encode"
    spec = plans.spec_of(algorithm)
    levels = set(per_level(compression))
    if spec is None:
        return "" if "flat" in levels else (f"{algorithm!r} is a flat schedule and the compression names plan levels "
                                            f"only ({sorted(levels)}): give one codec, or name 'flat'")
    if not levels & {"intra", "inter"}:
        return f"{spec!r} is a plan and the compression names none of its levels: name 'intra' or 'inter'"
    if isinstance(spec, plans.ThreeLevel) and "inter" in levels:
        return (f"{spec!r} runs its network phases on two levels of its own (group, global), which pccl does not "
                "compress: compress its node level only ({'intra': codec}), or use 'hierarchical' or a flat schedule")
    if not plans.compresses_consistently(spec, collective):
        return (f"a compressed {collective.replace('_', '-')} cannot run HO-Ring: its concurrent phases move each "
                "block both exactly and encoded, so ranks would end with different values; use 'hierarchical' or a "
                "flat schedule")
    if hasattr(spec, "algorithm_for"):
        parts = ("reduce_scatter", "all_gather") if collective == "all_reduce" else (collective,)
        native = [lv for lv in ("intra", "inter")
                  if lv in levels and any(spec.algorithm_for(lv, part) in NATIVES for part in parts)]
        if native:
            return (f"compression on the {' and '.join(native)} level of {spec!r}, whose phases there run the "
                    "transport's own collective, which pccl cannot encode: give that level a schedule "
                    "(Hierarchical(intra='ring')) or compress another level")
    return ""


def bucket(nbytes: int) -> int:
    return math.floor(BUCKETS_PER_DOUBLING * math.log2(nbytes)) if nbytes > 0 else -1


class Tuner:
    """Chooses algorithms for one topology and profile, caching per size bucket."""

    def __init__(self, topology: Topology, profile: Profile, with_plans: bool = True, natives: tuple = ("native",),
                 trust_native: bool = False):
        """with_plans: whether the two-level plans may be chosen (their level communicators
        can be built); natives: the forms of the transport's own collective that may be
        (NATIVES; the first is the one kept where others are not clearly faster);
        trust_native: the profile describes no machine in particular, so that a collective
        it has no calibration of runs natives[0] (see the module's text)."""
        if not natives or any(n not in NATIVES for n in natives):
            raise ValueError(f"natives must be one or more of {NATIVES}, got {natives!r}")
        self.topology, self.profile, self.with_plans = topology, profile, with_plans
        self.natives, self.trust_native = tuple(natives), trust_native
        self._decisions: dict[tuple, object] = {}
        self._environment = {c: forced(c) for c in COLLECTIVES}   # read once: a bad name fails here

    @property
    def plans_apply(self) -> bool:
        """Whether the two-level plans are candidates: their levels can be built, and the
        topology has several nodes of several ranks each."""
        t = self.topology
        return self.with_plans and t.is_uniform and t.num_nodes > 1 and t.ranks_per_node > 1

    def candidates(self, collective: str) -> tuple:
        """The flat algorithms, native, and the plans that apply (three levels only where
        the network has groups: elsewhere it is the two-level plan)."""
        names = algorithms_for(collective) + self.natives
        if not self.plans_apply:
            return names
        return names + tuple(n for n in PLAN_NAMES if n != "three_level" or three_level.applies(self.topology))

    def fastest_schedule(self, collective: str, nbytes: int, dtype: torch.dtype = torch.float32) -> str:
        """The flat schedule predicted fastest: pccl's own kernels all the way, where the
        transport's collective (or a plan level running it) would apply the library's own
        rules (floating-point max and min: a NaN kept from either side)."""
        return min(algorithms_for(collective), key=lambda name: cost_model.predict(
            collective, name, self.topology, self.profile, nbytes, dtype=dtype))

    def predictions(self, collective: str, nbytes, dtype: torch.dtype = torch.float32) -> dict:
        """Predicted seconds of every candidate, by name, for `nbytes` (a number or an
        array) of `dtype` values."""
        return {name: cost_model.predict(collective, plans.NAMED.get(name, name), self.topology,
                                         self.profile, nbytes, dtype=dtype)
                for name in self.candidates(collective)}

    def _forced(self, collective: str) -> Optional[str]:
        """The environment's forced choice for `collective`, where it can run here."""
        name = self._environment[collective]
        return None if name in PLAN_NAMES and not self.plans_apply else name

    def _decided(self, key: tuple, nbytes, decide):
        """decide(edge) once per `key` and size bucket, at the bucket's lower edge."""
        key = (*key, bucket(nbytes))
        if key not in self._decisions:
            self._decisions[key] = decide(2 ** (key[-1] / BUCKETS_PER_DOUBLING) if nbytes > 0 else 0)
        return self._decisions[key]

    def compressible(self, collective: str, compression="int8") -> tuple:
        """The candidates that run `collective` compressed as `compression` asks, with every
        rank ending alike."""
        return tuple(n for n in self.candidates(collective) if compresses(n, collective, compression))

    def measured(self, collective: str, dtype: torch.dtype = torch.float32) -> bool:
        """Whether the decisions for `collective` of `dtype` rest on a measurement of this
        machine: a calibration of it, or a profile that describes the machine."""
        return not self.trust_native or self.profile.calibrated_for(collective, reduction_class(dtype))

    def name(self, collective: str, nbytes: int, dtype: torch.dtype = torch.float32) -> str:
        """The name (as the API takes it) of what auto runs for `nbytes` of `dtype`: the
        fastest prediction, native unless another is at most GAIN_OVER_NATIVE of its time;
        unmeasured (measured()), native unless a plan is at most GAIN_UNMEASURED of it."""
        def fastest(edge):
            times = self.predictions(collective, edge, dtype)
            native = self.natives[0]
            if not self.measured(collective, dtype):
                times = {n: t for n, t in times.items() if n == native or n in PLAN_NAMES}
                gain = GAIN_UNMEASURED
            else:
                gain = GAIN_OVER_NATIVE
            best = min(times, key=times.get)
            return native if times[best] > gain * times[native] else best
        return self._forced(collective) or self._decided((collective, reduction_class(dtype)), nbytes, fastest)

    def choose(self, collective: str, nbytes: int, dtype: torch.dtype = torch.float32):
        """A flat algorithm's name, a native one, or a plan spec (pccl.Hierarchical, pccl.HORing)."""
        name = self.name(collective, nbytes, dtype)
        return plans.NAMED.get(name, name)

    def compressed_predictions(self, collective: str, nbytes, dtype: torch.dtype, algorithm: str = "auto") -> dict:
        """Predicted seconds of every (codec or None, algorithm name) auto compression may
        run, for `nbytes` of `dtype` values: `algorithm` alone, or auto's candidates."""
        names = self.candidates(collective) if algorithm == "auto" else (algorithm,)
        known = dict(self.profile.codecs)
        codecs = [None] + [c for c in AUTO_CODECS if c in known and dtype in codec(c).dtypes]
        return {(c, name): cost_model.predict(collective, plans.NAMED.get(name, name), self.topology, self.profile,
                                              nbytes, compression=c, dtype=dtype)
                for name in names for c in codecs if c is None or compresses(name, collective, c)}

    def choose_compressed(self, collective: str, nbytes: int, dtype: torch.dtype,
                          algorithm: str = "auto") -> tuple[Optional[str], str]:
        """(codec name or None, algorithm name) that compression="auto" runs for `nbytes`
        of `dtype` values, with `algorithm` ("auto": chosen too; the environment's forcing
        applies as for name())."""
        if algorithm == "auto":
            algorithm = self._forced(collective) or "auto"

        def fastest(edge):
            times = self.compressed_predictions(collective, edge, dtype, algorithm)
            exact = min((k for k in times if k[0] is None), key=times.get)
            best = min(times, key=times.get)
            return best if times[best] <= GAIN_FOR_LOSS * times[exact] else exact
        return self._decided(("compressed", collective, dtype, algorithm), nbytes, fastest)

    def choose_for(self, collective: str, nbytes: int, dtype: torch.dtype, compression) -> str:
        """The algorithm auto runs for a call compressed with `compression` (a codec, or
        one per plan level): the fastest candidate that compresses consistently, predicted
        with the codec (uncompressed where the profile lacks the codec's speed); the
        environment's forcing applies as for name()."""
        name = self._forced(collective)
        if name is not None and compresses(name, collective, compression):
            return name
        candidates = self.compressible(collective, compression)
        if not candidates:
            raise ValueError(f"no algorithm auto weighs for {collective} on {self.topology.describe()} takes "
                             f"compression {compression!r}: a flat schedule takes one codec (or 'flat'), a plan "
                             "'inter', and 'intra' only a plan with a schedule there, named as the algorithm "
                             "(pccl.Hierarchical(intra='ring'))")

        def fastest(edge):
            def predict(n, **coded):
                return cost_model.predict(collective, plans.NAMED.get(n, n), self.topology, self.profile, edge,
                                          **coded)
            try:
                times = {n: predict(n, compression=compression, dtype=dtype) for n in candidates}
            except ValueError:   # no speed for the codec in the profile
                times = {n: predict(n) for n in candidates}
            return min(times, key=times.get)
        return self._decided(("coded", collective, dtype, cost_model.coded_levels(compression)), nbytes, fastest)


def shared_tuner(topology: Topology, profile: Profile, with_plans: bool = True, natives: tuple = ("native",),
                 trust_native: bool = False) -> Tuner:
    """Tuner(...), one per distinct arguments and PCCL_*ALGO settings in a process: each
    decision is made once for every communicator that decides alike (a planner's dry runs
    make one per strategy on one world)."""
    environment = tuple(forced(c) for c in COLLECTIVES)
    return _shared(topology, profile, with_plans, tuple(natives), trust_native, environment)


@lru_cache(maxsize=256)
def _shared(topology: Topology, profile: Profile, with_plans: bool, natives: tuple, trust_native: bool,
            environment: tuple) -> Tuner:
    return Tuner(topology, profile, with_plans, natives, trust_native)

