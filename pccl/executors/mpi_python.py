"""The reference executor: schedules run step by step from Python over mpi4py.

It is also the baseline that shows what the C++ executor buys (per-step Python overhead).
"""
from __future__ import annotations

import os
import time

import torch
from mpi4py import MPI

from pccl.core.errors import CollectiveTimeout
from pccl.executors.base import ScheduleExecutor

TAG = 7002


def as_bytes(t: torch.Tensor):
    """A writable numpy byte view of a contiguous CPU tensor (works for bf16 too)."""
    return t.view(torch.uint8).numpy()


class MpiPythonExecutor(ScheduleExecutor):
    def __init__(self, comm: MPI.Comm, timeout: float):
        super().__init__()
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.timeout = timeout
        self.broken = False

    def exchange(self, sends, recvs, step):
        if self.broken:
            raise RuntimeError("pccl: this communicator timed out earlier; create a new communicator")
        reqs = [self.comm.Irecv([as_bytes(t), MPI.BYTE], source=peer, tag=TAG) for peer, t in recvs]
        reqs += [self.comm.Isend([as_bytes(t), MPI.BYTE], dest=peer, tag=TAG) for peer, t in sends]
        deadline = time.monotonic() + self.timeout
        # Poll and yield, so oversubscribed ranks progress and a missing peer times out.
        while not MPI.Request.Testall(reqs):
            if time.monotonic() > deadline:
                for r in reqs:
                    if r != MPI.REQUEST_NULL:
                        r.Cancel()
                        r.Free()
                self.broken = True
                peers = sorted({p for p, _ in sends + recvs})
                raise CollectiveTimeout(
                    f"pccl: rank {self.rank} timed out after {self.timeout} s at step {step} "
                    f"waiting for peers {peers} (did every rank call the same collective?)")
            os.sched_yield()
