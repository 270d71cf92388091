"""The "pccl" process group: torch.distributed's collectives on pccl's algorithms.

torch hands out a Python subclass of ProcessGroup returned by a registered backend's
creator as the whole group, so every `dist.*` call on it, and FSDP2's, DDP's and
DTensor's, reaches the methods below. All-gather, reduce-scatter and all-reduce (their
tensor, list and coalesced forms; views that are not contiguous through contiguous
copies) run on a pccl Communicator (`algorithm`
from Options or PCCL_ALGO / PCCL_<COLLECTIVE>_ALGO, else auto), one per device type:

- launched by mpiexec or srun (torch's ranks are MPI's): over MPI, the C++ executor, for
  CPU tensors and, with a GPU build, CUDA tensors;
- otherwise (torchrun), and for CUDA tensors MPI cannot take: pccl's schedules and plans
  over a gloo group (CPU) or an NCCL group (CUDA) of the same ranks, made at the group's
  first collective on that device.

Everything else is forwarded to a companion gloo backend of the same ranks (NCCL for CUDA
tensors) made from the group's own store (FORWARDED lists it; barrier first waits for the
group's queued pccl work), and so are list forms of uneven sizes and dtypes pccl does not
carry.

Why Python rather than a C++ c10d::Backend in pccl._native: the native module would have
to link libtorch and follow its C++ ABI release by release, and c10d's Python-facing
`Backend` cannot be subclassed from Python; a ProcessGroup subclass works with the torch
the project pins and adds tens of microseconds of Python per call (docs/distributed.md has
the measured figure), small beside the megabyte collectives FSDP issues.
"""
from __future__ import annotations

import functools
import gc
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from pccl.core import environment
from pccl.core.dtypes import DTYPES
from pccl.core.errors import CollectiveTimeout
from pccl.core.topology import Topology
from pccl.runtime import transport_kinds
from pccl.runtime.communicator import Communicator, on_callers_stream
from pccl.runtime.rendezvous import mpi_world

ReduceOp = dist.ReduceOp
# Keyed by the value of the op's kind (a ReduceOp object in options wraps it as .op): an
# int hashes in a tenth of the time torch's enum takes, and every call asks.
OPS = {ReduceOp.SUM.value: "sum", ReduceOp.AVG.value: "avg", ReduceOp.MAX.value: "max", ReduceOp.MIN.value: "min"}
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
# Operations pccl has no algorithm for: the companion backend runs them. (barrier too: it
# also runs at interpreter exit, when pccl's worker threads may no longer start.)
FORWARDED = ("broadcast", "reduce", "send", "recv", "recv_anysource", "alltoall", "alltoall_base", "scatter",
             "gather", "barrier")


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
    transport: Optional[str] = None   # "mpi", "torch"; None: MPI where the job was launched by MPI

    def __post_init__(self):
        unknown = set(self.algorithms) - set(COLLECTIVES)
        if unknown:
            raise ValueError(f"algorithms names collectives {sorted(unknown)}; expected some of {COLLECTIVES}")
        if self.transport not in (None, "mpi", "torch"):
            raise ValueError(f"transport must be 'mpi', 'torch' or None (automatic), got {self.transport!r}")

    def algorithm_for(self, collective: str) -> str:
        return self.algorithms.get(collective, self.algorithm)


def op_name(op) -> str:
    """pccl's name of a torch ReduceOp; a clear error for those pccl does not implement."""
    kind = getattr(op, "op", op)
    name = OPS.get(getattr(kind, "value", None))
    if name is None:
        raise ValueError(f"the pccl backend does not implement ReduceOp.{getattr(kind, 'name', kind)}; "
                         f"it implements {', '.join(f'ReduceOp.{n.upper()}' for n in OPS.values())}")
    return name


def launched_by_mpi(world_size: int) -> bool:
    """Whether MPI spans the job (mpiexec, srun): its world is torch's. Under torchrun each
    process is an MPI world of its own (a singleton)."""
    return mpi_world().size == world_size


def mpi_group(global_ranks: list[int], rank: int):
    """The MPI communicator of the group's members: torch's ranks must be MPI's."""
    world = mpi_world()
    if world.rank != global_ranks[rank]:
        raise RuntimeError(
            f"the pccl backend over MPI needs torch's ranks to be MPI's, and torch rank {global_ranks[rank]} is MPI "
            f"rank {world.rank} of {world.size}: use pccl.distributed.init_process_group (the rendezvous through "
            f"MPI) or give RANK as MPI numbers it, or Options(transport='torch')")
    if global_ranks == list(range(world.size)):
        return world
    return world.Create_group(world.Get_group().Incl(global_ranks))


def is_async(opts) -> bool:
    return getattr(opts, "asyncOp", True)


def on_pccl(call, *args, **kwargs):
    """A pccl collective; its timeout, on the caller's thread, as torch's DistBackendError."""
    try:
        return call(*args, **kwargs)
    except CollectiveTimeout as e:
        raise dist.DistBackendError(str(e)) from e


class Completion:
    """A torch Work that completes when all of pccl's `works` have (no thread waits: each
    work calls back from pccl's worker thread as it finishes), after `finish` (copies out
    of staging buffers), handing back `result`; pccl's timeouts surface as torch's
    DistBackendError, other errors as they are. With GPU tensors, `finish` runs on the
    stream current for the caller when the call was made, as the collective did: the worker
    thread's own current stream is another, ordered neither after the collective nor
    before the caller's next kernels."""

    def __init__(self, works, result, finish=None):
        self.future = torch.futures.Future()
        works = [w for w in works if w is not None]   # None: a call that ran on the caller's thread
        self._works = works
        if finish is not None:
            like = _first_tensor(result)
            if like is not None:
                finish = on_callers_stream(finish, like)
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

    def work(self) -> "FutureWork":
        return FutureWork(self.future, self._works)


class FutureWork(dist.Work):
    """torch's Work over a future. (torch's own _create_work_from_future returns a Work
    whose wait() reports success even when the future failed: a timeout would be lost.)"""

    def __init__(self, future: torch.futures.Future, works=()):
        super().__init__()
        self._future, self._works = future, works   # works: pccl's, to refuse a wait that would never end

    def wait(self, timeout=None) -> bool:
        """Until the collective completes (raising its error), or `timeout` (a timedelta or
        seconds; zero or None: the collective's own) has passed: then DistBackendError, as
        gloo's Work raises. A wait in a callback on pccl's worker thread (a future's then())
        for work still queued there raises RuntimeError: it would never end."""
        if not self._future.done():
            for w in self._works:
                getattr(w, "refuse_waiting_here", lambda: None)()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 0)
        if seconds > 0:
            deadline = time.monotonic() + seconds
            while not self._future.done():
                if time.monotonic() > deadline:
                    raise dist.DistBackendError(f"pccl: the collective did not complete within {seconds:g} s")
                time.sleep(1e-3)
        self._future.wait()   # raises the collective's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list:
        """The collective's tensors, once it completed (as gloo's Work.result)."""
        self.wait()
        return self._future.value()

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            raise RuntimeError("the collective has not completed yet")
        try:
            self._future.value()
        except Exception:   # noqa: BLE001 - failure is the answer
            return False
        return True

    def exception(self):
        try:
            self._future.value()
        except Exception as e:   # noqa: BLE001 - returned, not raised
            return e
        return None


class ProcessGroupPccl(dist.ProcessGroup):
    _coalesced: Optional[list] = None   # the Works issued inside the coalescing block
    _fast = None   # the Work of the latest fast-path coalesced call (torch makes it as a block ends)

    def __init__(self, store, rank: int, size: int, timeout: timedelta, global_ranks: list[int],
                 options: Optional[Options] = None):
        super().__init__(rank, size)
        self.options = options or Options()
        if not isinstance(self.options, Options):
            raise TypeError(f"pg_options for the pccl backend must be pccl.distributed.Options, "
                            f"got {type(self.options).__name__}")
        self._store, self._timeout = store, timeout
        self._global = list(global_ranks) or list(range(size))
        self._group_name = self._group_desc = ""
        # The members are all here now: the gloo companion connects them (a later first
        # forwarded call may be a send between two of them).
        self._companions: dict[str, object] = {"cpu": dist.ProcessGroupGloo(
            dist.PrefixStore("pccl-companion-cpu", store), rank, size, timeout)}
        self._comms: dict[str, Communicator] = {}
        world = dist.get_world_size() if dist.is_initialized() else size
        self.transport = self.options.transport or ("mpi" if launched_by_mpi(world) else "torch")
        # Emulated nodes are consecutive world ranks: a sub-group gets its members' nodes.
        per_node = self.options.ranks_per_node or environment.count("PCCL_RANKS_PER_NODE")
        self._topology = Topology.regular(world, per_node).restrict(self._global) if per_node else None
        self._torch_groups: list = []   # made by _torch_group
        destroy_left_groups()
        if self.transport == "mpi":
            comm = mpi_group(self._global, rank)
            try:
                self._comms["cpu"] = self._communicator(comm)   # which duplicates it
            finally:
                if comm is not mpi_world():
                    comm.Free()

    def _communicator(self, comm) -> Communicator:
        return Communicator(comm, executor=self.options.executor if self.transport == "mpi" else None,
                            timeout=self._timeout.total_seconds(), topology=self._topology,
                            profile=self.options.profile)

    def comm_for(self, device: torch.device) -> Communicator:
        """The pccl communicator of `device`'s tensors (made at the first collective on that
        device, which every member calls; Options.transport and the module docstring say which)."""
        kind = device.type
        if kind not in self._comms:
            mpi = self._comms.get("cpu") if self.transport == "mpi" else None
            if mpi is not None and kind in mpi.devices:
                self._comms[kind] = mpi
            elif kind in ("cpu", "cuda"):
                self._comms[kind] = self._communicator(self._torch_group("gloo" if kind == "cpu" else "nccl"))
            else:
                raise ValueError(f"the pccl backend takes CPU and CUDA tensors, got a tensor on {device}")
        return self._comms[kind]

    def _torch_group(self, backend: str):
        """A torch.distributed group of these ranks over `backend`, registered under a name
        derived from this group's, which every member derives alike. (dist.new_group would
        not do: made lazily by the members alone, its names can differ between them, as
        torch numbers or hashes them from what each process has made before.)"""
        transport_kinds.check_available(backend)
        name = f"{self.group_name}:pccl-{backend}"
        group, _ = c10d._new_process_group_helper(self.size(), self.rank(), self._global, backend,
                                                  c10d._get_default_store(), name, timeout=self._timeout)
        c10d._world.pg_group_ranks[group] = {g: r for r, g in enumerate(self._global)}
        self._torch_groups.append(group)
        return group

    def _distinct_comms(self) -> list:
        """Each communicator once (over MPI, CPU and CUDA tensors share one)."""
        return list({id(c): c for c in self._comms.values()}.values())

    @property
    def comm(self) -> Communicator:
        """The communicator of CPU tensors."""
        return self.comm_for(torch.device("cpu"))

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

    def shutdown(self) -> None:
        """What dist.destroy_process_group calls: pccl's worker threads end and the companion
        backends shut down now, in order, not whenever the interpreter's exit collects them
        (a gloo backend torn down that late can abort the process). The torch groups made
        for pccl (its gloo or NCCL group, its plan levels') are destroyed as the next pccl
        group is made (destroy_left_groups): destroying every group, torch shuts them down
        itself, and destroying this one alone, it leaves them."""
        made = list(self._torch_groups)
        for comm in self._distinct_comms():
            made += comm.owned_groups()
            comm.close(groups=False)
        self._comms.clear()
        _left_groups.extend(made)
        for backend in self._companions.values():
            backend.shutdown()
        self._companions.clear()
        # A communicator sits in reference cycles (its selector's calibration, its kept calls)
        # that hold the gloo group it ran on, and with it the store whose server keeps
        # MASTER_PORT bound: a re-init on that port would wait for a collection that may not come.
        gc.collect()

    def __repr__(self) -> str:
        return f"ProcessGroupPccl(rank={self.rank()}, size={self.size()}, transport={self.transport})"

    # What runs on pccl.

    # A call the caller waits on at once (opts.asyncOp False: dist's async_op=False) runs on
    # this thread, as a direct pccl call does; an async one on pccl's worker thread.

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, opts):
        return on_pccl(self.comm_for(inp.device).all_gather, out, inp, async_op=is_async(opts),
                       algorithm=self.options.algorithm_for("all_gather"))

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, opts):
        return on_pccl(self.comm_for(inp.device).reduce_scatter, out, inp, op=op_name(opts.reduceOp),
                       async_op=is_async(opts), algorithm=self.options.algorithm_for("reduce_scatter"))

    def _all_reduce(self, tensor: torch.Tensor, opts):
        return on_pccl(self.comm_for(tensor.device).all_reduce, tensor, op=op_name(opts.reduceOp),
                       async_op=is_async(opts), algorithm=self.options.algorithm_for("all_reduce"))

    def _carries(self, tensors) -> bool:
        """Whether pccl runs a call on these tensors: dtypes it reduces and moves (others, such
        as the uint8 of the object collectives, go to the companion). Every rank decides
        alike: the ranks of a collective pass one dtype."""
        return all(t.dtype in DTYPES for t in tensors)

    def all_gather_single(self, output, input, opts=None):
        if not self._carries([input]):
            return self._companion_for(output, input)._allgather_base(output, input, opts)
        (out,), back = contiguous([output])
        return Completion([self._all_gather(out, input.contiguous(), opts)], [output], back).work()

    def reduce_scatter_single(self, output, input, opts=None):
        if not self._carries([input]):
            return self._companion_for(output, input)._reduce_scatter_base(output, input, opts)
        (out,), back = contiguous([output])
        return Completion([self._reduce_scatter(out, input.contiguous(), opts)], [output], back).work()

    def allreduce(self, tensors, opts=None):
        if not self._carries(tensors):
            return self._companion_for(tensors).allreduce(tensors, opts)
        staged, back = contiguous(tensors)
        return Completion([self._all_reduce(t, opts) for t in staged], tensors, back).work()

    def allgather(self, output_lists, inputs, opts=None):
        """List form: each input gathered into a contiguous buffer, then copied out. Outputs
        of another size than the input (which gloo refuses by name) go to the companion."""
        if not self._carries(inputs) or any(o.numel() != i.numel() for outs, i in zip(output_lists, inputs)
                                            for o in outs):
            return self._companion_for(output_lists, inputs).allgather(output_lists, inputs, opts)
        works, copies = [], []
        for outputs, inp in zip(output_lists, inputs):
            flat = torch.empty((len(outputs),) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
            works.append(self._all_gather(flat.view(-1), inp.reshape(-1), opts))
            copies.append((outputs, flat))
        return Completion(works, output_lists, lambda: [o.copy_(f.view_as(o)) for outs, flat in copies
                                                       for o, f in zip(outs, flat)]).work()

    def reduce_scatter(self, outputs, input_lists, opts=None):
        """List form: each rank's blocks are laid out contiguously, then reduce-scattered.
        Blocks of different sizes (which every rank is given alike) go to the companion: a
        pccl reduce-scatter takes one size, and only the rank whose block matched the mean
        would have started it."""
        if not self._carries(outputs) or any(b.numel() != blocks[0].numel() for blocks in input_lists
                                             for b in blocks):
            return self._companion_for(outputs, input_lists).reduce_scatter(outputs, input_lists, opts)
        staged, back = contiguous(outputs)
        works = [self._reduce_scatter(out.view(-1), torch.cat([b.reshape(-1) for b in blocks]), opts)
                 for out, blocks in zip(staged, input_lists)]
        return Completion(works, outputs, back).work()

    def allreduce_coalesced(self, tensors, opts=None):
        if not self._carries(tensors):   # (the companion's allreduce takes no coalesced options)
            return self._companion_for(tensors).allreduce_coalesced(tensors, opts)
        return self.allreduce(tensors, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if not self._carries(inputs):
            return one_by_one(self._companion_for(outputs, inputs)._allgather_base, outputs, inputs, opts)
        staged, back = contiguous(outputs)
        return Completion([self._all_gather(o, i.contiguous(), opts) for o, i in zip(staged, inputs)], outputs,
                          back).work()

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if not self._carries(inputs):
            return one_by_one(self._companion_for(outputs, inputs)._reduce_scatter_base, outputs, inputs, opts)
        staged, back = contiguous(outputs)
        return Completion([self._reduce_scatter(o, i.contiguous(), opts) for o, i in zip(staged, inputs)],
                          outputs, back).work()

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    # torch's coalescing with a device (`_coalescing_manager(device=...)`, DeepSpeed's
    # coalesced calls): the calls inside run as they are issued, in one order on every rank,
    # and torch waits on the Work _end_coalescing returns alone, so it stands for all of them:
    # those issued while torch holds the block open, and the fast-path call it makes (the
    # captured all-reduces, all-gathers, reduce-scatters) as it closes it.

    def _start_coalescing(self, device) -> None:
        # (a list left over: the last block raised, and torch never called _end_coalescing)
        self._coalesced, self._fast = [], None

    def _end_coalescing(self, device) -> "FutureWork":
        if self._coalesced is None:
            raise RuntimeError("pccl backend: coalescing ended on a group where it had not started")
        works = self._coalesced + ([self._fast] if self._fast is not None else [])
        self._coalesced, self._fast = None, None
        return all_of(works)

    # What is forwarded.

    def barrier(self, *args, **kwargs):
        """The companion's barrier, once this group's own queued collectives have run: torch's
        barrier completes after the group's earlier async work, and the companion knows
        nothing of pccl's queue."""
        for comm in self._distinct_comms():
            comm.drain()
        return _forward("barrier")(self, *args, **kwargs)

    _companion_has_alltoall = True   # until the companion says otherwise

    def alltoall(self, outputs, inputs, *rest):
        """alltoall (dist.all_to_all, the list form): forwarded; where the companion lacks that
        form (gloo in torch 2.11 raises "does not support alltoall" before sending anything), it
        runs as the single-tensor form, alltoall_base, over flattened copies."""
        if self._companion_has_alltoall:
            try:
                return _forward("alltoall")(self, outputs, inputs, *rest)
            except RuntimeError as e:
                if "does not support alltoall" not in str(e):
                    raise
                self._companion_has_alltoall = False
        tensor = _first_tensor((outputs, inputs))
        flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=tensor.dtype, device=tensor.device)
        out_sizes, in_sizes = [o.numel() for o in outputs], [t.numel() for t in inputs]
        work = self.companion(tensor.device).alltoall_base(
            flat_out, torch.cat([t.reshape(-1) for t in inputs]), out_sizes, in_sizes, *rest)

        def copy_out(future):
            future.value()   # raises the exchange's error
            for o, part in zip(outputs, flat_out.split(out_sizes)):
                o.copy_(part.view_as(o))
            return outputs
        return FutureWork(work.get_future().then(copy_out))

    def _companion_for(self, *args) -> "Staged":
        """The companion backend of the first tensor's device in `args`, staging views that
        are not contiguous (Staged): gloo reads a strided view as dense memory and writes
        outside it, and a refusal on the one rank holding a view left the others waiting."""
        tensors = list(_tensors(args))
        return Staged(self.companion(tensors[0].device if tensors else torch.device("cpu")))

    def companion(self, device: torch.device):
        """The backend forwarded calls run on: gloo, made with the group; for CUDA tensors
        NCCL, made from this group's store on first use (NCCL connects peers lazily, at
        their first operation, so a first send between two members is fine)."""
        if device.type != "cuda":
            return self._companions["cpu"]
        if "cuda" not in self._companions:
            transport_kinds.check_available("nccl")
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            self._companions["cuda"] = dist.ProcessGroupNCCL(dist.PrefixStore("pccl-companion-cuda", self._store),
                                                             self.rank(), self.size(), options)
        return self._companions["cuda"]


# The torch groups of pccl groups that were shut down. torch shuts down every group when it
# destroys them all, and only the one asked when it destroys one: there the torch groups
# made for it stay registered, each with its threads and sockets (a loop of new_group and
# destroy_process_group ran out of file descriptors after 75 turns). Here they are not
# destroyed at once, which would shut down twice those torch already shut down.
_left_groups: list = []


def destroy_left_groups() -> None:
    """Destroy the torch groups made for pccl groups shut down since the last call that
    are still registered (torch destroyed no other group: a pccl group destroyed alone)."""
    while _left_groups:
        group = _left_groups.pop()
        if group in c10d._world.pg_map:
            dist.destroy_process_group(group)


def contiguous(tensors: list) -> tuple[list, object]:
    """The tensors as pccl takes them, contiguous: where one is not (a transposed or strided
    view, which gloo takes) a contiguous copy; and what copies those back once the
    collective completes (None: nothing to). Every rank runs the call on pccl whatever its
    tensors' layout, so the ranks never split between pccl and the companion over it."""
    if all(t.is_contiguous() for t in tensors):   # the common case, without the walk
        return tensors, None
    copies = []
    staged = _staged(list(tensors), copies)
    return staged, (lambda: [t.copy_(c) for t, c in copies]) if copies else None


class Staged:
    """A companion backend whose calls take views that are not contiguous as gloo cannot:
    each such tensor is passed as a contiguous copy, written back into the view once the
    call completes (every staged tensor: an input's copy holds its own values), so every
    rank forwards the call whatever its tensors' layout, as pccl's own calls stage them."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name: str):
        method = getattr(self._backend, name)

        def call(*args, **kwargs):
            copies = []
            work = method(*_staged(args, copies), **{k: _staged(v, copies) for k, v in kwargs.items()})
            if not copies or work is None:
                return work

            def back(future):
                value = future.value()   # raises the call's error
                for view, copy in copies:
                    view.copy_(copy)
                return value
            return FutureWork(work.get_future().then(back))
        return call


def _staged(obj, copies: list):
    """`obj` (a tensor, or lists and tuples of them, nested) with each tensor that is not
    contiguous replaced by a contiguous copy, (view, copy) appended to `copies`."""
    if isinstance(obj, torch.Tensor):
        if obj.is_contiguous():
            return obj
        copies.append((obj, obj.contiguous()))
        return copies[-1][1]
    if isinstance(obj, list):
        return [_staged(item, copies) for item in obj]
    if type(obj) is tuple:
        return tuple(_staged(item, copies) for item in obj)
    return obj


def one_by_one(single, outputs, inputs, opts) -> "FutureWork":
    """A coalesced call the companion has no form of (gloo's backend object binds none) as
    its single-tensor calls, one Work over them all."""
    return all_of([single(o, i, opts) for o, i in zip(outputs, inputs)], outputs)


def all_of(works: list, result=()) -> FutureWork:
    """One Work over torch Works, complete when all are (its result `result`), failing with
    the first's error."""
    def finished(done):
        for future in done.value():
            future.value()   # raises a call's error
        return list(result)
    return FutureWork(torch.futures.collect_all([w.get_future() for w in works]).then(finished))


# What torch calls as a coalescing block closes, with the calls it captured (torch 2.11
# calls the all-gather's and reduce-scatter's "into_tensor" and "tensor" forms)
FAST_PATH = ("allreduce_coalesced", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
             "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")


def _kept_while_coalescing(method):
    """`method` (a collective returning a Work), its Work also kept for _end_coalescing:
    while torch holds this group's coalescing block open, or as a fast-path call (only the
    latest: outside a block one is no one's to wait for, and is dropped with the next)."""
    fast = method.__name__ in FAST_PATH

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        work = method(self, *args, **kwargs)
        if work is not None and self._coalesced is not None:
            if fast:
                self._fast = work
            elif self in c10d._world.pg_coalesce_state:
                self._coalesced.append(work)
        return work
    return call


def _forward(name: str):
    def forwarded(self, *args, **kwargs):
        return getattr(self._companion_for(*args), name)(*args, **kwargs)

    forwarded.__name__ = name
    forwarded.__doc__ = f"{name}: not a pccl algorithm; run by the companion backend"
    return forwarded


def _tensors(obj):
    """The tensors in `obj` (a tensor, or lists and tuples of them, nested), in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _first_tensor(obj) -> Optional[torch.Tensor]:
    return next(_tensors(obj), None)


for _name in FORWARDED:
    if _name not in vars(ProcessGroupPccl):   # alltoall has a method of its own, which forwards
        setattr(ProcessGroupPccl, _name, _forward(_name))
for _name in (*FORWARDED, "all_gather_single", "reduce_scatter_single", "allreduce", "allgather", "reduce_scatter",
              "allreduce_coalesced", "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
              "allgather_coalesced", "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
              "_allgather_base", "_reduce_scatter_base"):
    setattr(ProcessGroupPccl, _name, _kept_while_coalescing(vars(ProcessGroupPccl)[_name]))


def create(backend_options, options: Optional[Options] = None) -> ProcessGroupPccl:
    """The creator torch calls for each group (extended API: it passes the global ranks)."""
    return ProcessGroupPccl(backend_options.store, backend_options.group_rank, backend_options.group_size,
                            backend_options.timeout, list(backend_options.global_ranks_in_group), options)
