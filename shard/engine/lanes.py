"""The engine's communication: two ordered lanes, one for parameter gathers and one for
gradient reductions (as FSDP's all-gather and reduce-scatter streams), so a prefetch never
queues behind a reduction. Each lane owns its communicators (world, and where the strategy
has I scopes, its group and its inter-group peers), so the lanes run concurrently and
every communicator still sees the same sequence of collectives on every rank.

Scope changes are one or two collectives (PaRO, Figures 1-3): I <-> full inside the group,
G <-> I across groups, G <-> full over the world (or both steps when G shards nest in I
shards). The ledger counts the bytes each collective sends from this rank, read off the
schedule or plan it runs (pccl.analysis.traffic), split into intra-group and inter-group traffic.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Callable, Optional

import torch
from torch.profiler import record_function

from pccl import SerialQueue, SideStream, Work
from shard.engine.config import algorithm_for
from shard.engine.shard_layout import ShardLayout
from shard.engine.strategy import Scope
from shard.engine.trace import StepTrace, TracedCall

STAGES = ("forward", "backward", "update")


def profiling() -> bool:
    """Whether torch.profiler records now (shard/tools/profiling.py). Its module's flag: a
    profile that traces every thread leaves torch.autograd._profiler_enabled() false."""
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", False) or torch.autograd._profiler_enabled()


class Ledger:
    """Bytes this rank sent per stage (intra-group, inter-group), seconds each lane was
    busy, seconds the caller waited for communication (the exposed part), and the longest
    single wait with what it waited for (a straggler shows there); and apart, seconds it
    waited for lane tasks that communicated nothing (a copy or a cast on the lane's thread,
    such as a scope of one rank makes), with the longest such wait."""

    def __init__(self, layout: ShardLayout):
        self.layout = layout
        self.sent = {stage: {"intra": 0, "inter": 0} for stage in STAGES}
        self.busy: dict[str, float] = {}
        self.exposed = 0.0
        self.longest_wait: tuple[float, str] = (0.0, "")
        self.other = 0.0
        self.longest_other: tuple[float, str] = (0.0, "")
        self._lock = threading.Lock()
        self._cache: dict = {}

    def record(self, stage: str, comm, members: list[int], choice) -> None:
        """Count the bytes a collective's choice (pccl's Choice, on `comm`, whose rank i is
        world rank members[i]) sends, as intra-group or inter-group."""
        key = (id(comm), choice.collective, repr(choice.algorithm), choice.count, choice.dtype, repr(choice.codec))
        split = self._cache.get(key)
        if split is None:
            split = {"intra": 0, "inter": 0}
            for peer, nbytes in choice.sent().items():
                split["intra" if self.layout.same_group(members[peer]) else "inter"] += nbytes
            self._cache[key] = split
        with self._lock:
            for kind, nbytes in split.items():
                self.sent[stage][kind] += nbytes

    def add_busy(self, lane: str, seconds: float) -> None:
        with self._lock:
            self.busy[lane] = self.busy.get(lane, 0.0) + seconds

    def add_exposed(self, seconds: float, what: str) -> None:
        with self._lock:
            self.exposed += seconds
            if seconds > self.longest_wait[0]:
                self.longest_wait = (seconds, what)

    def add_other(self, seconds: float, what: str) -> None:
        with self._lock:
            self.other += seconds
            if seconds > self.longest_other[0]:
                self.longest_other = (seconds, what)

    def reset(self) -> None:
        with self._lock:
            for stage in STAGES:
                self.sent[stage] = {"intra": 0, "inter": 0}
            self.busy.clear()
            self.exposed = self.other = 0.0
            self.longest_wait = self.longest_other = (0.0, "")


class Handle:
    """A lane task; wait() blocks until it is queued on the device (done, on CPU; `work`
    None: it already is), orders the caller's GPU stream after it without blocking the
    CPU, and counts the time spent waiting for `what` as exposed communication, or, when
    the task sent nothing (`sent[0]` false once it ran), as another wait."""

    def __init__(self, work: Optional[Work], side: Optional[SideStream], done: list, ledger: Ledger,
                 traced: Optional[tuple[StepTrace, int]] = None, what: str = "", sent: Optional[list] = None,
                 profiled: bool = False):
        self._work, self._side, self._done, self._ledger, self._what = work, side, done, ledger, what
        self._traced, self._sent = traced, sent if sent is not None else [True]
        self._profiled = profiled   # under torch.profiler: the wait is a span "wait: <what>"
        self._waited = False

    def wait(self) -> None:
        self._wait(settle=False)

    def settle(self) -> None:
        """wait(), and on a GPU also block the CPU until the task's device work is done,
        so that the memory it used is free again (the engine bounds the gradient buffers
        in flight so, where the CPU would otherwise queue every unit's ahead of the link)."""
        self._wait(settle=True)

    def _wait(self, settle: bool) -> None:
        if self._waited:
            return
        if self._traced is not None:
            self._traced[0].wait(self._traced[1])
        start = time.perf_counter()
        with record_function(f"wait: {self._what}") if self._profiled else nullcontext():
            if self._work is not None:
                self._work.wait()
            if self._side is not None:
                if settle:
                    self._done[0].synchronize()
                self._side.wait(self._done[0])
        seconds = time.perf_counter() - start
        (self._ledger.add_exposed if self._sent[0] else self._ledger.add_other)(seconds, self._what)
        self._waited = True


def shared_queue(comm, device: torch.device) -> Optional[SerialQueue]:
    """The one queue both lanes use where NCCL levels run under MPI (see Lane); else None."""
    if device.type == "cuda" and comm.uses_nccl() and not comm.queues_on_device("cuda"):
        return SerialQueue("shard-lanes")
    return None


class Lane:
    """Where the lane's tasks run: on GPUs whose communicators only queue device work
    (NCCL), on the calling thread at submission, in program order, each on the lane's
    stream (comm.queues_on_device says why); otherwise on a worker thread, the lane's own
    or, given `queue`, one shared with the other lane (NCCL levels under MPI: one thread
    launches all NCCL work, so every rank launches it in the same order)."""

    def __init__(self, name: str, comm, layout: ShardLayout, levels: bool, algorithm, ledger: Ledger,
                 device: torch.device, queue: Optional[SerialQueue] = None):
        self.name, self.layout, self.ledger, self.algorithm = name, layout, ledger, algorithm
        everyone = list(range(layout.world))
        self.comms = {"world": (comm.split([everyone]), everyone)}
        if levels:
            for level, groups in (("group", layout.group_members()), ("cross", layout.cross_members())):
                mine = next(g for g in groups if layout.rank in g)
                self.comms[level] = (comm.split(groups), mine)
        self._choices: dict[tuple, tuple] = {}   # call site -> (selector version, Choice): see _choose
        self.log: list | None = None   # when a list: (level, collective, numel, dtype, algorithm) of each call
        self.trace: Optional[StepTrace] = None   # when set: the step's events (shard/engine/trace.py)
        self._running = threading.local()        # .task, .sent: the traced task this thread runs now, and
        #                                          whether it communicated
        self._queue = queue or SerialQueue(f"shard-{name}")
        self._side = SideStream(torch.cuda.Stream(device)) if device.type == "cuda" else None
        # NCCL's collectives only queue work on the lane's stream, and a dry run's only record:
        # neither needs a thread of its own
        self.inline = all(c.queues_on_device(device.type) for c, _ in self.comms.values())

    def submit(self, fn: Callable[[], None], *buffers: torch.Tensor, what: str = "") -> Handle:
        """Run `fn` after everything queued before it on this lane; on GPUs on the lane's
        stream, ordered after the caller's stream as it is now. `buffers`: the tensors `fn`
        reads or writes that it did not allocate itself; on GPUs each stays allocated until
        the lane's stream is done with it (pccl.executors.streams). `what`: the task in
        words, for the straggler report (default: the lane's name)."""
        what = f"{self.name}: {what}" if what else self.name
        side, done, trace, sent = self._side, [], self.trace, [False]
        ready = side.mark() if side is not None else None
        traced = (trace, trace.submit(self.name)) if trace is not None else None
        profiled = profiling()   # the task is then a span named `what` on the thread that runs it

        def task() -> None:
            start = time.perf_counter()
            self._running.task = traced[1] if traced else None
            self._running.sent = sent
            with record_function(what) if profiled else nullcontext():
                if side is None:
                    fn()
                else:
                    done.append(side.run(fn, ready, buffers))
            self._running.task = self._running.sent = None
            self.ledger.add_busy(self.name, time.perf_counter() - start)

        if self.inline:
            task()
            return Handle(None, side, done, self.ledger, traced, what, sent, profiled)
        return Handle(self._queue.run(task, async_op=True), side, done, self.ledger, traced, what, sent, profiled)

    def close(self) -> None:
        """Finish the queued tasks and free the lane's communicators (every rank calls it)."""
        self._queue.close()
        for comm, _ in self.comms.values():
            comm.close()

    # Collectives, called from inside tasks.

    def _choose(self, comm, level: str, collective: str, full: torch.Tensor, codec):
        """The Choice of a call site (level, collective, buffer size, dtype and device,
        codec), made at its first call (which measures, where auto measures: every rank
        reaches it at the same call) and kept while the communicator decides with the same
        profiles (a self-calibration that measured since may decide otherwise)."""
        key = (level, collective, full.numel(), full.dtype, full.device.type, codec and codec.name)
        version = comm.selector.version
        kept = self._choices.get(key)
        if kept is None or kept[0] != version:
            choice = comm.choose(collective, algorithm_for(self.algorithm, collective), full, codec)
            kept = self._choices[key] = (comm.selector.version, choice)   # (choosing may have measured)
        return kept[1]

    def _run(self, stage: str, level: str, collective: str, full: torch.Tensor, *args, codec=None) -> None:
        """One collective on the `level` communicator, which has more than one rank (the
        callers leave out those of one)."""
        comm, members = self.comms[level]
        choice = self._choose(comm, level, collective, full, codec)
        if getattr(self._running, "sent", None) is not None:
            self._running.sent[0] = True
        if stage is not None:  # stage None: scalars, not counted
            self.ledger.record(stage, comm, members, choice)
            if self.log is not None:
                self.log.append((level, collective, full.numel(), full.dtype, choice.algorithm))
        if self.trace is not None:
            call = TracedCall(level, collective, choice.nbytes, choice.algorithm, choice.dtype, comm)
            self.trace.call(getattr(self._running, "task", None), call)
        # "none", not None: the engine's own settings decide, never PCCL_COMPRESSION
        getattr(comm, collective)(*args, algorithm=choice.algorithm, compression=codec or "none")

    def _levels(self, coarse: Scope, fine: Scope) -> list[str]:
        """The communicators that take a buffer from scope `coarse` to the finer `fine`;
        one of a single rank (a world of 1, groups of 1, one group) moves nothing."""
        if coarse == fine:
            return []
        if not self.layout.nested:
            levels = ["world"]
        else:
            levels = {(Scope.N, Scope.I): ["group"], (Scope.I, Scope.G): ["cross"],
                      (Scope.N, Scope.G): ["group", "cross"]}[(coarse, fine)]
        return [level for level in levels if self.comms[level][0].size > 1]

    def gather(self, stage: str, dst: torch.Tensor, src: torch.Tensor, shard: Scope, to: Scope,
               codec=None) -> None:
        """All-gather `src` (this rank's `shard`-scope piece) into `dst` (its `to`-scope
        piece), through the nested scopes outward, in `dst`'s dtype (`src` is cast first,
        so the blocks travel in it); `codec`: blocks travel compressed."""
        levels = self._levels(to, shard)
        if not levels:
            dst.copy_(src)   # and casts: one pass
            return
        src = src.to(dst.dtype)
        if len(levels) == 2:  # the inner gather lands in this rank's block of the outer one
            outer = self.comms[levels[0]][0]
            size = dst.numel() // outer.size
            block = dst[outer.rank * size:(outer.rank + 1) * size]
            self._run(stage, levels[1], "all_gather", block, block, src, codec=codec)
            src = block
        self._run(stage, levels[0], "all_gather", dst, dst, src, codec=codec)

    def reduce_scatter(self, stage: str, dst: torch.Tensor, src: torch.Tensor, full: Scope, to: Scope,
                       codec=None) -> None:
        """Sum `src` (this rank's `full`-scope piece) over the ranks sharing it, leaving this
        rank's `to`-scope piece in `dst`, through the nested scopes inward."""
        levels = self._levels(full, to)
        if not levels:
            dst.copy_(src)
            return
        for level in levels:
            comm = self.comms[level][0]
            out = dst if level == levels[-1] else torch.empty(src.numel() // comm.size, dtype=src.dtype,
                                                             device=src.device)
            self._run(stage, level, "reduce_scatter", src, out, src, codec=codec)
            src = out

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Rank `root`'s `tensor` on every rank (an agreement between the ranks, which the
        ledger does not count as the step's communication)."""
        world = self.comms["world"][0]
        if world.size > 1:
            world.broadcast(tensor, root)

    def barrier(self) -> None:
        """Every rank has reached this point of the lane."""
        world = self.comms["world"][0]
        if world.size > 1:
            world.barrier()

    def all_reduce(self, stage: str, tensor: torch.Tensor, scope: Scope, codec=None) -> None:
        """Sum `tensor`, this rank's `scope`-scope piece, over the ranks holding the same piece."""
        level = {Scope.N: "world", Scope.I: "cross"}.get(scope)
        if level is not None and self.comms[level][0].size > 1:
            self._run(stage, level, "all_reduce", tensor, tensor, codec=codec)
