"""A communicator that moves no data: one rank of a world of any size, in one process.

Its collectives check their buffers and resolve their algorithm exactly as a real
communicator's do (the same validation, the same tuner on the same topology and profile),
then return at once, having recorded what they would have run and the time the cost model
predicts for it. A program built on pccl can so be traced at a scale no machine here
holds: the engine's step-time predictor (shard/planning/predict.py) runs the sharded engine for
GPT-7B on 1024 ranks on the meta device over one of these.

Splits are symmetric: every group of the partition runs each collective at once (as the
engine's group and inter-group communicators do), so a call on a child is predicted with
all its sibling groups sharing the nodes' NICs (cost_model.predict_groups).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from pccl import plans
from pccl.core.dtypes import op_code, reduction_class
from pccl.core.topology import Topology
from pccl.runtime import validation
from pccl.runtime.communicator import Communicator
from pccl.tuning import cost_model
from pccl.tuning.profiles import Profile

DEVICES = ("cpu", "cuda", "meta")
UNPREDICTED = ("a dry run does not predict {} (the cost model has no broadcast or barrier: they carry a run's "
               "agreements, not its training traffic)")


class DryRunCommunicator(Communicator):
    def __init__(self, topology: Topology, profile: Profile, rank: int = 0, *, trust_native: bool = False,
                 _root: Optional[tuple[Topology, tuple]] = None):
        """Rank `rank` of a world shaped as `topology`, predicting with `profile`;
        trust_native: decide as a communicator with no profile chosen does (Tuner)."""
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a pccl.Topology, got {type(topology).__name__}")
        if not isinstance(profile, Profile):
            raise TypeError(f"profile must be a pccl.tuning.profiles.Profile, got {type(profile).__name__}")
        if not (isinstance(rank, int) and 0 <= rank < topology.size):
            raise ValueError(f"rank must be in 0..{topology.size - 1}, got {rank!r}")
        # The transport's own fields, as Communicator.__init__ sets them before _set_up: no
        # data moves, so no executor, group or MPI communicator, and no call times out.
        self.rank, self.size = rank, topology.size
        self.transport = self.backend = self.executor = "dry-run"
        self.timeout = float("inf")
        self.group = self.mpi_comm = None
        self.devices = DEVICES
        # Every other field as a real communicator's (no collective call: topology and profile are given).
        self._set_up(topology, profile, {"intra": "dry-run", "inter": "dry-run"}, plan_devices=DEVICES,
                     trust_native=trust_native)
        # (the world's topology, this communicator's partition of it); None: the world itself
        self._root = _root
        self.calls: list[tuple[str, object, int, float]] = []   # (collective, algorithm, bytes, seconds)

    def __repr__(self) -> str:
        return f"DryRunCommunicator(rank={self.rank}, size={self.size}, {self.topology.describe()})"

    def _can_build_levels(self) -> bool:
        """Its plan levels are never built, so auto weighs the plans wherever the topology
        has them (as on a real world over all ranks)."""
        return True

    def split(self, groups, transport: Optional[str] = None) -> "DryRunCommunicator":
        """This rank's group of `groups`, as Communicator.split, with every other group of the
        partition assumed to run the same collectives at the same time."""
        groups = [list(g) for g in groups]
        if sorted(r for g in groups for r in g) != list(range(self.size)):
            raise ValueError(f"groups must hold each rank 0..{self.size - 1} exactly once, got {groups}")
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"a dry run predicts symmetric splits only: groups of one size, got "
                             f"{sorted({len(g) for g in groups})}")
        members = next(g for g in groups if self.rank in g)
        world, parents = self._root if self._root is not None else (self.topology, (tuple(range(self.size)),))
        partition = tuple(tuple(parent[i] for i in g) for parent in parents for g in groups)
        return DryRunCommunicator(self.topology.restrict(members), self.profile, members.index(self.rank),
                                  trust_native=self.trust_native, _root=(world, partition))

    def predict(self, collective: str, algorithm, nbytes: int) -> float:
        """Seconds the cost model predicts for this call (`algorithm` resolved)."""
        return _predicted(self.topology, self._root, self.profile, collective, algorithm, nbytes)

    def resolve(self, collective: str, algorithm, nbytes: int, device: str = "cpu", compression=None,
                dtype: torch.dtype = torch.float32):
        """Communicator.resolve, remembered for every dry run of this topology and profile."""
        if compression:
            return super().resolve(collective, algorithm, nbytes, device, compression, dtype)
        key = (self.topology, self.profile, collective, algorithm, nbytes, device, reduction_class(dtype))
        try:
            return _RESOLVED[key]
        except KeyError:
            if len(_RESOLVED) >= 1 << 16:
                _RESOLVED.clear()
            out = _RESOLVED[key] = super().resolve(collective, algorithm, nbytes, device, dtype=dtype)
            return out
        except TypeError:   # an unhashable algorithm argument: resolved (and refused) every time
            return super().resolve(collective, algorithm, nbytes, device, dtype=dtype)

    def _record(self, collective: str, algorithm, like: torch.Tensor, compression) -> None:
        codecs, algorithm = self._compression(compression, like, collective, algorithm)
        if codecs:
            raise ValueError("a dry run does not predict compressed collectives yet (the engine's trace does not "
                             "carry codecs); pccl-sim and cost_model.predict do")
        nbytes = like.numel() * like.element_size()
        algorithm = self.resolve(collective, algorithm, nbytes, like.device.type)
        if not isinstance(algorithm, str):
            plans.build(algorithm, collective, self.topology, self.rank)   # validates the spec
        self.calls.append((collective, algorithm, nbytes, self.predict(collective, algorithm, nbytes)))

    def queues_on_device(self, device: str) -> bool:
        """True: its collectives return at once, so callers issue them on their own thread."""
        return True

    def close(self, groups: bool = True) -> None:
        self._queue.close()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algorithm: str = "auto",
                   async_op: bool = False, compression=None) -> None:
        self._check_buffers(output, input, full="output")
        self._record("all_gather", algorithm, output, compression)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       algorithm: str = "auto", async_op: bool = False, compression=None) -> None:
        self._check_buffers(output, input, full="input")
        op_code(op, input.dtype)
        self._record("reduce_scatter", algorithm, input, compression)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
                   async_op: bool = False, compression=None) -> None:
        validation.check_tensor("tensor", tensor, self.devices)
        op_code(op, tensor.dtype)
        self._record("all_reduce", algorithm, tensor, compression)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto", async_op: bool = False):
        raise ValueError(UNPREDICTED.format("broadcast"))

    def barrier(self, algorithm: str = "auto") -> None:
        raise ValueError(UNPREDICTED.format("barrier"))


# Dry runs of one world repeat the same calls (the planner traces every strategy on one
# world): their predictions and resolutions are kept across communicators, by value.
_RESOLVED: dict = {}


@lru_cache(maxsize=1 << 16)
def _predicted(topology: Topology, root, profile: Profile, collective: str, algorithm, nbytes: int) -> float:
    world, partition = root if root is not None else (topology, ((),))
    if len(partition) == 1 or plans.spec_of(algorithm) is not None:
        # alone on the machine (a plan inside a group: the group's own topology)
        return cost_model.predict(collective, algorithm, topology, profile, nbytes)
    return cost_model.predict_groups(collective, algorithm, world, partition, profile, nbytes)
