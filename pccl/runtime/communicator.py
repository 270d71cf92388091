"""The Communicator: validated collectives over one process group, any executor."""
from __future__ import annotations

import dataclasses
import os
import pickle
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pccl import plans, vocabulary
from pccl.algorithms import NATIVES, schedule
from pccl.compression.codecs import per_level
from pccl.core.dtypes import op_code
from pccl.core.errors import CollectiveTimeout, during
from pccl.core.topology import Topology, TopologyError
from pccl.executors.plan import PlanExecutor
from pccl.executors.streams import StreamWork
from pccl.executors.torch_p2p import TorchP2PExecutor
from pccl.runtime import teardown, transports, validation
from pccl.runtime.choice import Choice
from pccl.runtime.detect import detect, detect_torch
from pccl.runtime.rendezvous import init_torch_distributed, mpi_world
from pccl.runtime.work import SerialQueue, Work
from pccl.tuning.profiles import Profile, from_environment
from pccl.tuning.profiles import load as load_profile
from pccl.tuning.selection import Tuner
from pccl.tuning.self_calibration import DEVICES as MEASURED
from pccl.tuning.self_calibration import SelfCalibration, measures
from pccl.util.sizes import size_label

DEFAULT_TIMEOUT = float(os.environ.get("PCCL_TIMEOUT", 300.0))
EXECUTORS = {"mpi": ("cpp", "python"), "torch": ("torch",)}
MAX_CACHED_CALLS = 4096   # resolved calls kept per communicator (then the cache starts over)


def compression_from_environment():
    """PCCL_COMPRESSION, the codec of calls that name none (None: no compression); read
    when a communicator is made, as NCCL reads its variables."""
    return os.environ.get("PCCL_COMPRESSION") or None


@dataclass(frozen=True)
class Call:
    """A call resolved once and kept for the next with the same collective, algorithm,
    op and buffers (dtype, element count, device): fn(*flat buffers) runs it."""

    fn: Callable[..., None]
    what: Callable[[], str]   # what a failure message says it was doing (worded only then)
    enqueues: bool            # it only queues GPU work: issued on the caller's thread (queues_on_device)


def call_key(head: tuple, *buffers) -> Optional[tuple]:
    """The call cache's key of `buffers` (their dtype, element count and device), or None
    where they must go through the full checks: not tensors, not contiguous, or on a
    device other than the host or a GPU. Contiguity is a property of the tensor, not of
    its shape, so it is checked on every call."""
    for t in buffers:
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            return None
        if t.is_cpu:
            head += (t.dtype, t.numel(), -1)
        elif t.is_cuda:
            head += (t.dtype, t.numel(), t.get_device())
        else:
            return None
    return head


def uncompressed(compression) -> bool:
    """Whether a call's compression argument leaves it to the communicator's default
    (None) or names none: such calls are kept in the call cache."""
    return compression is None or (isinstance(compression, str) and compression == "none")


def flat(t: torch.Tensor) -> torch.Tensor:
    """The 1-d view the executors and plans slice (a 1-d tensor itself: no new view)."""
    return t if t.dim() == 1 else t.view(-1)


def _thread_level_names(MPI) -> dict[int, str]:
    return {getattr(MPI, f"THREAD_{name}"): f"MPI_THREAD_{name}"
            for name in ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")}


def on_callers_stream(fn: Callable[[], None], like: torch.Tensor) -> Callable[[], None]:
    """GPU tensors: run `fn` (maybe later, on the worker thread) on the stream that is
    current for the caller now, so the collective is ordered after the caller's work."""
    if not like.is_cuda:
        return fn
    stream = torch.cuda.current_stream(like.device)

    def on_stream() -> None:
        with torch.cuda.stream(stream):
            fn()
    return on_stream


def named(e: CollectiveTimeout, what: Callable[[], str]) -> CollectiveTimeout:
    """A collective's CollectiveTimeout (or PeerLost), naming the operation it interrupted,
    what() (worded only then: nothing on the hot path); the process will not hang in
    MPI_Finalize over it."""
    teardown.exit_if_finalize_hangs()
    return during(e, what())


def naming_failures(fn: Callable[[], None], what: Callable[[], str]) -> Callable[[], None]:
    """`fn`, whose CollectiveTimeout names the operation it interrupted (named)."""
    def run() -> None:
        try:
            fn()
        except CollectiveTimeout as e:
            raise named(e, what) from e
    return run


class Communicator:
    """Collectives over an mpi4py communicator or a torch.distributed process group.

    All ranks of the group must construct it together (it duplicates the MPI
    communicator) and then call the same collectives in the same order.
    """

    def __init__(self, comm, executor: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT, *,
                 topology: Optional[Topology] = None, ranks_per_node: Optional[int] = None,
                 nics_per_node: Optional[int] = None, intra: Optional[str] = None,
                 inter: Optional[str] = None, profile=None, interruptible: bool = False):
        """Topology: given, or `ranks_per_node` consecutive ranks per node (emulated nodes on
        one machine), or PCCL_RANKS_PER_NODE, or detected (MPI's shared-memory split;
        host names for torch.distributed). intra/inter: the transport of each level of the
        two-level plans, "mpi", "gloo" or "nccl" (default: this communicator's own;
        intra="nccl", inter="mpi" is the PCCL paper's design on GPUs). profile: the
        machine profile algorithm="auto" predicts with: a pccl.tuning.profiles.Profile, a built-in
        name or a file (default: PCCL_PROFILE, else "generic", which describes no machine:
        then auto runs the transport's own collective until a measurement says otherwise,
        and communicators of two ranks or more over MPI or gloo measure at first use,
        pccl.tuning.self_calibration); rank 0's is used by all.
        interruptible: auto never takes the MPI library's blocking collectives, which cannot
        be interrupted (a peer that dies there ends the job through the watchdog), but their
        nonblocking forms ("native_nonblocking", polled like pccl's schedules), so that
        every collective auto runs times out with a CollectiveTimeout naming what it waited
        for, as the training engine promises; so do the plans' "native" phases on its level
        communicators (own_native); an explicit algorithm="native" still runs the blocking
        ones."""
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        if isinstance(comm, dist.ProcessGroup):
            self.transport = "torch"
            self.group, self.mpi_comm = comm, None
            self.backend = dist.get_backend(comm)
            executor = self._check_executor(executor or "torch")
            self._executor = self._native = TorchP2PExecutor(comm, self.timeout)
            self.devices = transports.devices_of(self.backend)
            gpu_mpi = False
        else:
            # MPI and the native module load only for MPI communicators: a torch.distributed
            # run needs neither.
            from mpi4py import MPI

            from pccl.executors.mpi_cpp import MpiCppExecutor, gpu_available
            from pccl.executors.mpi_python import MpiPythonExecutor

            if not isinstance(comm, MPI.Comm):
                raise TypeError(f"comm must be an mpi4py.MPI.Comm or a torch.distributed.ProcessGroup, "
                                f"got {type(comm).__name__}")
            transports.check_thread_level(MPI.Query_thread(), _thread_level_names(MPI))
            self.transport = "mpi"
            self.backend = "mpi"
            self.group, self.mpi_comm = None, comm.Dup()  # for sub-communicators and detection
            executor = self._check_executor(executor or "cpp")
            self._native = MpiCppExecutor(comm, self.timeout)
            if executor == "python":
                self._executor = MpiPythonExecutor(comm, self.timeout)
            else:
                self._executor = self._native
            gpu_mpi = executor == "cpp" and gpu_available()
            self.devices = transports.devices_of("mpi", gpu_mpi)
        self.executor = executor
        self.rank, self.size = self._native.rank, self._native.size
        # What the ranks find and agree on, in this order on every rank (detecting the
        # topology and taking rank 0's profile are collective calls).
        topology = self._topology(topology, ranks_per_node, nics_per_node)
        level_transports = {"intra": intra or self.backend, "inter": inter or self.backend}
        level_devices = []
        for level, transport in level_transports.items():
            if transport not in transports.TRANSPORTS and transport != self.backend:
                raise ValueError(f"{level} must be one of {transports.TRANSPORTS}, got {transport!r}")
            if transport == "mpi" and self.transport != "mpi":
                raise ValueError(f"{level}='mpi' needs a Communicator built on an mpi4py communicator")
            transports.check_available(transport)
            level_devices.append(transports.devices_of(transport, gpu_mpi))
        # The devices a two-level plan takes: those both of its levels carry.
        plan_devices = tuple(d for d in level_devices[0] if d in level_devices[1])
        profile, chosen = (profile, True) if isinstance(profile, Profile) else self._agreed_profile(profile)
        self._set_up(topology, profile, level_transports, plan_devices, interruptible, trust_native=not chosen)
        if not chosen and measures(self):
            self.self_calibration = SelfCalibration(self)
        if self.tuner.plans_apply and any(map(transports.uses_torch, self.level_transports.values())):
            # torch.distributed groups must be created in one global order on every rank:
            # now, on the constructing thread, not at a first plan call on whichever worker
            # thread (the engine's two lanes) gets there first.
            self._plan_executor()

    def _set_up(self, topology: Topology, profile: Profile, level_transports: dict[str, str],
                plan_devices: tuple[str, ...], interruptible: bool = False, trust_native: bool = False) -> None:
        """The fields of every communicator, whatever carries its data, set once its
        transport's own are (rank, size, transport, backend, executor, timeout, group,
        mpi_comm, devices). The dry run (pccl/runtime/dry_run.py) is made by this too, so a
        field added here is one it has."""
        self.label = ""   # what a failure message calls it ("inter-node level"); empty: the communicator
        self.default_compression = compression_from_environment()
        self._calls: dict[tuple, Call] = {}
        self._queue = SerialQueue(f"pccl-{self.transport}")
        self._owns_group = False   # a torch group made by split, destroyed by close
        self.topology = topology
        self.level_transports = level_transports
        self.plan_devices = plan_devices
        self.interruptible = interruptible
        self.trust_native = trust_native
        self.self_calibration: Optional[SelfCalibration] = None   # where it measures (measures()): host buffers'
        self._device_calibrations: dict[str, SelfCalibration] = {}   # and each GPU type's, at first need
        self.use_profile(profile)
        self._plans: Optional[PlanExecutor] = None
        self._compressed = None   # the executor of compressed schedules, where it is not _executor

    def use_profile(self, profile: Profile, device: Optional[str] = None) -> None:
        """Decide auto's choices with `profile` from now on (every rank alike): for the
        buffers of every device, or of `device` only ("cpu": host buffers; the
        self-calibration measures each device type apart). `profile`, `tuner`: the host
        buffers'; `given_profile`: what devices without a profile of their own decide with."""
        self._calls.clear()   # calls resolved before decided with the profile before
        natives = NATIVES if self.transport == "mpi" and not self.interruptible else (self.own_native,)
        tuners = (Tuner(self.topology, profile, with_plans=self._can_build_levels(), natives=natives,
                        trust_native=self.trust_native),
                  # auto where plans cannot run
                  Tuner(self.topology, profile, with_plans=False, natives=natives, trust_native=self.trust_native))
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
        return "native_nonblocking" if self.transport == "mpi" and self.interruptible else "native"

    def _can_build_levels(self) -> bool:
        """torch.distributed level groups (gloo, NCCL) can only be made from a communicator
        over all ranks."""
        return not any(map(transports.uses_torch, self.level_transports.values())) or self._spans_world()

    def _spans_world(self) -> bool:
        """Whether this communicator holds every rank, as a torch.distributed group must be
        created from (new_group, and pccl's rendezvous through MPI, are collective over all)."""
        if self.mpi_comm is not None:
            from mpi4py import MPI

            return self.size == MPI.COMM_WORLD.size
        return self.size == dist.get_world_size()

    def _agreed_profile(self, name) -> tuple[Profile, bool]:
        """(rank 0's profile, whether it was chosen: named, or by PCCL_PROFILE), or rank 0's
        error, on every rank, so every rank decides alike."""
        mine = None
        if self.rank == 0:
            try:
                mine = ((load_profile(name) if name else from_environment()).to_dict(),
                        bool(name or os.environ.get("PCCL_PROFILE")))
            except ValueError as e:
                mine = str(e)
        # before the set-up (which takes the profile), so not through broadcast_object: the
        # transport's own object broadcast (over MPI, mpi4py's on this communicator's
        # duplicate, apart from the executors'; a timeout here could not be named anyway)
        if self.mpi_comm is not None:
            agreed = self.mpi_comm.bcast(mine, root=0)
        else:
            box = [mine]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            agreed = box[0]
        if isinstance(agreed, str):
            raise ValueError(f"machine profile on rank 0: {agreed}")
        return Profile.from_dict(agreed[0]), agreed[1]

    def _topology(self, topology, ranks_per_node, nics_per_node) -> Topology:
        if topology is not None:
            if topology.size != self.size:
                raise TopologyError(f"topology has {topology.size} ranks but the communicator {self.size}")
            return topology
        ranks_per_node = ranks_per_node or int(os.environ.get("PCCL_RANKS_PER_NODE", 0)) or None
        if ranks_per_node is not None:
            found = Topology.regular(self.size, ranks_per_node, nics_per_node or 1)
        elif self.mpi_comm is not None:
            found = detect(self.mpi_comm, nics_per_node)
        else:
            found = detect_torch(self.group, nics_per_node)
        # Network groups are not detected: the job's placement on them is the scheduler's.
        per_group = int(os.environ.get("PCCL_NODES_PER_GROUP", 0)) or None
        return dataclasses.replace(found, nodes_per_group=per_group) if per_group else found

    def _plan_executor(self) -> PlanExecutor:
        """The executor of the plans, over the intra-node and inter-node communicators (and
        the group and global ones where the network has groups)
        (made with this communicator where they are torch groups, else on first use;
        creating them is collective over this communicator)."""
        if self._plans is None:
            wanted = dict(self.level_transports)
            if self.topology.has_groups:   # the three-level plans' network levels ride the inter-node transport
                for level in ("group", "global"):
                    wanted[level] = wanted["inter"]
            levels = {level: self.split(self.topology.level_groups(level), transport)
                      for level, transport in wanted.items()}
            for level, comm in levels.items():
                comm.label = f"the {level}-node level's "
            self._plans = PlanExecutor(levels)
        return self._plans

    def split(self, groups, transport: Optional[str] = None) -> "Communicator":
        """The communicator of this rank's group in `groups`: a partition of the ranks, each
        group listing its members in their new rank order. Over `transport` ("mpi", "gloo",
        "nccl"; default this communicator's own, so the children of an NCCL communicator
        are NCCL communicators and a split never changes the backend silently), with this
        communicator's executor, timeout, profile and level transports (where the child can
        carry them) and its topology restricted to the group. Collective: every rank calls
        it with the same groups, and every rank creates every group in the same order (as
        torch.distributed requires). Mixed transports assume torch.distributed's ranks are
        MPI.COMM_WORLD's, as they are when pccl brings torch.distributed up through MPI or the
        launcher numbers both alike."""
        groups = [list(g) for g in groups]
        if sorted(r for g in groups for r in g) != list(range(self.size)):
            raise ValueError(f"groups must hold each rank 0..{self.size - 1} exactly once, got {groups}")
        transport = transport or self.backend
        transports.devices_of(transport)   # a known transport, or ValueError
        transports.check_available(transport)
        index = next(i for i, g in enumerate(groups) if self.rank in g)
        members = groups[index]
        # A profile chosen for the parent is the child's; else the child decides (and measures) for
        # its own shape.
        options = dict(timeout=self.timeout, topology=self.topology.restrict(members),
                       profile=None if self.trust_native else self.profile, interruptible=self.interruptible)
        if transport == "mpi":
            if self.transport != "mpi":
                raise ValueError("an 'mpi' sub-communicator needs a Communicator built on an mpi4py communicator")
            if self.interruptible:   # MPI_Comm_split blocks for good on a dead peer: find out first
                self.barrier()
            sub = self.mpi_comm.Split(index, members.index(self.rank))
            return Communicator(sub, executor=self.executor, **self.level_transports, **options)
        if not self._spans_world():
            raise ValueError(f"{transport} sub-communicators need a parent over all ranks; this one has {self.size}")
        world = self._world_ranks()
        init_torch_distributed(transport, self.timeout)
        mine = None
        for ranks in groups:
            group = dist.new_group([world[r] for r in ranks], backend=transport)
            if self.rank in ranks:
                mine = group
        # Every member takes part in the group's first operation, as torch requires of a
        # first batch_isend_irecv on NCCL (a schedule step may leave some ranks idle).
        dist.barrier(group=mine)
        # A torch child cannot run MPI levels: those become its own backend.
        levels = {level: transport if t == "mpi" else t for level, t in self.level_transports.items()}
        child = Communicator(mine, **levels, **options)
        child._owns_group = True
        return child

    def _world_ranks(self) -> list[int]:
        """The global (world) rank of each rank of this communicator."""
        if self.transport == "torch":
            return list(self._native.global_rank)  # the torch executor's map, computed once
        from mpi4py import MPI

        return self.mpi_comm.allgather(MPI.COMM_WORLD.rank)

    def resolve(self, collective: str, algorithm, nbytes: int, device: str = "cpu", compression=None,
                dtype: torch.dtype = torch.float32):
        """What `algorithm` runs for `nbytes` (the full buffer) of `device` tensors: a flat
        algorithm's name, a native one, or a plan spec; "auto" resolved as a call would resolve
        it, among what can take the device (it never communicates: a self-calibration is
        measured at a collective's first call, not here). A plan whose levels cannot carry the device is
        refused before anything is sent. `compression` (a codec, or one per plan level, as
        the collectives take it; `dtype` the payload's): auto takes the fastest candidate
        predicted with it (Tuner.choose_for), and HO-Ring's all-gather and all-reduce, whose
        concurrent phases move a block both exactly and encoded so that ranks would end with
        different values, are refused (plans.compresses_consistently)."""
        spec = plans.spec_of(algorithm)
        if spec is None:
            vocabulary.check(collective, algorithm)
            if algorithm == "native_nonblocking" and self.transport != "mpi":
                raise ValueError(f"'native_nonblocking' is MPI's nonblocking collective; transport {self.backend!r} "
                                 "has none: use 'native'")
            if algorithm != "auto":
                return algorithm
            tuner = self.tuner_for(device)
            name = tuner.choose_for(collective, nbytes, dtype, compression) if compression else \
                tuner.name(collective, nbytes, dtype)
            spec = plans.NAMED.get(name, name)
            if isinstance(spec, str):
                return spec
        elif compression and not plans.compresses_consistently(spec, collective):
            raise ValueError(f"a compressed {collective.replace('_', '-')} cannot run HO-Ring: its concurrent phases "
                             "move each block both exactly and encoded, so ranks would end with different values; "
                             "use 'hierarchical' or a flat schedule")
        transports.check_level_devices(device, self.level_transports, self.plan_devices)
        return spec

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

    def choose(self, collective: str, algorithm, like: torch.Tensor, codec=None) -> Choice:
        """What a call of `collective` on the full buffer `like` runs (Choice), decided once:
        auto measured where this is its first call at that size (collective, as the call
        itself would be), then resolved; `codec`: the one its blocks travel in, or None."""
        nbytes = like.numel() * like.element_size()
        self.measure_auto(collective, algorithm, like.dtype, like.device.type, codec, nbytes)
        resolved = self.resolve(collective, algorithm, nbytes, like.device.type, codec, like.dtype)
        return Choice(collective, resolved, like.numel(), like.dtype, self.topology, self.rank, codec)

    def calibration_for(self, device: str) -> SelfCalibration:
        """The self-calibration of `device` buffers ("cpu" or "cuda"), where this
        communicator measures itself (self_calibration is not None)."""
        if device == "cpu":
            return self.self_calibration
        if device not in self._device_calibrations:
            self._device_calibrations[device] = SelfCalibration(self, device)
        return self._device_calibrations[device]

    def gpu_type(self, device: str) -> dict:
        """What the self-calibration of `device` buffers ("cuda": CUDA or HIP) depends on
        beyond the host: the GPU's model, how many a rank sees, and how MPI moves their
        memory (GPU-aware, or staged through pinned host memory)."""
        from pccl.executors.mpi_cpp import gpu_aware_mpi

        return {"type": device, "gpu": torch.cuda.get_device_name(), "visible": torch.cuda.device_count(),
                "mpi": "GPU-aware" if gpu_aware_mpi() else "staged"}

    def tuner_for(self, device: str) -> Tuner:
        """The tuner for `device` tensors, with the plans where they can carry them: the
        host's, a GPU type's own where it has a profile of its own (its self-calibration),
        else the profile the communicator was given."""
        if device == "cpu":
            tuners = (self.tuner, self._flat_tuner)
        else:
            tuners = self._device_tuners.get(device, self._given_tuners)
        return tuners[0] if device in self.plan_devices else tuners[1]

    def _check_executor(self, executor: str) -> str:
        valid = EXECUTORS[self.transport]
        if executor not in valid:
            raise ValueError(f"executor {executor!r} does not run on transport {self.transport!r}; "
                             f"expected one of {valid}")
        return executor

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, transport={self.backend!r}, "
                f"executor={self.executor!r}, {self.topology.describe()})")

    def _check_buffers(self, output: torch.Tensor, input: torch.Tensor, full: str) -> None:
        """Validate an (output, input) pair whose `full` side holds size blocks of the other."""
        validation.check_tensor("output", output, self.devices)
        validation.check_tensor("input", input, self.devices)
        validation.check_pair(output, input)
        big, small = (output, input) if full == "output" else (input, output)
        other = "input" if full == "output" else "output"
        validation.check_numel(full, big.numel(), self.size * small.numel(),
                               f"size * {other}.numel() = {self.size} * {small.numel()}")

    def _compression(self, compression, like: torch.Tensor, collective: str, algorithm) -> tuple[dict, object]:
        """({level: codec}, algorithm) of a call: one codec for a flat schedule ("flat") and,
        in a plan, for the inter-node level only unless a dict names the levels ({"intra":
        ..., "inter": ...}); None (default: PCCL_COMPRESSION as it was when the communicator
        was made, else none) compresses nothing.
        "auto": the codec (or none) and, with algorithm="auto", the algorithm the cost model
        predicts fastest (Tuner.choose_compressed; none on GPU tensors). Checked before
        anything is sent."""
        if compression is None:
            compression = self.default_compression
        if uncompressed(compression):   # the common case, without per_level's work
            return {}, algorithm
        if isinstance(compression, str) and compression.strip().lower() == "auto":
            if like.device.type != "cpu":
                return {}, algorithm
            spec = plans.spec_of(algorithm)
            if spec is None:
                vocabulary.check(collective, algorithm)
            compression, algorithm = self.tuner_for(like.device.type).choose_compressed(
                collective, like.numel() * like.element_size(), like.dtype, algorithm if spec is None else spec)
        codecs = per_level(compression)
        for c in codecs.values():
            c.check(like.dtype)
            if like.device.type != "cpu" and (c.native is None or self.transport != "torch"):
                raise ValueError(f"compression of {like.device.type} tensors runs the native codecs (int8, bf16, fp16) "
                                 f"over the torch transport (NCCL, RCCL), got {c.name} over {self.transport}")
        return codecs, algorithm

    def _compressing(self, codec):
        """The executor of schedules compressed with `codec`: this one's where it takes the
        codec (the C++ executor takes the native codecs), else the Python reference loop
        over a duplicate of the MPI communicator (made at first use: every rank makes the
        same calls)."""
        if self._executor.takes(codec):
            return self._executor
        if self._compressed is None:
            from pccl.executors.mpi_python import MpiPythonExecutor

            self._compressed = MpiPythonExecutor(self.mpi_comm, self.timeout)
        return self._compressed

    def _cached(self, head: Optional[tuple], *buffers) -> tuple[Optional[tuple], Optional[Call]]:
        """(key, the call resolved before for it or None); key None: not cacheable (a
        call naming its compression, buffers call_key refuses, an unhashable algorithm)."""
        key = None if head is None else call_key(head, *buffers)
        if key is None:
            return None, None
        try:
            return key, self._calls.get(key)
        except TypeError:   # an unhashable algorithm argument: checked in full, never kept
            return None, None

    def _keep(self, key: Optional[tuple], call: Call) -> None:
        if key is not None:
            if len(self._calls) >= MAX_CACHED_CALLS:
                self._calls.clear()
            self._calls[key] = call

    def _prepare(self, collective: str, algorithm, like: torch.Tensor, codecs: dict, op: str = "sum") -> Call:
        """Resolve a validated call into what runs it: the transport's own collective, a
        schedule on an executor, or a plan on the plan executor (_run_native,
        _run_schedule, _run_plan), taking the flat buffers."""
        nbytes = like.numel() * like.element_size()
        self.measure_auto(collective, algorithm, like.dtype, like.device.type, codecs, nbytes)
        algorithm = self.resolve(collective, algorithm, nbytes, like.device.type, codecs, like.dtype)
        if not isinstance(algorithm, str):
            plan = plans.build(algorithm, collective, self.topology, self.rank)  # validates the spec
            # the plan's level communicators are made when it first runs
            fn = partial(_run_plan, collective, plan, self._plan_executor, op, codecs)
        elif algorithm in NATIVES:
            if codecs:
                raise ValueError(f"compression runs inside pccl's schedules; {algorithm!r} is the transport's own "
                                 "collective: choose a schedule, a plan or auto")
            fn = partial(_run_native, collective, self._native, op, algorithm == "native_nonblocking")
        else:
            sched = schedule(collective, algorithm, self.size, self.rank)
            codec = codecs.get("flat")
            runner = self._compressing(codec) if codec is not None else self._executor
            fn = partial(_run_schedule, collective, sched, runner, op, codec)
        dtype = str(like.dtype).removeprefix("torch.")   # not `like`: a kept call must not keep its buffers
        what = lambda: (f"{self.label}{collective.replace('_', '-')} ({algorithm}, {size_label(nbytes)} bytes of "  # noqa: E731
                        f"{dtype})")
        return Call(fn, what, self.queues_on_device(like.device.type))

    def _issue(self, call: Call, async_op: bool, *buffers: torch.Tensor) -> Optional[Work]:
        """Run `call` on the (flat) buffers after what is queued: at once on this thread
        where it is synchronous and nothing is queued."""
        if not async_op and self._queue.idle() and not buffers[0].is_cuda:   # the common case, without closures
            try:
                return call.fn(*buffers)
            except CollectiveTimeout as e:
                raise named(e, call.what) from e
        run = naming_failures(partial(call.fn, *buffers), call.what)
        return self._queue.run(on_callers_stream(run, buffers[0]), async_op, StreamWork if call.enqueues else None)

    def drain(self) -> None:
        """Wait until the collectives queued on this communicator have run."""
        self._queue.drain()

    def queues_on_device(self, device: str) -> bool:
        """Whether collectives on `device` tensors only queue work on GPU streams (NCCL, with
        NCCL plan levels) and return. Those are issued on the calling thread, async or not,
        in program order: NCCL needs every rank to launch its operations on all its
        communicators in one order (a kernel waiting for peers can block another), which
        worker threads would not keep."""
        return device == "cuda" and self.transport == "torch" and all(
            "nccl" in t for t in (self.backend, *self.level_transports.values()))

    def uses_nccl(self) -> bool:
        """Whether any of its transports (its own or a plan level's) is NCCL."""
        return any("nccl" in t for t in (self.backend, *self.level_transports.values()))

    def close(self, groups: bool = True) -> None:
        """Finish queued work and free what this communicator made: its worker thread, its
        plan levels, and (groups) the torch group it owns (an NCCL communicator holds GPU
        memory and a connection to every peer until destroyed; groups=False while torch
        is destroying every group itself). Every member calls it."""
        self._queue.close()
        if self._plans is not None:
            for level in self._plans.levels.values():
                level.close(groups)
            self._plans = None
        if groups and self._owns_group and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self._owns_group = False

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algorithm: str = "auto",
                   async_op: bool = False, compression=None) -> Optional[Work]:
        """Gather every rank's `input` into `output`: rank i's input lands at block i.
        compression: a codec ("int8", "bf16", "fp16", "zfp:8"; pccl.compression.codecs),
        or per plan level {"intra": ..., "inter": ...}, or "auto" (the cost model chooses
        a codec, or none, with the algorithm); each block is encoded once, by its owner, and
        every rank's output is the same decoding."""
        key, call = self._cached(("all_gather", algorithm) if uncompressed(compression) else None, output, input)
        if call is None:
            self._check_buffers(output, input, full="output")
            codecs, resolved = self._compression(compression, output, "all_gather", algorithm)
            call = self._prepare("all_gather", resolved, output, codecs)
            self._keep(key, call)
        return self._issue(call, async_op, flat(output), flat(input))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       algorithm: str = "auto", async_op: bool = False, compression=None) -> Optional[Work]:
        """Reduce `input` over all ranks; this rank receives block `rank` in `output`.
        compression: as all_gather's; partial sums are encoded at each step."""
        head = ("reduce_scatter", algorithm, op) if uncompressed(compression) else None
        key, call = self._cached(head, output, input)
        if call is None:
            self._check_buffers(output, input, full="input")
            op_code(op, input.dtype)
            codecs, resolved = self._compression(compression, input, "reduce_scatter", algorithm)
            call = self._prepare("reduce_scatter", resolved, input, codecs, op)
            self._keep(key, call)
        return self._issue(call, async_op, flat(output), flat(input))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
                   async_op: bool = False, compression=None) -> Optional[Work]:
        """Reduce `tensor` over all ranks, in place. compression: as all_gather's."""
        key, call = self._cached(("all_reduce", algorithm, op) if uncompressed(compression) else None, tensor)
        if call is None:
            validation.check_tensor("tensor", tensor, self.devices)
            op_code(op, tensor.dtype)
            codecs, resolved = self._compression(compression, tensor, "all_reduce", algorithm)
            call = self._prepare("all_reduce", resolved, tensor, codecs, op)
            self._keep(key, call)
        return self._issue(call, async_op, flat(tensor))

    # Broadcast and barrier: the transport's own (MPI's, torch.distributed's). Nothing in
    # training moves bulk data from one rank, so pccl schedules none: these carry a run's
    # agreements (rank 0's settings, paths, cache entries) and its rendezvous.

    def _native_form(self, collective: str, algorithm) -> str:
        """The native form a broadcast or barrier runs: "auto" is the communicator's own
        (own_native), "native" the blocking call, "native_nonblocking" MPI's polled one."""
        forms = ("auto",) + (NATIVES if self.transport == "mpi" else ("native",))
        if not isinstance(algorithm, str) or algorithm not in forms:
            raise ValueError(f"algorithm {algorithm!r} does not implement {collective} over {self.transport}; "
                             f"expected one of {forms} (the transport's own {collective})")
        return self.own_native if algorithm == "auto" else algorithm

    def broadcast(self, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto",
                  async_op: bool = False) -> Optional[Work]:
        """Rank `root`'s `tensor` on every rank, in place (the others' values are
        overwritten); every rank passes a tensor of the same dtype and size."""
        key, call = self._cached(("broadcast", algorithm, root), tensor)
        if call is None:
            validation.check_tensor("tensor", tensor, self.devices)
            validation.check_root(root, self.size)
            form = self._native_form("broadcast", algorithm)
            fn = partial(self._native.native_broadcast, root=root)
            if form == "native_nonblocking":
                fn = partial(fn, polled=True)
            nbytes, dtype = tensor.numel() * tensor.element_size(), str(tensor.dtype).removeprefix("torch.")
            what = lambda: f"{self.label}broadcast ({form}, from rank {root}, {size_label(nbytes)} bytes of {dtype})"  # noqa: E731
            call = Call(fn, what, self.queues_on_device(tensor.device.type))
            self._keep(key, call)
        return self._issue(call, async_op, flat(tensor))

    def broadcast_object(self, obj, root: int = 0):
        """Rank `root`'s `obj` (any picklable value; the other ranks' is ignored) on every
        rank (broadcast_pickled, through this communicator's broadcast)."""
        validation.check_root(root, self.size)
        if self.size == 1:   # nothing to agree with
            return obj
        return broadcast_pickled(obj, self.rank, root, self._host_or_gpu(), self.broadcast)

    def _host_or_gpu(self) -> torch.device:
        """Where small agreements travel: host memory, or the current GPU's where this
        communicator carries only GPU buffers (NCCL)."""
        return torch.device("cpu") if "cpu" in self.devices else torch.device("cuda", torch.cuda.current_device())

    def barrier(self, algorithm: str = "auto") -> None:
        """Return once every rank has called it, after this rank's queued collectives."""
        form = self._native_form("barrier", algorithm)
        fn = partial(self._native.native_barrier, polled=True) if form == "native_nonblocking" \
            else self._native.native_barrier
        self._queue.run(naming_failures(fn, lambda: f"{self.label}barrier ({form})"), async_op=False)


# What a resolved call runs, on the flat buffers: (output, input), or (tensor,) for all_reduce.

def _run_native(collective: str, native, op: str, polled: bool, *buffers: torch.Tensor) -> None:
    """The transport's own collective; polled: MPI's nonblocking form."""
    kwargs = {"polled": True} if polled else {}
    if collective == "all_gather":
        native.native_all_gather(*buffers, **kwargs)
    elif collective == "reduce_scatter":
        native.native_reduce_scatter(*buffers, op, **kwargs)
    else:
        native.native_all_reduce(*buffers, op, **kwargs)


def _run_schedule(collective: str, sched, runner, op: str, codec, *buffers: torch.Tensor) -> None:
    """A schedule on an executor, compressed with `codec` where one is given."""
    if collective == "all_gather":
        runner.all_gather(sched, *buffers, codec)
    elif collective == "reduce_scatter":
        runner.reduce_scatter(sched, *buffers, op, codec)
    else:
        runner.all_reduce(sched, *buffers, op, codec)


def _run_plan(collective: str, plan, executor: Callable[[], PlanExecutor], op: str, codecs: dict,
              *buffers: torch.Tensor) -> None:
    """A plan on the plan executor (`executor()`: its level communicators, made at first use)."""
    if collective == "all_reduce":
        executor().all_reduce(plan, *buffers, op, codecs)
        return
    out, inp = buffers
    count = inp.numel() if collective == "all_gather" else out.numel()   # elements per rank
    executor().run(plan, {"input": inp, "output": out}, count, op, codecs)


def broadcast_pickled(obj, rank: int, root: int, device: torch.device,
                      broadcast: Callable[[torch.Tensor, int], object]):
    """Rank `root`'s `obj` on every rank: its pickle's length, then the pickle as whole
    int64 elements (the dtypes collectives take), through broadcast(tensor, root) of
    `device` tensors."""
    payload = pickle.dumps(obj) if rank == root else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    broadcast(length, root)
    nbytes = int(length.item())
    words = torch.zeros(-(-nbytes // 8), dtype=torch.int64)
    if payload:
        words.view(torch.uint8)[:nbytes] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    words = words.to(device)
    if words.numel():
        broadcast(words, root)
    return pickle.loads(words.cpu().view(torch.uint8)[:nbytes].numpy().tobytes())


def init(transport: str = "mpi", executor: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT,
         **options) -> Communicator:
    """A communicator over all ranks: MPI.COMM_WORLD ("mpi") or torch.distributed
    ("gloo", "nccl"; initialized from the environment or through MPI if needed). With
    "nccl", select each rank's GPU first (torch.cuda.set_device), as torch.distributed asks.
    `options` are Communicator's: topology, ranks_per_node, nics_per_node, intra, inter."""
    if transport not in transports.TRANSPORTS:
        raise ValueError(f"transport must be one of {transports.TRANSPORTS}, got {transport!r}")
    if transport == "mpi":
        return Communicator(mpi_world(), executor=executor, timeout=timeout, **options)
    transports.check_available(transport)
    init_torch_distributed(transport, timeout)
    return Communicator(dist.group.WORLD, executor=executor, timeout=timeout, **options)
