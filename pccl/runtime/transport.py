"""The transport part of a communicator: what carries its data.

An MPI communicator (pccl's C++ executor, or the Python reference executor, beside the
native module's MPI collectives) or a torch.distributed group (gloo, NCCL). It makes the
executors, finds the topology, carries the agreements a communicator makes before it can
call collectives (rank 0's profile), runs what the selector chose, and splits and closes.
A dry run's transport (pccl/runtime/dry_run.py) moves nothing and records what it is given.
"""
from __future__ import annotations

import dataclasses
import os
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pccl import plans
from pccl.algorithms import NATIVES, schedule
from pccl.core import environment
from pccl.core.topology import Topology, TopologyError
from pccl.executors.plan import PlanExecutor
from pccl.executors.torch_p2p import TorchP2PExecutor
from pccl.runtime import transport_kinds
from pccl.runtime.choice import Choice
from pccl.runtime.detect import detect, detect_torch
from pccl.runtime.rendezvous import init_torch_distributed
from pccl.tuning.profiles import Profile, from_environment
from pccl.tuning.profiles import load as load_profile

DEFAULT_TIMEOUT = 300.0   # seconds, where neither timeout= nor PCCL_TIMEOUT says


def default_timeout() -> float:
    """PCCL_TIMEOUT, read when a communicator is made (not at import: a bad value would
    break `import pccl`), else DEFAULT_TIMEOUT."""
    return environment.seconds("PCCL_TIMEOUT", DEFAULT_TIMEOUT)
EXECUTORS = {"mpi": ("cpp", "python"), "torch": ("torch",)}


def _thread_level_names(MPI) -> dict[int, str]:
    return {getattr(MPI, f"THREAD_{name}"): f"MPI_THREAD_{name}"
            for name in ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")}


class Transport:
    """Over an mpi4py communicator (executor "cpp" or "python") or a torch.distributed
    process group (executor "torch"). Fields: rank, size, name ("mpi" or "torch"), backend
    ("mpi", "gloo", "nccl"...), executor, timeout, group, mpi_comm, devices (the buffers
    it carries), gpu_codecs (whether it runs the native codecs on GPU buffers)."""

    def __init__(self, comm, executor: Optional[str] = None, timeout: Optional[float] = None):
        timeout = default_timeout() if timeout is None else timeout
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.owns_group = False   # a torch group made by split, destroyed by close
        self._compressed = None   # the executor of compressed schedules, where it is not runner
        if isinstance(comm, dist.ProcessGroup):
            self.name = "torch"
            self.group, self.mpi_comm = comm, None
            self.backend = dist.get_backend(comm)
            self.executor = self._check_executor(executor or "torch")
            self.runner = self.native = TorchP2PExecutor(comm, self.timeout)
            self.gpu_mpi = False
            self.devices = transport_kinds.devices_of(self.backend)
        else:
            # MPI and the native module load only for MPI communicators: a torch.distributed
            # run needs neither.
            from mpi4py import MPI

            from pccl.executors.mpi_cpp import MpiCppExecutor, gpu_available
            from pccl.executors.mpi_python import MpiPythonExecutor

            if not isinstance(comm, MPI.Comm):
                raise TypeError(f"comm must be an mpi4py.MPI.Comm or a torch.distributed.ProcessGroup, "
                                f"got {type(comm).__name__}")
            transport_kinds.check_thread_level(MPI.Query_thread(), _thread_level_names(MPI))
            self.name = self.backend = "mpi"
            self.group, self.mpi_comm = None, comm.Dup()  # for sub-communicators and detection
            self.executor = self._check_executor(executor or "cpp")
            self.native = MpiCppExecutor(comm, self.timeout)
            self.runner = MpiPythonExecutor(comm, self.timeout) if self.executor == "python" else self.native
            self.gpu_mpi = self.executor == "cpp" and gpu_available()
            self.devices = transport_kinds.devices_of("mpi", self.gpu_mpi)
        self.rank, self.size = self.native.rank, self.native.size
        self.gpu_codecs = self.name == "torch"

    def _check_executor(self, executor: str) -> str:
        valid = EXECUTORS[self.name]
        if executor not in valid:
            raise ValueError(f"executor {executor!r} does not run on transport {self.name!r}; "
                             f"expected one of {valid}")
        return executor

    def plan_devices(self, level_transports: dict[str, str]) -> tuple[str, ...]:
        """The devices a two-level plan over `level_transports` takes: those both of its
        levels carry (each level checked: a known transport this one can make)."""
        level_devices = []
        for level, transport in level_transports.items():
            if transport not in transport_kinds.TRANSPORTS and transport != self.backend:
                raise ValueError(f"{level} must be one of {transport_kinds.TRANSPORTS}, got {transport!r}")
            if transport == "mpi" and self.name != "mpi":
                raise ValueError(f"{level}='mpi' needs a Communicator built on an mpi4py communicator")
            transport_kinds.check_available(transport)
            level_devices.append(transport_kinds.devices_of(transport, self.gpu_mpi))
        return tuple(d for d in level_devices[0] if d in level_devices[1])

    def gpu_type(self, device: str) -> dict:
        """What the self-calibration of `device` buffers ("cuda": CUDA or HIP) depends on
        beyond the host: the GPU's model, how many a rank sees, and how MPI moves their
        memory (GPU-aware, or staged through pinned host memory)."""
        from pccl.executors.mpi_cpp import gpu_aware_mpi

        return {"type": device, "gpu": torch.cuda.get_device_name(), "visible": torch.cuda.device_count(),
                "mpi": "GPU-aware" if gpu_aware_mpi() else "staged"}

    def agreed_profile(self, name) -> tuple[Profile, bool]:
        """(rank 0's profile, whether it was chosen: named, or by PCCL_PROFILE), or rank 0's
        error, on every rank, so every rank decides alike."""
        mine = None
        if self.rank == 0:
            try:
                mine = ((load_profile(name) if name else from_environment()).to_dict(),
                        bool(name or os.environ.get("PCCL_PROFILE")))
            except Exception as e:   # any: the other ranks wait in the broadcast below for it
                mine = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        # before the communicator can broadcast (it needs the profile): the transport's own
        # object broadcast (over MPI, mpi4py's on the duplicate, apart from the executors';
        # a timeout here could not be named anyway)
        if self.mpi_comm is not None:
            agreed = self.mpi_comm.bcast(mine, root=0)
        else:
            box = [mine]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            agreed = box[0]
        if isinstance(agreed, str):
            raise ValueError(f"machine profile on rank 0: {agreed}")
        return Profile.from_dict(agreed[0]), agreed[1]

    def topology(self, topology: Optional[Topology], ranks_per_node: Optional[int],
                 nics_per_node: Optional[int]) -> Topology:
        """Given, or `ranks_per_node` consecutive ranks per node, or PCCL_RANKS_PER_NODE, or
        detected (collective)."""
        if topology is not None:
            if topology.size != self.size:
                raise TopologyError(f"topology has {topology.size} ranks but the communicator {self.size}")
            return topology
        ranks_per_node, nics_per_node, per_group = self._agreed_shape(ranks_per_node, nics_per_node)
        if ranks_per_node is not None:
            found = Topology.regular(self.size, ranks_per_node, nics_per_node or 1)
        elif self.mpi_comm is not None:
            found = detect(self.mpi_comm, nics_per_node)
        else:
            found = detect_torch(self.group, nics_per_node)
        # Network groups are not detected: the job's placement on them is the scheduler's.
        return dataclasses.replace(found, nodes_per_group=per_group) if per_group else found

    def _agreed_shape(self, ranks_per_node: Optional[int], nics_per_node: Optional[int]) -> tuple:
        """(ranks per node, NICs per node, nodes per group) as given or from PCCL_*, the same
        on every rank, or TopologyError on every rank naming each rank's (collective): ranks
        that read them otherwise (an environment set on some nodes only) would build other
        topologies, or some would detect while others did not, and then wait on each other."""
        try:
            mine = (ranks_per_node or environment.count("PCCL_RANKS_PER_NODE"),
                    nics_per_node or environment.count("PCCL_NICS_PER_NODE"),
                    environment.count("PCCL_NODES_PER_GROUP"))
        except ValueError as e:
            mine = str(e)
        if self.mpi_comm is not None:
            every = self.mpi_comm.allgather(mine)
        else:
            every = [None] * self.size
            dist.all_gather_object(every, mine, group=self.group)
        if len(set(every)) > 1 or isinstance(mine, str):
            held: dict = {}
            for r, shape in enumerate(every):
                held.setdefault(shape, []).append(r)
            shapes = "; ".join(
                f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs[:4]))}{' ...' * (len(rs) > 4)}: "
                + (shape if isinstance(shape, str) else
                   "ranks_per_node={}, nics_per_node={}, nodes_per_group={}".format(*shape))
                for shape, rs in held.items())
            raise TopologyError(f"the ranks do not agree on the node layout (given, or PCCL_RANKS_PER_NODE, "
                                f"PCCL_NICS_PER_NODE, PCCL_NODES_PER_GROUP): {shapes}")
        return mine

    def spans_world(self) -> bool:
        """Whether it holds every rank, as a torch.distributed group must be created from
        (new_group, and pccl's rendezvous through MPI, are collective over all)."""
        if self.mpi_comm is not None:
            from mpi4py import MPI

            return self.size == MPI.COMM_WORLD.size
        return self.size == dist.get_world_size()

    def plans_buildable(self, level_transports: dict[str, str]) -> bool:
        """torch.distributed level groups (gloo, NCCL) can only be made from a communicator
        over all ranks."""
        return not any(map(transport_kinds.uses_torch, level_transports.values())) or self.spans_world()

    def levels_made_at_once(self, level_transports: dict[str, str]) -> bool:
        """Whether a communicator makes its plan levels when it is made: torch.distributed
        groups must be created in one global order on every rank, so on the constructing
        thread, not at a first plan call on whichever worker thread (the engine's two
        lanes) gets there first."""
        return any(map(transport_kinds.uses_torch, level_transports.values()))

    def only_enqueues(self, device: str, level_transports: dict[str, str]) -> bool:
        """Whether collectives on `device` tensors only queue work on GPU streams: NCCL's,
        with NCCL plan levels (Communicator.queues_on_device)."""
        return device == "cuda" and self.name == "torch" and all(
            "nccl" in t for t in (self.backend, *level_transports.values()))

    def runs(self, choice: Choice, op: str, codecs: dict, plan_executor: Callable[[], PlanExecutor]):
        """fn(*flat buffers) running `choice`: the transport's own collective, a schedule on
        an executor, or a plan on the plan executor (plan_executor(): made at first use)."""
        collective, algorithm = choice.collective, choice.algorithm
        if not isinstance(algorithm, str):
            plan = plans.build(algorithm, collective, choice.topology, choice.rank)  # validates the spec
            return partial(_run_plan, collective, plan, plan_executor, op, codecs)
        if algorithm in NATIVES:
            if codecs:
                raise ValueError(f"compression runs inside pccl's schedules; {algorithm!r} is the transport's own "
                                 "collective: choose a schedule, a plan or auto")
            return self._unless_broken(partial(_run_native, collective, self.native, op,
                                               algorithm == "native_nonblocking"))
        sched = schedule(collective, algorithm, self.size, self.rank)
        codec = codecs.get("flat")
        runner = self._compressing(codec) if codec is not None else self.runner
        return partial(_run_schedule, collective, sched, runner, op, codec)

    def _compressing(self, codec):
        """The executor of schedules compressed with `codec`: the runner where it takes the
        codec (the C++ executor takes the native codecs), else the Python reference loop
        over a duplicate of the MPI communicator (made at first use: every rank makes the
        same calls)."""
        if self.runner.takes(codec):
            return self.runner
        if self._compressed is None:
            from pccl.executors.mpi_python import MpiPythonExecutor

            self._compressed = MpiPythonExecutor(self.mpi_comm, self.timeout)
        return self._compressed

    def broadcasts(self, root: int, form: str) -> Callable[[torch.Tensor], None]:
        fn = partial(self.native.native_broadcast, root=root)
        return self._unless_broken(partial(fn, polled=True) if form == "native_nonblocking" else fn)

    def barriers(self, form: str) -> Callable[[], None]:
        return self._unless_broken(partial(self.native.native_barrier, polled=True) if form == "native_nonblocking"
                                   else self.native.native_barrier)

    def _unless_broken(self, fn: Callable) -> Callable:
        """fn, refused once a Python executor of this transport broke (a timeout, an MPI
        error): the C++ executor that runs MPI's own collectives keeps its own state, and
        the communicator is unusable as a whole, as on every other executor."""
        if self.runner is self.native and self.name == "mpi":
            return fn

        def checked(*args, **kwargs):
            if getattr(self.runner, "broken", False) or getattr(self._compressed, "broken", False):
                raise RuntimeError("pccl: an earlier collective on this communicator timed out or failed and its "
                                   "message state is unknown; create a new communicator")
            return fn(*args, **kwargs)
        return checked

    def split(self, groups: list[list[int]], transport: str,
              barrier: Optional[Callable[[], None]] = None) -> "Transport":
        """The transport of this rank's group of `groups` (a checked partition), over
        `transport` ("mpi", "gloo", "nccl"), with this one's executor and timeout; barrier(),
        where given, runs first: MPI_Comm_split blocks for good on a dead peer. Collective."""
        transport_kinds.devices_of(transport)   # a known transport, or ValueError
        transport_kinds.check_available(transport)
        index = next(i for i, g in enumerate(groups) if self.rank in g)
        members = groups[index]
        if transport == "mpi":
            if self.name != "mpi":
                raise ValueError("an 'mpi' sub-communicator needs a Communicator built on an mpi4py communicator")
            if barrier is not None:
                barrier()
            from pccl.executors.mpi_python import free_mpi

            split = self.mpi_comm.Split(index, members.index(self.rank))
            try:
                return Transport(split, self.executor, self.timeout)   # which duplicates it
            finally:
                free_mpi(split)
        if not self.spans_world():
            raise ValueError(f"{transport} sub-communicators need a parent over all ranks; this one has {self.size}")
        unordered = [g for g in groups if list(g) != sorted(g)]
        if unordered:   # torch's new_group numbers a group's members in rank order, whatever order is asked
            raise ValueError(f"{transport} sub-communicators number their members in rank order: groups "
                             f"{unordered} would not get the ranks asked; give each group in ascending order")
        world = self.world_ranks()
        init_torch_distributed(transport, self.timeout, same_backend=False)
        mine = None
        for ranks in groups:
            group = dist.new_group([world[r] for r in ranks], backend=transport)
            if self.rank in ranks:
                mine = group
        # Every member takes part in the group's first operation, as torch requires of a
        # first batch_isend_irecv on NCCL (a schedule step may leave some ranks idle).
        dist.barrier(group=mine)
        child = Transport(mine, timeout=self.timeout)
        child.owns_group = True
        return child

    def world_ranks(self) -> list[int]:
        """The global (world) rank of each rank of this transport."""
        if self.name == "torch":
            return list(self.native.global_rank)  # the torch executor's map, computed once
        from mpi4py import MPI

        return self.mpi_comm.allgather(MPI.COMM_WORLD.rank)

    def close(self, groups: bool = True) -> None:
        """Destroy the torch group it owns (groups=False while torch is destroying every
        group itself), and free the MPI communicators it duplicated: an MPI library holds a
        few thousand (MPICH 2,048), and a process that made and closed communicators ran out."""
        if groups and self.owns_group and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.owns_group = False
        for executor in {id(e): e for e in (self.runner, self._compressed) if e is not None}.values():
            if hasattr(executor, "release"):
                executor.release()
        if self.mpi_comm is not None:
            from pccl.executors.mpi_python import free_mpi

            free_mpi(self.mpi_comm)
            self.mpi_comm = None


# What a chosen call runs, on the flat buffers: (output, input), or (tensor,) for all_reduce.

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
