"""A communicator that moves no data: one rank of a world of any size, in one process.

It is a Communicator, made by Communicator's own constructor, over a transport that moves
nothing: its collectives check their buffers and choose their algorithm exactly as a real
communicator's do (the same validation, the same selector on the same topology and
profile), then return at once, the transport having recorded what they would have run and
the time the cost model predicts for it. A program built on pccl can so be traced at a scale no machine here
holds: the engine's step-time predictor (shard/planning/predict.py) runs the sharded engine for
GPT-7B on 1024 ranks on the meta device over one of these.

Splits are symmetric: every group of the partition runs each collective at once (as the
engine's group and inter-group communicators do), so a call on a child is predicted with
all its sibling groups sharing the nodes' NICs (cost_model.predict_groups).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional

import torch

from pccl import plans
from pccl.core.topology import Topology
from pccl.runtime import transport_kinds
from pccl.runtime.choice import Choice
from pccl.runtime.communicator import Communicator
from pccl.tuning import cost_model
from pccl.tuning.profiles import Profile

DEVICES = ("cpu", "cuda", "meta")
UNPREDICTED = ("a dry run does not predict {} (the cost model has no broadcast or barrier: they carry a run's "
               "agreements, not its training traffic)")


class RecordingTransport:
    """The transport of rank `rank` of a world shaped as `topology`: no executor, group or
    MPI communicator, no call times out; every call it is given to run is recorded in
    `calls` as (collective, algorithm, bytes, predicted seconds). The profile is given, so
    nothing is agreed (trust_native: decide as a communicator with no profile chosen).
    `kind`: the transport it stands for ("mpi", "gloo", "nccl"), which decides where plans
    can run: a torch.distributed transport's children cannot build plan levels."""

    def __init__(self, topology: Topology, profile: Profile, rank: int = 0, trust_native: bool = False,
                 root: Optional[tuple[Topology, tuple]] = None, kind: str = "mpi"):
        transport_kinds.devices_of(kind)   # a known transport, or ValueError
        self.kind = kind
        self.rank, self.size = rank, topology.size
        self.name = self.backend = self.executor = "dry-run"
        self.timeout = float("inf")
        self.group = self.mpi_comm = None
        self.devices = DEVICES
        self.gpu_codecs = True   # the codecs are refused by runs(): a dry run predicts no compression yet
        self.given = (topology, profile, trust_native)
        self.root = root   # (the world's topology, this transport's partition of it); None: the world itself
        self.calls: list[tuple[str, object, int, float]] = []

    def topology(self, topology, ranks_per_node, nics_per_node) -> Topology:
        return self.given[0]

    def agreed_profile(self, name) -> tuple[Profile, bool]:
        return self.given[1], not self.given[2]

    def plan_devices(self, level_transports: dict[str, str]) -> tuple[str, ...]:
        return DEVICES

    def plans_buildable(self, level_transports: dict[str, str]) -> bool:
        """Its plan levels are never built; auto weighs the plans where the transport it
        stands for could build them: over MPI anywhere, over torch.distributed (gloo, NCCL)
        on the world alone, as Transport.plans_buildable decides (the engine's group and
        inter-group lanes run flat schedules there)."""
        return not transport_kinds.uses_torch(self.kind) or self.root is None

    def levels_made_at_once(self, level_transports: dict[str, str]) -> bool:
        return False   # never made: its plans are predicted, not run

    def only_enqueues(self, device: str, level_transports: dict[str, str]) -> bool:
        return True   # its calls return at once: callers issue them on their own thread

    def predict(self, collective: str, algorithm, nbytes: int, dtype: torch.dtype = torch.float32) -> float:
        """Seconds the cost model predicts for this call (`algorithm` resolved) of `dtype`
        values (a calibrated profile's ratios are per reduction class)."""
        return _predicted(self.given[0], self.root, self.given[1], collective, algorithm, nbytes, dtype)

    def runs(self, choice: Choice, op: str, codecs: dict, plan_executor) -> Callable[..., None]:
        if codecs:
            raise ValueError("a dry run does not predict compressed collectives yet (the engine's trace does not "
                             "carry codecs); pccl-sim and cost_model.predict do")
        if not isinstance(choice.algorithm, str):
            plans.build(choice.algorithm, choice.collective, choice.topology, choice.rank)   # validates the spec
        record = (choice.collective, choice.algorithm, choice.nbytes,
                  self.predict(choice.collective, choice.algorithm, choice.nbytes, choice.dtype))
        return lambda *buffers: self.calls.append(record)

    def broadcasts(self, root: int, form: str):
        raise ValueError(UNPREDICTED.format("broadcast"))

    def barriers(self, form: str):
        raise ValueError(UNPREDICTED.format("barrier"))

    def split(self, groups: list[list[int]], transport: str, barrier=None) -> "RecordingTransport":
        """This rank's group of `groups`, with every other group of the partition assumed
        to run the same collectives at the same time."""
        if transport != self.name:
            transport_kinds.devices_of(transport)   # a known transport, or ValueError
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"a dry run predicts symmetric splits only: groups of one size, got "
                             f"{sorted({len(g) for g in groups})}")
        members = next(g for g in groups if self.rank in g)
        topology, profile, trust_native = self.given
        world, parents = self.root if self.root is not None else (topology, (tuple(range(self.size)),))
        partition = tuple(tuple(parent[i] for i in g) for parent in parents for g in groups)
        return RecordingTransport(topology.restrict(members), profile, members.index(self.rank), trust_native,
                                  (world, partition), self.kind if transport == self.name else transport)

    def close(self, groups: bool = True) -> None:
        pass


class DryRunCommunicator(Communicator):
    """A Communicator over a RecordingTransport (`carrier`: its calls and predictions),
    made by Communicator's constructor; its splits are Communicators over the group's."""

    def __init__(self, topology: Topology, profile: Profile, rank: int = 0, *, trust_native: bool = False,
                 transport: str = "mpi", interruptible: bool = False):
        """Rank `rank` of a world shaped as `topology`, predicting with `profile`;
        trust_native: decide as a communicator with no profile chosen does (Tuner);
        transport: the one it stands for (where plans can run: RecordingTransport);
        interruptible: as Communicator's (over MPI, its own collective is the nonblocking
        one, which shard-train's communicators run)."""
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a pccl.Topology, got {type(topology).__name__}")
        if not isinstance(profile, Profile):
            raise TypeError(f"profile must be a pccl.tuning.profiles.Profile, got {type(profile).__name__}")
        if not (isinstance(rank, int) and 0 <= rank < topology.size):
            raise ValueError(f"rank must be in 0..{topology.size - 1}, got {rank!r}")
        super().__init__(RecordingTransport(topology, profile, rank, trust_native, kind=transport),
                         interruptible=interruptible)

    def __repr__(self) -> str:
        return f"DryRunCommunicator(rank={self.rank}, size={self.size}, {self.topology.describe()})"


@lru_cache(maxsize=1 << 16)
def _predicted(topology: Topology, root, profile: Profile, collective: str, algorithm, nbytes: int,
               dtype: torch.dtype) -> float:
    world, partition = root if root is not None else (topology, ((),))
    if len(partition) == 1 or plans.spec_of(algorithm) is not None:
        # alone on the machine (a plan inside a group: the group's own topology)
        return cost_model.predict(collective, algorithm, topology, profile, nbytes, dtype=dtype)
    return cost_model.predict_groups(collective, algorithm, world, partition, profile, nbytes, dtype=dtype)
