"""The "pccl" process group: torch.distributed's collectives on pccl's algorithms.

torch hands out a Python subclass of ProcessGroup returned by a registered backend's
creator as the whole group, so every `dist.*` call on it, and FSDP2's, DDP's and
DTensor's, reaches the methods below. All-gather, reduce-scatter, all-reduce (their
tensor, list and coalesced forms) and barrier run on a pccl Communicator over MPI (the C++
executor, with `algorithm` from Options or PCCL_ALGO / PCCL_<COLLECTIVE>_ALGO, else
auto); everything else is forwarded to a companion gloo backend of the same ranks (NCCL
for CUDA tensors), made from the group's own store (FORWARDED lists it).

Why Python rather than a C++ c10d::Backend in pccl._native: the native module would have
to link libtorch and follow its C++ ABI release by release, and c10d's Python-facing
`Backend` cannot be subclassed from Python; a ProcessGroup subclass works with the torch
the project pins and adds tens of microseconds of Python per call (docs/distributed.md has
the measured figure), small beside the megabyte collectives FSDP issues.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from pccl.core.dtypes import DTYPES
from pccl.core.errors import CollectiveTimeout
from pccl.runtime.communicator import Communicator
from pccl.runtime.rendezvous import mpi_world

ReduceOp = dist.ReduceOp
# Keyed by the op's kind (a ReduceOp object in options wraps it as .op).
OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
# Operations pccl has no algorithm for: the companion backend runs them.
FORWARDED = ("broadcast", "reduce", "send", "recv", "recv_anysource", "alltoall", "alltoall_base", "scatter",
             "gather")


@dataclass
class Options:
    """The backend's options (`dist.init_process_group("pccl", pg_options=Options(...))`,
    `dist.new_group(..., pg_options=...)`). algorithm: for every collective ("auto", a flat
    name, "native", "hierarchical", "ho_ring"); per collective in `algorithms` (e.g.
    {"all_gather": "hierarchical"}). The environment's PCCL_ALGO / PCCL_<COLLECTIVE>_ALGO
    decide where these stay "auto". ranks_per_node, profile, executor: the Communicator's."""

    algorithm: str = "auto"
    algorithms: dict = field(default_factory=dict)
    ranks_per_node: Optional[int] = None
    profile: Optional[str] = None
    executor: Optional[str] = None

    def __post_init__(self):
        unknown = set(self.algorithms) - set(COLLECTIVES)
        if unknown:
            raise ValueError(f"algorithms names collectives {sorted(unknown)}; expected some of {COLLECTIVES}")

    def algorithm_for(self, collective: str) -> str:
        return self.algorithms.get(collective, self.algorithm)


def op_name(op) -> str:
    """pccl's name of a torch ReduceOp; a clear error for those pccl does not implement."""
    kind = getattr(op, "op", op)
    name = OPS.get(kind)
    if name is None:
        raise ValueError(f"the pccl backend does not implement ReduceOp.{getattr(kind, 'name', kind)}; "
                         f"it implements {', '.join(f'ReduceOp.{n.upper()}' for n in OPS.values())}")
    return name


def mpi_group(global_ranks: list[int], rank: int):
    """The MPI communicator of the group's members: torch's ranks must be MPI's."""
    world = mpi_world()
    if world.size == 1 and len(global_ranks) > 1 or world.rank != global_ranks[rank]:
        raise RuntimeError(
            f"the pccl backend runs over MPI, and torch rank {global_ranks[rank]} is MPI rank {world.rank} of "
            f"{world.size}: start the job with mpiexec or srun so that torch's ranks are MPI's "
            f"(pccl.distributed.init_process_group does the rendezvous through MPI)")
    if len(global_ranks) == world.size and global_ranks == list(range(world.size)):
        return world
    return world.Create_group(world.Get_group().Incl(global_ranks))


class Completion:
    """A torch Work that completes when all of pccl's `works` have (no thread waits: each
    work calls back from pccl's worker thread as it finishes), after `finish` (copies out
    of staging buffers), handing back `result`; pccl's timeouts surface as torch's
    DistBackendError, other errors as they are."""

    def __init__(self, works, result, finish=None):
        self.future = torch.futures.Future()
        self._result, self._finish = result, finish
        self._pending, self._error, self._lock = len(works), None, threading.Lock()
        if not works:
            self._complete()
        for w in works:
            w.add_done_callback(self._done)

    def _done(self, error) -> None:
        with self._lock:
            self._error = self._error or error
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        error = self._error
        if error is None and self._finish is not None:
            try:
                self._finish()
            except Exception as e:   # noqa: BLE001 - handed to whoever waits
                error = e
        if isinstance(error, CollectiveTimeout):
            error = dist.DistBackendError(str(error))
        if error is None:
            self.future.set_result(self._result)
        else:
            self.future.set_exception(error)

    def work(self):
        return _create_work_from_future(self.future)


class ProcessGroupPccl(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta, global_ranks: list[int],
                 options: Optional[Options] = None):
        super().__init__(rank, size)
        self.options = options or Options()
        if not isinstance(self.options, Options):
            raise TypeError(f"pg_options for the pccl backend must be pccl.distributed.Options, "
                            f"got {type(self.options).__name__}")
        self._store, self._timeout = store, timeout
        self._global = list(global_ranks) or list(range(size))
        self._companions: dict[str, object] = {}
        self._group_name = self._group_desc = ""
        self.comm = Communicator(mpi_group(self._global, rank), executor=self.options.executor,
                                 timeout=timeout.total_seconds(), ranks_per_node=self.options.ranks_per_node,
                                 profile=self.options.profile)

    def getBackendName(self) -> str:
        return "pccl"

    # torch names each group after creating it; C++'s ProcessGroup keeps the name in its
    # backends, and this group registers none, so it keeps them itself (DeviceMesh needs them).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupPccl(rank={self.rank()}, size={self.size()}, {self.comm.topology})"

    # What runs on pccl.

    def _check(self, tensor: torch.Tensor) -> None:
        if tensor.device.type not in self.comm.devices:
            raise ValueError(
                f"the pccl backend got a tensor on {tensor.device}, and its MPI path carries {self.comm.devices} "
                f"here: CUDA tensors need pccl built with a GPU path (make GPU=cuda or GPU=hip); or use "
                f"backend='nccl' for them")

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor):
        self._check(inp)
        return self.comm.all_gather(out, inp, algorithm=self.options.algorithm_for("all_gather"), async_op=True)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op):
        self._check(inp)
        return self.comm.reduce_scatter(out, inp, op=op_name(op), algorithm=self.options.algorithm_for(
            "reduce_scatter"), async_op=True)

    def _all_reduce(self, tensor: torch.Tensor, op):
        self._check(tensor)
        return self.comm.all_reduce(tensor, op=op_name(op), algorithm=self.options.algorithm_for("all_reduce"),
                                    async_op=True)

    def _carries(self, tensors) -> bool:
        """Whether pccl runs a call on these tensors: dtypes it reduces and moves (others, such
        as the uint8 of the object collectives, go to the companion)."""
        return all(t.dtype in DTYPES for t in tensors)

    def all_gather_single(self, output, input, opts=None):
        if not self._carries([input]):
            return self.companion(input.device)._allgather_base(output, input, opts)
        return Completion([self._all_gather(output, input)], [output]).work()

    def reduce_scatter_single(self, output, input, opts=None):
        if not self._carries([input]):
            return self.companion(input.device)._reduce_scatter_base(output, input, opts)
        return Completion([self._reduce_scatter(output, input, opts.reduceOp)], [output]).work()

    def allreduce(self, tensors, opts=None):
        if not self._carries(tensors):
            return self.companion(tensors[0].device).allreduce(tensors, opts)
        return Completion([self._all_reduce(t, opts.reduceOp) for t in tensors], tensors).work()

    def allgather(self, output_lists, inputs, opts=None):
        """List form: each input gathered into a contiguous buffer, then copied out."""
        if not self._carries(inputs):
            return self.companion(inputs[0].device).allgather(output_lists, inputs, opts)
        works, copies = [], []
        for outputs, inp in zip(output_lists, inputs):
            flat = torch.empty((len(outputs),) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
            works.append(self._all_gather(flat.view(-1), inp.reshape(-1)))
            copies.append((outputs, flat))
        return Completion(works, output_lists, lambda: [o.copy_(f) for outs, flat in copies
                                                       for o, f in zip(outs, flat)]).work()

    def reduce_scatter(self, outputs, input_lists, opts=None):
        """List form: each rank's blocks are laid out contiguously, then reduce-scattered."""
        if not self._carries(outputs):
            return self.companion(outputs[0].device).reduce_scatter(outputs, input_lists, opts)
        works = []
        for out, blocks in zip(outputs, input_lists):
            flat = torch.cat([b.reshape(-1) for b in blocks])
            works.append(self._reduce_scatter(out.view(-1), flat, opts.reduceOp))
        return Completion(works, outputs).work()

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return Completion([self._all_gather(o, i) for o, i in zip(outputs, inputs)], outputs).work()

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return Completion([self._reduce_scatter(o, i, opts.reduceOp) for o, i in zip(outputs, inputs)],
                          outputs).work()

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):
        """Blocks until every member arrived (a one-element ring all-reduce, on the calling thread and flat:
        it also runs at interpreter exit, when no worker thread may start)."""
        self.comm.all_reduce(torch.zeros(1), algorithm="ring")
        return Completion([], []).work()

    # What is forwarded.

    def companion(self, device: torch.device):
        """The gloo backend (NCCL for CUDA tensors) of the same ranks, made on first use from
        this group's store: the members make it together, on their first forwarded call."""
        kind = "cuda" if device.type == "cuda" else "cpu"
        if kind not in self._companions:
            store = dist.PrefixStore(f"pccl-companion-{kind}", self._store)
            if kind == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self._timeout
                backend = dist.ProcessGroupNCCL(store, self.rank(), self.size(), options)
            else:
                backend = dist.ProcessGroupGloo(store, self.rank(), self.size(), self._timeout)
            self._companions[kind] = backend
        return self._companions[kind]


def _forward(name: str):
    def forwarded(self, *args, **kwargs):
        tensor = _first_tensor(args)
        return getattr(self.companion(tensor.device if tensor is not None else torch.device("cpu")), name)(
            *args, **kwargs)

    forwarded.__name__ = name
    forwarded.__doc__ = f"{name}: not a pccl algorithm; run by the companion backend"
    return forwarded


def _first_tensor(obj) -> Optional[torch.Tensor]:
    """The first tensor in `obj`, searching lists and tuples in order."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


for _name in FORWARDED:
    setattr(ProcessGroupPccl, _name, _forward(_name))


def create(backend_options, options: Optional[Options] = None) -> ProcessGroupPccl:
    """The creator torch calls for each group (extended API: it passes the global ranks)."""
    return ProcessGroupPccl(backend_options.store, backend_options.group_rank, backend_options.group_size,
                            backend_options.timeout, list(backend_options.global_ranks_in_group), options)
