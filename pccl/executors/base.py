"""The schedule loop shared by the Python-level executors (mpi4py and torch.distributed).

A subclass supplies `exchange`: post a step's sends and receives together and wait for
all of them. Block layout: pccl.ir.blocks. The C++ executor implements the same loop natively.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pccl.core.dtypes import average_, reduce_
from pccl.ir.blocks import block_offsets
from pccl.ir.compressed import compress
from pccl.ir.schedule import Kind, Schedule


class ScheduleExecutor(ABC):
    rank: int
    size: int

    def __init__(self) -> None:
        self._work: dict[torch.dtype, torch.Tensor] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def takes(self, codec) -> bool:
        """Whether it runs schedules compressed with `codec`: every codec (execute_compressed)."""
        return True

    @abstractmethod
    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                 step: int) -> None:
        """Send and receive these (peer, tensor) pairs concurrently; return when all are done."""

    @staticmethod
    def _cached(cache: dict, like: torch.Tensor, numel: int) -> torch.Tensor:
        # by device too: one executor may carry a device map's CPU and GPU tensors
        key = (like.dtype, like.device)
        buf = cache.get(key)
        if buf is None or buf.numel() < numel:
            buf = cache[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def execute(self, sched: Schedule, buf: torch.Tensor, offsets: list[int], op: str | None,
                codec=None) -> None:
        if codec is not None:
            self.execute_compressed(sched, buf, offsets, op, codec)
            return

        def view(first: int, count: int) -> torch.Tensor:
            return buf[offsets[first]:offsets[first + count]]

        for index, step in enumerate(sched.steps):
            need = sum(offsets[b + 1] - offsets[b] for t in step if t.kind == Kind.RECV_REDUCE for b in t.blocks)
            scratch = self._cached(self._scratch, buf, need)
            sends, recvs, pending, used = [], [], [], 0
            for t in step:
                for first, count in t.runs:
                    target = view(first, count)
                    if target.numel() == 0:
                        continue  # empty blocks (count < size): neither side sends
                    if t.kind == Kind.SEND:
                        sends.append((t.peer, target))
                    elif t.kind == Kind.RECV:
                        recvs.append((t.peer, target))
                    else:
                        landing = scratch[used:used + target.numel()]
                        used += target.numel()
                        recvs.append((t.peer, landing))
                        pending.append((target, landing))
            self.exchange(sends, recvs, index)
            for target, landing in pending:
                reduce_(target, landing, op)

    def execute_compressed(self, sched: Schedule, buf: torch.Tensor, offsets: list[int], op: str | None,
                           codec) -> None:
        """The schedule with every block travelling as its `codec` encoding, following
        pccl.ir.compressed's plan (encode once where the plan says, forward encodings,
        decode-and-reduce, decode at the end). One message per run of blocks, as uncompressed."""
        plan = compress(sched, codec.per_message)
        op = "sum" if op == "avg" else op

        def values(b: int) -> torch.Tensor:
            return buf[offsets[b]:offsets[b + 1]]

        def nbytes(b: int) -> int:
            return codec.encoded_nbytes(offsets[b + 1] - offsets[b], buf.dtype)

        encodings: dict[int, torch.Tensor] = {}

        def encode(b: int) -> None:
            encodings[b] = torch.empty(nbytes(b), dtype=torch.uint8, device=buf.device)
            if values(b).numel():
                codec.encode(values(b), encodings[b])

        for index, step in enumerate(plan.steps):
            for b in step.encode:
                encode(b)
            sends, recvs, landed = [], [], []
            for t in step.sends:
                for first, count in t.runs:
                    message = encodings[first] if count == 1 else \
                        torch.cat([encodings[b] for b in range(first, first + count)])
                    if message.numel():
                        sends.append((t.peer, message))
            for t in (*step.keeps, *step.reduces):
                for first, count in t.runs:
                    landing = torch.empty(sum(nbytes(b) for b in range(first, first + count)), dtype=torch.uint8,
                                          device=buf.device)
                    if landing.numel():
                        recvs.append((t.peer, landing))
                    at = 0
                    for b in range(first, first + count):
                        landed.append((t.kind, b, landing[at:at + nbytes(b)]))
                        at += nbytes(b)
            self.exchange(sends, recvs, index)
            for b in step.thaw:
                encoding = encodings.pop(b)
                if values(b).numel():   # an empty block (fewer elements than ranks) has nothing to decode
                    codec.decode(encoding, values(b))
            for kind, b, encoding in landed:
                if kind == Kind.RECV and step.unpack:
                    if values(b).numel():
                        codec.decode(encoding, values(b))
                    encodings.pop(b, None)
                elif kind == Kind.RECV:
                    encodings[b] = encoding
                elif values(b).numel():
                    codec.decode(encoding, values(b), op)
                    encodings.pop(b, None)
        for b in plan.seal:
            encode(b)
        for b in (*plan.decode, *plan.settle, *plan.seal):
            if values(b).numel():
                codec.decode(encodings[b], values(b))

    def all_gather(self, sched: Schedule, output: torch.Tensor, input: torch.Tensor, codec=None) -> None:
        n = input.numel()
        mine = output[self.rank * n:(self.rank + 1) * n]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        self.execute(sched, output, block_offsets(n * self.size, self.size), None, codec)

    def reduce_scatter(self, sched: Schedule, output: torch.Tensor, input: torch.Tensor, op: str,
                       codec=None) -> None:
        # The input stays untouched: reduce in a cached copy.
        work = self._cached(self._work, input, input.numel())
        work.copy_(input)
        self.execute(sched, work, block_offsets(input.numel(), self.size), op, codec)
        n = output.numel()
        output.copy_(work[self.rank * n:(self.rank + 1) * n])
        if op == "avg":
            average_(output, self.size)

    def all_reduce(self, sched: Schedule, tensor: torch.Tensor, op: str, codec=None) -> None:
        self.execute(sched, tensor, block_offsets(tensor.numel(), self.size), op, codec)
        if op == "avg":
            average_(tensor, self.size)
