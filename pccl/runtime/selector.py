"""The selector: what a communicator's calls run, decided in one place.

It holds what decisions rest on (the topology, the profile each device type's buffers are
decided with, the plan levels' transports) and turns a call, (collective, algorithm,
buffer, compression), into a typed Choice (pccl/runtime/choice.py): a flat schedule, the
transport's own collective, or a plan. "auto" is resolved here and nowhere else: by the
tuner of the buffers' device, after the self-calibration (pccl/tuning/self_calibration.py)
measured this communicator's shape where it measures itself. The self-calibration times
candidates through the communicator (its bench) and publishes its figures here
(use_profile).
"""
from __future__ import annotations

from typing import Optional

import torch

from pccl import plans, vocabulary
from pccl.algorithms import NATIVES
from pccl.compression.codecs import per_level
from pccl.core.topology import Topology
from pccl.runtime import transport_kinds
from pccl.runtime.choice import Choice
from pccl.tuning.profiles import Profile
from pccl.tuning.selection import Tuner, compression_problem, forced, shared_tuner
from pccl.tuning.self_calibration import DEVICES as MEASURED
from pccl.tuning.self_calibration import SelfCalibration, enabled, measures


def refuse_compression(algorithm, collective: str, compression) -> None:
    """ValueError where `algorithm` cannot run `collective` as `compression` asks (a codec
    silently dropped ran the call exact; selection.compression_problem)."""
    problem = compression_problem(algorithm, collective, compression) if compression else ""
    if problem:
        raise ValueError(problem)


def uncompressed(compression) -> bool:
    """Whether a call's compression argument leaves it to the communicator's default
    (None) or names none (with PCCL_COMPRESSION set the two differ: the default codec, and
    exact)."""
    return compression is None or (isinstance(compression, str) and compression == "none")


class Selector:
    def __init__(self, topology: Topology, profile: Profile, level_transports: dict[str, str], carrier,
                 interruptible: bool = False, trust_native: bool = False):
        """For rank carrier.rank of `topology` over the transport `carrier` (pccl's
        Transport, or a dry run's), whose plans' levels ride `level_transports`;
        interruptible, trust_native: as Communicator and Tuner take them."""
        self.topology, self.rank = topology, carrier.rank
        self.level_transports = level_transports
        self.plan_devices = carrier.plan_devices(level_transports)   # the buffers both levels carry
        self.transport = carrier.name   # "mpi", "torch", "dry-run"
        self.kind = getattr(carrier, "kind", carrier.name)   # a dry run's: the transport it stands for
        # torch.distributed level groups can only be made from a communicator over all ranks
        self.plans_buildable = carrier.plans_buildable(level_transports)
        self.interruptible = interruptible
        self.trust_native = trust_native
        self.version = 0   # grows whenever decisions may change: calls resolved before are stale
        self.self_calibration: Optional[SelfCalibration] = None   # where it measures (measures()): host buffers'
        self._device_calibrations: dict[str, SelfCalibration] = {}   # and each GPU type's, at first need
        self._bench = None
        self.use_profile(profile)

    def calibrate_with(self, bench) -> None:
        """Measure through `bench` (the communicator: it times candidates and agrees on
        figures) where it measures itself: no profile chosen, two ranks or more over MPI or
        gloo (self_calibration.measures). PCCL_SELF_CALIBRATION is checked here, where it
        measures or not: a bad value on one rank, which measures nothing, was accepted."""
        self._bench = bench
        enabled()
        if self.trust_native and measures(bench):
            self.self_calibration = SelfCalibration(bench, self)

    def use_profile(self, profile: Profile, device: Optional[str] = None) -> None:
        """Decide auto's choices with `profile` from now on (every rank alike): for the
        buffers of every device, or of `device` only ("cpu": host buffers; the
        self-calibration measures each device type apart). `profile`, `tuner`: the host
        buffers'; `given_profile`: what devices without a profile of their own decide with."""
        self.version += 1
        natives = NATIVES if self.kind == "mpi" and not self.interruptible else (self.own_native,)
        tuners = (shared_tuner(self.topology, profile, self.plans_buildable, natives, self.trust_native),
                  shared_tuner(self.topology, profile, False, natives, self.trust_native))   # where plans cannot run
        if device is None:
            self.given_profile, self._given_tuners, self._device_tuners = profile, tuners, {}
        if device in (None, "cpu"):
            self.profile = profile
            self.tuner, self._flat_tuner = tuners
        else:
            self._device_tuners[device] = tuners

    @property
    def own_native(self) -> str:
        """The transport's own collective as this communicator runs it where nobody named a
        form (auto, a plan's "native" phases): MPI's nonblocking one on an interruptible MPI
        communicator, which times out like a schedule, else "native"."""
        return "native_nonblocking" if self.kind == "mpi" and self.interruptible else "native"

    def native_form(self, collective: str, algorithm) -> str:
        """The native form a broadcast or barrier runs: "auto" is the communicator's own
        (own_native), "native" the blocking call, "native_nonblocking" MPI's polled one."""
        forms = ("auto",) + (NATIVES if self.kind == "mpi" else ("native",))
        if not isinstance(algorithm, str) or algorithm not in forms:
            raise ValueError(f"algorithm {algorithm!r} does not implement {collective} over {self.transport}; "
                             f"expected one of {forms} (the transport's own {collective})")
        return self.own_native if algorithm == "auto" else algorithm

    def tuner_for(self, device: str) -> Tuner:
        """The tuner for `device` tensors, with the plans where they can carry them: the
        host's, a GPU type's own where it has a profile of its own (its self-calibration),
        else the profile the communicator was given."""
        if device == "cpu":
            tuners = (self.tuner, self._flat_tuner)
        else:
            tuners = self._device_tuners.get(device, self._given_tuners)
        return tuners[0] if device in self.plan_devices else tuners[1]

    def calibration_for(self, device: str) -> SelfCalibration:
        """The self-calibration of `device` buffers ("cpu" or "cuda"), where this
        communicator measures itself (self_calibration is not None)."""
        if device == "cpu":
            return self.self_calibration
        if device not in self._device_calibrations:
            self._device_calibrations[device] = SelfCalibration(self._bench, self, device)
        return self._device_calibrations[device]

    def resolve(self, collective: str, algorithm, nbytes: int, device: str = "cpu", compression=None,
                dtype: torch.dtype = torch.float32, op: Optional[str] = None):
        """What `algorithm` runs for `nbytes` (the full buffer) of `device` tensors: a flat
        algorithm's name, a native one, or a plan spec; "auto" resolved as a call would resolve
        it, among what can take the device (it never communicates: a self-calibration is
        measured at a collective's first call, not here). A plan whose levels cannot carry the device is
        refused before anything is sent. `compression` (a codec, or one per plan level, as
        the collectives take it; `dtype` the payload's): auto takes the fastest candidate
        predicted with it (Tuner.choose_for), and HO-Ring's all-gather and all-reduce, whose
        concurrent phases move a block both exactly and encoded so that ranks would end with
        different values, are refused (plans.compresses_consistently). For floating-point
        max and min (`op`), auto takes the fastest flat schedule: the transport's own
        collective, or a plan level running it, need not keep a NaN (gloo's and MPI's
        do not), where pccl's kernels keep it from either side."""
        spec = plans.spec_of(algorithm)
        if spec is None:
            vocabulary.check(collective, algorithm)
            if algorithm == "native_nonblocking" and self.kind != "mpi":
                raise ValueError(f"'native_nonblocking' is MPI's nonblocking collective; transport "
                                 f"{self.kind!r} has none: use 'native'")
            if algorithm != "auto":
                refuse_compression(algorithm, collective, compression)
                return algorithm
            tuner = self.tuner_for(device)
            name = tuner.choose_for(collective, nbytes, dtype, compression) if compression else \
                tuner.name(collective, nbytes, dtype)
            if op in ("max", "min") and dtype.is_floating_point and (name in NATIVES or name in plans.NAMED) \
                    and not compression and forced(collective) is None:   # PCCL_ALGO: as the user forced it
                name = tuner.fastest_schedule(collective, nbytes, dtype)
            spec = plans.NAMED.get(name, name)
            if isinstance(spec, str):
                return spec
        if not self.plans_buildable:   # said when called, not at an async call's wait()
            levels = "/".join(sorted(set(self.level_transports.values())))
            raise ValueError(f"{spec!r} cannot run here: plan levels over {levels} are torch.distributed groups, "
                             "which only a communicator over all ranks can make; run the plan on the world's "
                             "communicator, or a flat algorithm here")
        # refused here, before a plan's other levels have moved anything
        refuse_compression(spec, collective, compression)
        self._check_level_algorithms(spec, collective)
        transport_kinds.check_level_devices(device, self.level_transports, self.plan_devices)
        return spec

    def _check_level_algorithms(self, spec, collective: str) -> None:
        """MPI's nonblocking collective named for a plan level that rides another transport
        (gloo, NCCL): refused before the plan starts (the level would refuse it only when
        its phase ran, after the other level had moved data)."""
        if not hasattr(spec, "algorithm_for"):
            return
        parts = ("reduce_scatter", "all_gather") if collective == "all_reduce" else (collective,)
        for level in ("intra", "inter"):
            transport = self.level_transports.get(level, self.transport)
            transport = self.kind if transport == "dry-run" else transport
            if transport != "mpi" and any(spec.algorithm_for(level, part) == "native_nonblocking" for part in parts):
                raise ValueError(f"{spec!r}: its {level} level runs 'native_nonblocking', MPI's nonblocking "
                                 f"collective, but that level rides {transport!r}, which has none: use 'native'")

    def measure_auto(self, collective: str, algorithm, dtype: torch.dtype, device: str = "cpu",
                     compression=None, nbytes: int = 0) -> None:
        """Before resolving `algorithm` for `collective` of `dtype` on `device` tensors
        (`compression` as resolve takes it): where that is an uncompressed auto, make sure
        its choice rests on a measurement, where this communicator measures itself (the
        self-calibration: no profile chosen, two ranks or more over MPI or gloo; host and
        GPU buffers apart), one reaching a call of `nbytes` (the full buffer) beyond the
        sizes swept; a no-op elsewhere and once measured. A call does this itself; a
        caller that resolves first (resolve never communicates) calls it before. Collective:
        every rank at the same point of its sequence of calls."""
        if algorithm == "auto" and not compression and self.self_calibration is not None and device in MEASURED:
            self.calibration_for(device).ensure(collective, dtype, nbytes)

    def choose(self, collective: str, algorithm, like: torch.Tensor, codecs=None, op: Optional[str] = None) -> Choice:
        """What a call of `collective` on the full buffer `like` runs, decided once: auto
        measured where this is its first call at that size (collective, as the call itself
        would be), then resolved; `codecs`: the call's ({level: codec}, or one codec), or
        None; `op` the reduction's."""
        nbytes = like.numel() * like.element_size()
        self.measure_auto(collective, algorithm, like.dtype, like.device.type, codecs, nbytes)
        resolved = self.resolve(collective, algorithm, nbytes, like.device.type, codecs, like.dtype, op)
        codec = codecs.get("flat") if isinstance(codecs, dict) else codecs
        return Choice(collective, resolved, like.numel(), like.dtype, self.topology, self.rank, codec)

    def codecs(self, compression, like: torch.Tensor, collective: str, algorithm,
               default=None, gpu_codecs: bool = False, exact: bool = False) -> tuple[dict, object]:
        """({level: codec}, algorithm) of a call: one codec for a flat schedule ("flat") and,
        in a plan, for the inter-node level only unless a dict names the levels ({"intra":
        ..., "inter": ...}); None takes `default` (the communicator's, PCCL_COMPRESSION as
        it was when it was made), which compresses only payloads its codec takes, else none.
        "auto": the codec (or none) and, with algorithm="auto", the algorithm the cost model
        predicts fastest (Tuner.choose_compressed; none on GPU tensors, nor where `exact`:
        max and min). gpu_codecs: whether the transport runs the native codecs on GPU
        buffers. Checked before anything is sent."""
        given = compression is not None
        if not given:
            compression = default
        if uncompressed(compression):   # the common case, without per_level's work
            return {}, algorithm
        if isinstance(compression, str) and compression.strip().lower() == "auto":
            if like.device.type != "cpu" or exact:
                return {}, algorithm
            spec = plans.spec_of(algorithm)
            if spec is None:
                vocabulary.check(collective, algorithm)
            compression, algorithm = self.tuner_for(like.device.type).choose_compressed(
                collective, like.numel() * like.element_size(), like.dtype, algorithm if spec is None else spec)
        codecs = per_level(compression)
        if not given and not all(like.dtype in c.dtypes for c in codecs.values()):
            return {}, algorithm   # the default compresses what it can take: not an integer counter
        for c in codecs.values():
            c.check(like.dtype)
            if like.device.type != "cpu" and (c.native is None or not gpu_codecs):
                raise ValueError(f"compression of {like.device.type} tensors runs the native codecs (int8, bf16, fp16) "
                                 f"over the torch transport (NCCL, RCCL), got {c.name} over {self.transport}")
        return codecs, algorithm
