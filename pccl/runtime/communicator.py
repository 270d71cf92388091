"""The Communicator: validated collectives over one process group, any executor."""
from __future__ import annotations

import os
import pickle
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pccl.compression.codecs import per_level
from pccl.core.dtypes import op_code
from pccl.core.errors import CollectiveTimeout, during
from pccl.core.topology import Topology
from pccl.executors.plan import PlanExecutor, level_communicators
from pccl.executors.streams import StreamWork
from pccl.runtime import call_check, teardown, transport_kinds, validation
from pccl.runtime.call_check import CallCheck
from pccl.runtime.choice import Choice
from pccl.runtime.rendezvous import init_torch_distributed, mpi_world
from pccl.runtime.selector import Selector
from pccl.runtime.transport import Transport, default_timeout
from pccl.runtime.work import SerialQueue, Work
from pccl.tuning.profiles import Profile
from runkit.sizes import size_label

MAX_CACHED_CALLS = 4096   # resolved calls kept per communicator (then the cache starts over)


def compression_from_environment():
    """PCCL_COMPRESSION, the codec of calls that name none (None: no compression); read
    and checked when a communicator is made, as NCCL reads its variables (an unknown name
    failed every call instead)."""
    name = os.environ.get("PCCL_COMPRESSION", "").strip() or None
    if name is not None and name.lower() != "auto":
        try:
            per_level(name)
        except ValueError as e:
            raise ValueError(f"PCCL_COMPRESSION={name}: {e}") from None
    return name


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


def flat(t: torch.Tensor) -> torch.Tensor:
    """The 1-d view the executors and plans slice (a 1-d tensor itself: no new view),
    outside autograd: a collective writes a leaf that requires grad as every executor can
    (torch refuses in-place writes to views of one)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() == 1 else t.view(-1)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two buffers share memory (their byte ranges intersect)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def into_scratch(call: Call, output: torch.Tensor) -> Call:
    """`call` with its result reduced into a buffer of its own, then copied into `output`:
    for a reduce-scatter whose output lies in its input (in place, as NCCL allows). Not every
    path reads its input before writing its output there: MPI's own refuses the buffers, and
    HO-Ring's inter-node phase writes the output while its intra-node phase still reads it."""
    scratch = torch.empty_like(output)

    def fn(out: torch.Tensor, input: torch.Tensor):
        result = call.fn(scratch, input)
        out.copy_(scratch)
        return result
    return Call(fn, call.what, call.enqueues)


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
    communicator) and then call the same collectives in the same order. Three parts: its
    transport (pccl/runtime/transport.py: the group and executors), its selector
    (pccl/runtime/selector.py: what each call runs) and this, which checks, caches and
    issues the calls.
    """

    def __init__(self, comm, executor: Optional[str] = None, timeout: Optional[float] = None, *,
                 topology: Optional[Topology] = None, ranks_per_node: Optional[int] = None,
                 nics_per_node: Optional[int] = None, intra: Optional[str] = None,
                 inter: Optional[str] = None, profile=None, interruptible: bool = False,
                 check_calls: Optional[bool] = None):
        """comm: an mpi4py communicator, a torch.distributed group, or a transport (a dry
        run's). topology: given, or `ranks_per_node` consecutive ranks per node (emulated
        nodes), or PCCL_RANKS_PER_NODE, or detected (MPI's shared-memory split; host names
        for torch.distributed). intra/inter: each plan level's transport, "mpi", "gloo" or
        "nccl" (default: this one's own; intra="nccl", inter="mpi" is the PCCL paper's design
        on GPUs). profile: what algorithm="auto" predicts with: a Profile, a built-in name or
        a file (default: PCCL_PROFILE, else "generic", which describes no machine: auto then
        runs the transport's own collective until a measurement says otherwise, and
        communicators of two ranks or more over MPI or gloo measure at first use,
        pccl.tuning.self_calibration); rank 0's is used by all. interruptible: auto never
        takes MPI's blocking collectives, which a dead peer leaves to the watchdog's abort,
        but their nonblocking forms ("native_nonblocking", polled like pccl's schedules), so
        that every collective auto runs times out with a CollectiveTimeout naming what it
        waited for, as the training engine promises; so do the plans' "native" phases on its
        level communicators (Selector.own_native); algorithm="native" still runs the
        blocking ones. check_calls: before each call the ranks compare what they call, and a
        mismatch raises CallMismatch on every rank (default: PCCL_CHECK_CALLS=1;
        pccl/runtime/call_check.py)."""
        # a transport is anything that runs choices: a Transport, a dry run's RecordingTransport
        self.carrier = carrier = comm if hasattr(comm, "runs") else Transport(comm, executor, timeout)
        self.rank, self.size, self.transport, self.backend = carrier.rank, carrier.size, carrier.name, carrier.backend
        self.executor, self.timeout, self.devices = carrier.executor, carrier.timeout, carrier.devices
        self.group, self.mpi_comm = carrier.group, carrier.mpi_comm
        # What the ranks find and agree on, in this order on every rank (detecting the
        # topology and taking rank 0's profile are collective calls).
        self.topology = carrier.topology(topology, ranks_per_node, nics_per_node)
        self.level_transports = {"intra": intra or self.backend, "inter": inter or self.backend}
        profile, chosen = (profile, True) if isinstance(profile, Profile) else carrier.agreed_profile(profile)
        self.interruptible = interruptible
        self.selector = Selector(self.topology, profile, self.level_transports, carrier, interruptible,
                                 trust_native=not chosen)
        self.label = ""   # what a failure message calls it ("inter-node level"); empty: the communicator
        self.default_compression = compression_from_environment()
        self._calls: dict[tuple, Call] = {}
        self._calls_version = self.selector.version
        self._queue = SerialQueue(f"pccl-{self.transport}")
        self._plans: Optional[PlanExecutor] = None
        self.call_check = CallCheck(self) if call_check.wanted(check_calls) else None
        self.selector.calibrate_with(self)
        if self.selector.tuner.plans_apply and carrier.levels_made_at_once(self.level_transports):
            self._plan_executor()

    def _plan_executor(self) -> PlanExecutor:
        """The executor of the plans over this communicator's level communicators (made at
        first use, or with it where they are torch groups: collective over it)."""
        if self._plans is None:
            self._plans = PlanExecutor(level_communicators(self))
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
        if self._queue.closed:
            raise RuntimeError("pccl: split of a communicator that was closed: make a new one")
        groups = [list(g) for g in groups]
        plain = all(g and all(type(r) is int for r in g) for g in groups)   # (not 1.0, True, numpy's integers)
        if not plain or sorted(r for g in groups for r in g) != list(range(self.size)):
            raise ValueError(f"groups must be non-empty lists of int ranks holding each rank 0..{self.size - 1} "
                             f"exactly once, got {groups}")
        transport = transport or self.backend
        # An interruptible communicator finds a dead peer before MPI_Comm_split, which blocks for good.
        child = self.carrier.split(groups, transport, self.barrier if self.interruptible else None)
        members = next(g for g in groups if self.rank in g)
        # A torch child cannot run MPI levels: those become its own backend.
        levels = {level: child.backend if t == "mpi" and child.name != "mpi" else t
                  for level, t in self.level_transports.items()}
        # A profile chosen for the parent is the child's; else the child decides (and measures) for
        # its own shape.
        return Communicator(child, topology=self.topology.restrict(members), **levels, interruptible=self.interruptible,
                            profile=None if self.selector.trust_native else self.selector.profile,
                            check_calls=self.call_check is not None)

    def choose(self, collective: str, algorithm, like: torch.Tensor, codec=None, op: Optional[str] = None) -> Choice:
        """What a call of `collective` on the full buffer `like` runs (Selector.choose),
        with `codec` and reduction `op` as the call's: decided once, measured first where
        auto measures (collective, as the call is)."""
        return self.selector.choose(collective, algorithm, like, codec, op)

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, transport={self.backend!r}, "
                f"executor={self.executor!r}, {self.topology.describe()})")

    def _codecs(self, compression, like: torch.Tensor, collective: str, algorithm,
                op: Optional[str] = None) -> tuple[dict, object]:
        """({level: codec}, algorithm) of a call (Selector.codecs), None compression being
        this communicator's default. The default, and "auto" however given, compress
        gathers, sums and averages only: a codec's error is additive, and max and min would
        lose what they promise (a NaN spreads over its codec group, zeros lose their sign,
        a maximum moves by the codec's error)."""
        exact = op not in (None, "sum", "avg")
        default = None if exact else self.default_compression
        return self.selector.codecs(compression, like, collective, algorithm, default, self.carrier.gpu_codecs,
                                    exact)

    def _cached(self, head: Optional[tuple], *buffers) -> tuple[Optional[tuple], Optional[Call]]:
        """(key, the call resolved before for it or None); key None: not cacheable (buffers
        call_key refuses, an unhashable algorithm or compression: a per-level dict)."""
        if self._calls_version != self.selector.version:   # decided with another profile since
            self._calls.clear()
            self._calls_version = self.selector.version
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
        """What runs a validated call: the selector's choice, run by the transport."""
        with self.call_check.paused() if self.call_check else nullcontext():   # a calibration's calls
            choice = self.selector.choose(collective, algorithm, like, codecs, op)
        fn = self.carrier.runs(choice, op, codecs, self._plan_executor)
        algorithm, nbytes = choice.algorithm, choice.nbytes
        dtype = str(like.dtype).removeprefix("torch.")   # not `like`: a kept call must not keep its buffers
        what = lambda: (f"{self.label}{collective.replace('_', '-')} ({algorithm}, {size_label(nbytes)} bytes of "  # noqa: E731
                        f"{dtype})")
        return Call(fn, what, self.queues_on_device(like.device.type))

    def _issue(self, call: Call, async_op: bool, *buffers: torch.Tensor) -> Optional[Work]:
        """Run `call` on the (flat) buffers after what is queued: at once on this thread
        where it is synchronous and nothing is queued. One thread issues at a time."""
        self._queue.enter(call.what)
        try:
            return self._issue_now(call, async_op, *buffers)
        finally:
            self._queue.leave()

    def _issue_now(self, call: Call, async_op: bool, *buffers: torch.Tensor) -> Optional[Work]:
        if not async_op and self._queue.idle() and not buffers[0].is_cuda and not self._queue.on_worker():
            # the common case, without closures
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
        NCCL plan levels; a dry run's return at once) and return. Those are issued on the
        calling thread, async or not, in program order: NCCL needs every rank to launch its
        operations on all its communicators in one order (a kernel waiting for peers can
        block another), which worker threads would not keep."""
        return self.carrier.only_enqueues(device, self.level_transports)

    def uses_nccl(self) -> bool:
        """Whether any of its transports (its own or a plan level's) is NCCL."""
        return any("nccl" in t for t in (self.backend, *self.level_transports.values()))

    def owned_groups(self) -> list:
        """The torch groups close() destroys: those it made for itself and its plan levels."""
        mine = [self.carrier.group] if getattr(self.carrier, "owns_group", False) else []
        levels = self._plans.levels.values() if self._plans is not None else ()
        return mine + [g for level in levels for g in level.owned_groups()]

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
        self.carrier.close(groups)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algorithm: str = "auto",
                   async_op: bool = False, compression=None) -> Optional[Work]:
        """Gather every rank's `input` into `output`: rank i's input lands at block i.
        compression: a codec ("int8", "bf16", "fp16", "zfp:8"; pccl.compression.codecs),
        or per plan level {"intra": ..., "inter": ...}, or "auto" (the cost model chooses
        a codec, or none, with the algorithm); each block is encoded once, by its owner, and
        every rank's output is the same decoding."""
        if self.call_check:
            self.call_check.agree("all_gather", algorithm, None, input, compression)
        key, call = self._cached(("all_gather", algorithm, compression), output, input)
        if call is None:
            validation.check_blocks(output, input, "output", self.size, self.devices)
            codecs, resolved = self._codecs(compression, output, "all_gather", algorithm)
            call = self._prepare("all_gather", resolved, output, codecs)
            self._keep(key, call)
        output, input = flat(output), flat(input)
        if overlap(output, input) and input.data_ptr() != output[self.rank * input.numel():].data_ptr():
            input = input.clone()   # a partial overlap: read from a copy (in place, at block rank, every path handles)
        return self._issue(call, async_op, output, input)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       algorithm: str = "auto", async_op: bool = False, compression=None) -> Optional[Work]:
        """Reduce `input` over all ranks; this rank receives block `rank` in `output`.
        compression: as all_gather's; partial sums are encoded at each step."""
        if self.call_check:
            self.call_check.agree("reduce_scatter", algorithm, op, input, compression)
        key, call = self._cached(("reduce_scatter", algorithm, op, compression), output, input)
        if call is None:
            validation.check_blocks(output, input, "input", self.size, self.devices)
            op_code(op, input.dtype)
            codecs, resolved = self._codecs(compression, input, "reduce_scatter", algorithm, op)
            call = self._prepare("reduce_scatter", resolved, input, codecs, op)
            self._keep(key, call)
        output, input = flat(output), flat(input)
        if overlap(output, input):
            call = into_scratch(call, output)
        return self._issue(call, async_op, output, input)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
                   async_op: bool = False, compression=None) -> Optional[Work]:
        """Reduce `tensor` over all ranks, in place. compression: as all_gather's."""
        if self.call_check:
            self.call_check.agree("all_reduce", algorithm, op, tensor, compression)
        key, call = self._cached(("all_reduce", algorithm, op, compression), tensor)
        if call is None:
            validation.check_tensor("tensor", tensor, self.devices)
            op_code(op, tensor.dtype)
            codecs, resolved = self._codecs(compression, tensor, "all_reduce", algorithm, op)
            call = self._prepare("all_reduce", resolved, tensor, codecs, op)
            self._keep(key, call)
        return self._issue(call, async_op, flat(tensor))

    # Broadcast and barrier: the transport's own (MPI's, torch.distributed's). Nothing in
    # training moves bulk data from one rank, so pccl schedules none: these carry a run's
    # agreements (rank 0's settings, paths, cache entries) and its rendezvous.

    def broadcast(self, tensor: torch.Tensor, root: int = 0, algorithm: str = "auto",
                  async_op: bool = False) -> Optional[Work]:
        """Rank `root`'s `tensor` on every rank, in place (the others' values are
        overwritten); every rank passes a tensor of the same dtype and size."""
        validation.check_root(root, self.size)   # first: 1.0 and True hash as 1 in the call cache
        key, call = self._cached(("broadcast", algorithm, root), tensor)
        if call is None:
            validation.check_tensor("tensor", tensor, self.devices)
            form = self.selector.native_form("broadcast", algorithm)
            fn = self.carrier.broadcasts(root, form)
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
        # small agreements travel in host memory, or the current GPU's where this carries only GPU buffers (NCCL)
        device = torch.device("cpu") if "cpu" in self.devices else torch.device("cuda", torch.cuda.current_device())
        return broadcast_pickled(obj, self.rank, root, device, self.broadcast)

    def barrier(self, algorithm: str = "auto") -> None:
        """Return once every rank has called it, after this rank's queued collectives."""
        form = self.selector.native_form("barrier", algorithm)
        what = lambda: f"{self.label}barrier ({form})"  # noqa: E731
        self._queue.enter(what)
        try:
            self._queue.run(naming_failures(self.carrier.barriers(form), what), async_op=False)
        finally:
            self._queue.leave()


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


def init(transport: str = "mpi", executor: Optional[str] = None, timeout: Optional[float] = None,
         **options) -> Communicator:
    """A communicator over all ranks: MPI.COMM_WORLD ("mpi") or torch.distributed
    ("gloo", "nccl"; initialized from the environment or through MPI if needed). With
    "nccl", select each rank's GPU first (torch.cuda.set_device), as torch.distributed asks.
    `options` are Communicator's: topology, ranks_per_node, nics_per_node, intra, inter,
    profile, interruptible, check_calls."""
    if transport not in transport_kinds.TRANSPORTS:
        raise ValueError(f"transport must be one of {transport_kinds.TRANSPORTS}, got {transport!r}")
    if transport == "mpi":
        return Communicator(mpi_world(), executor=executor, timeout=timeout, **options)
    transport_kinds.check_available(transport)
    timeout = default_timeout() if timeout is None else timeout
    init_torch_distributed(transport, timeout)
    return Communicator(dist.group.WORLD, executor=executor, timeout=timeout, **options)
