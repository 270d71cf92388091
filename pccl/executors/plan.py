"""Runs plans: phases on the level communicators, local steps on tensors.

Workspaces are cached per (name, dtype, device) and grow only, so the steady state
allocates nothing. The shuffle is one pass: one Triton kernel on GPUs (index_copy_ where
Triton is missing, and on CPUs for many small blocks), straight copies of each piece
otherwise. Phases reduce with "sum" when the op is "avg"; the result is divided by the size
once at the end.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional

import torch

from pccl.core.dtypes import average_, reduce_
from pccl.executors.shuffle_triton import permute_blocks
from pccl.executors.streams import SideStream
from pccl.ir.plan import Combine, Concurrent, Fill, Permute, Phase, Plan, Ref


def identity(op: str, dtype: torch.dtype):
    """The value that leaves `op` unchanged."""
    if op in ("sum", "avg"):
        return 0
    if dtype.is_floating_point:
        return -float("inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


@lru_cache(maxsize=4096)
def runs_of(perm: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(first src block, first dst block, length) of each stretch that moves as one piece;
    src blocks mapped to -1 are skipped."""
    runs: list[list[int]] = []
    for i, j in enumerate(perm):
        if j < 0:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
            runs[-1][2] += 1
        else:
            runs.append([i, j, 1])
    return tuple(tuple(r) for r in runs)


# Up to this many pieces (on CPU) plain copies beat index_copy_, which is slower per byte.
MAX_COPIES = 64


def permute_(src: torch.Tensor, dst: torch.Tensor, perm: tuple[int, ...], index: Callable) -> None:
    """dst block perm[i] = src block i, in one pass (src, dst are (blocks, m) views)."""
    if src.device.type == "cuda" and permute_blocks(src, dst, index(perm)):
        return  # one Triton kernel, partial permutations included
    runs = runs_of(perm)
    if -1 not in perm and (src.device.type != "cpu" or len(runs) > MAX_COPIES):
        dst.index_copy_(0, index(perm), src)  # one kernel
        return
    for i, j, n in runs:
        dst[j:j + n].copy_(src[i:i + n])


def side_stream(device: torch.device) -> SideStream:
    return SideStream(torch.cuda.Stream(device))


def level_communicators(comm) -> dict:
    """{level: communicator}: `comm` split along its topology's levels, each over its level
    transport ("intra", "inter", and where the network has groups "group" and "global",
    which ride the inter-node transport). Collective over `comm`."""
    wanted = dict(comm.level_transports)
    if comm.topology.has_groups:
        for level in ("group", "global"):
            wanted[level] = wanted["inter"]
    levels = {level: comm.split(comm.topology.level_groups(level), transport) for level, transport in wanted.items()}
    for level, child in levels.items():
        child.label = f"the {level}-node level's "
    return levels


class PlanExecutor:
    def __init__(self, levels: dict, new_side: Callable[[torch.device], SideStream] = side_stream):
        self.levels = levels          # "intra"/"inter" -> Communicator
        self._new_side = new_side     # a side stream for a level's concurrent phases (tests: stand-ins)
        self._spaces: dict[tuple, torch.Tensor] = {}
        self._indices: dict[tuple, torch.Tensor] = {}
        self._sides: dict[tuple, SideStream] = {}   # (level, device): its stream for concurrent phases

    def _space(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        key = (name, like.dtype, like.device)
        buf = self._spaces.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._spaces[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def _index(self, perm: tuple[int, ...], device) -> torch.Tensor:
        key = (perm, device)
        if key not in self._indices:
            self._indices[key] = torch.tensor(perm, dtype=torch.int64, device=device)
        return self._indices[key]

    def _phase(self, phase: Phase, view: Callable[[Ref], torch.Tensor], op: str, async_op: bool,
               codecs: dict):
        comm = self.levels[phase.level]
        out, inp = view(phase.output), view(phase.input)
        compression = codecs.get(phase.level) or "none"
        # a plan's "native" is the level transport's own collective in the form the level
        # runs it: on an interruptible communicator one that times out, never MPI's blocking one
        algorithm = comm.selector.own_native if phase.algorithm == "native" else phase.algorithm
        if phase.collective == "all_gather":
            return comm.all_gather(out, inp, algorithm=algorithm, async_op=async_op, compression=compression)
        return comm.reduce_scatter(out, inp, op=op, algorithm=algorithm, async_op=async_op, compression=compression)

    def _start(self, phase: Phase, view: Callable[[Ref], torch.Tensor], op: str,
               like: torch.Tensor, codecs: dict) -> Callable[[], None]:
        """Start `phase` alongside the step's others; return its wait. A level that only
        queues GPU work (NCCL) runs on its own side stream, issued now on this thread in
        phase order (the same on every rank); another runs on its level's worker thread."""
        comm = self.levels[phase.level]
        if not comm.queues_on_device(like.device.type):
            return self._phase(phase, view, op, True, codecs).wait
        key = (phase.level, like.device)
        if key not in self._sides:
            self._sides[key] = self._new_side(like.device)
        side = self._sides[key]
        done = side.run(lambda: self._phase(phase, view, op, False, codecs), side.mark(),
                        (view(phase.input), view(phase.output)))
        return lambda: side.wait(done)

    def run(self, plan: Plan, buffers: dict[str, torch.Tensor], block: int, op: str,
            codecs: Optional[dict] = None) -> None:
        """Run `plan` with its named buffers ("input"/"output" or "io"), `block` elements a
        block; `codecs`: the codec of each level's phases ({"inter": ...}; none by default)."""
        codecs = codecs or {}
        if block == 0:
            return
        like = next(iter(buffers.values()))
        bufs = dict(buffers)
        for name, blocks in plan.workspaces:
            bufs[name] = self._space(name, blocks * block, like)

        def view(ref: Ref) -> torch.Tensor:
            return bufs[ref.buffer][ref.start * block:(ref.start + ref.count) * block]

        phase_op = "sum" if op == "avg" else op
        for step in plan.steps:
            if isinstance(step, Phase):
                self._phase(step, view, phase_op, False, codecs)
            elif isinstance(step, Concurrent):
                for wait in [self._start(p, view, phase_op, like, codecs) for p in step.phases]:
                    wait()
            elif isinstance(step, Permute):
                permute_(view(step.src).view(-1, block), view(step.dst).view(-1, block), step.perm,
                         lambda perm: self._index(perm, like.device))
            elif isinstance(step, Fill):
                view(step.dst).fill_(identity(phase_op, like.dtype))
            elif isinstance(step, Combine):
                reduce_(view(step.dst), view(step.src), phase_op)
            else:
                raise TypeError(f"unknown plan step {step!r}")
        if op == "avg":
            average_(bufs["output" if "output" in bufs else "io"], plan.nodes * plan.local)

    def all_reduce(self, plan: Plan, tensor: torch.Tensor, op: str, codecs: Optional[dict] = None) -> None:
        """All-reduce in place; a length not divisible by the size runs on a padded copy."""
        p = plan.nodes * plan.local
        block = -(-tensor.numel() // p)
        io = tensor
        if block * p != tensor.numel():
            io = self._space("padded", block * p, tensor)
            io[:tensor.numel()].copy_(tensor)
            io[tensor.numel():].zero_()
        self.run(plan, {"io": io}, block, op, codecs)
        if io is not tensor:
            tensor.copy_(io[:tensor.numel()])
