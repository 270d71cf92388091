"""The reference executor: schedules run step by step from Python over mpi4py.

It is also the baseline that shows what the C++ executor buys (per-step Python overhead).
"""
from __future__ import annotations

import os
import time

import torch
from mpi4py import MPI

from pccl.core.errors import CollectiveTimeout, rank_name, waited_peers
from pccl.executors.base import ScheduleExecutor

TAG = 7002
SPIN, NAP, MAX_NAP = 0.1, 1e-6, 100e-6   # seconds: yield first, then naps doubling to the cap (as csrc/comm.cpp)


def as_bytes(t: torch.Tensor):
    """A writable numpy byte view of a contiguous CPU tensor (works for bf16 too)."""
    return t.view(torch.uint8).numpy()


def free_mpi(comm: MPI.Comm) -> None:
    """MPI_Comm_free `comm`, unless it is freed already or MPI has finalized (at interpreter
    exit)."""
    if not MPI.Is_finalized() and comm != MPI.COMM_NULL:
        comm.Free()


class MpiPythonExecutor(ScheduleExecutor):
    def __init__(self, comm: MPI.Comm, timeout: float):
        super().__init__()
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.rank, self.comm.size
        self.timeout = timeout
        self.broken = False
        # Translated once: a timeout names the peers as the launcher numbers them.
        self.world_ranks = MPI.Group.Translate_ranks(self.comm.Get_group(), list(range(self.size)),
                                                     MPI.COMM_WORLD.Get_group())

    def release(self) -> None:
        """Free its duplicate of the communicator (not once broken: requests it cancelled may
        still be pending)."""
        if not self.broken:
            free_mpi(self.comm)

    def _done(self, reqs, peers: list[int]) -> bool:
        """Testall; an MPI error (a message longer than its receive: ranks passed other
        sizes) leaves the communicator's messages unknown, so it is broken from then on, as
        the C++ executor's is, instead of matching the next call's messages with these. The
        error names the message that failed, as the C++ executor's does."""
        statuses = [MPI.Status() for _ in reqs]
        try:
            return MPI.Request.Testall(reqs, statuses)
        except MPI.Exception as e:
            for r in reqs:
                if r != MPI.REQUEST_NULL:
                    r.Cancel()
                    r.Free()
            self.broken = True
            failed = [(peer, s.Get_error()) for peer, s in zip(peers, statuses)
                      if s.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
            truncated = [peer for peer, error in failed if MPI.Get_error_class(error) == MPI.ERR_TRUNCATE]
            if truncated:
                raise RuntimeError(f"pccl: a message from {rank_name(truncated[0], self.world_ranks)} was longer than "
                                   "its receive (MPI_ERR_TRUNCATE): the ranks called this collective with different "
                                   "sizes or dtypes (PCCL_CHECK_CALLS=1 names the difference on every rank, before "
                                   "anything is sent)") from None
            raise RuntimeError(f"pccl: MPI_Testall failed: {e.Get_error_string()}") from None

    def exchange(self, sends, recvs, step):
        if self.broken:
            raise RuntimeError("pccl: an earlier collective on this communicator timed out or failed and its message "
                               "state is unknown; create a new communicator")
        reqs = [self.comm.Irecv([as_bytes(t), MPI.BYTE], source=peer, tag=TAG) for peer, t in recvs]
        reqs += [self.comm.Isend([as_bytes(t), MPI.BYTE], dest=peer, tag=TAG) for peer, t in sends]
        start = time.monotonic()
        deadline, nap = start + self.timeout, NAP
        # Poll, so a missing peer times out; yield between polls for SPIN (MPI moves bytes
        # between ranks of a node only while they poll), then nap (a straggler: leave the
        # core to computing threads), as csrc/comm.cpp's poll.
        while not self._done(reqs, [peer for peer, _ in recvs] + [peer for peer, _ in sends]):
            now = time.monotonic()
            if now > deadline:
                directions = [(p, False) for p, _ in recvs] + [(p, True) for p, _ in sends]
                pending = [d for d, r in zip(directions, reqs) if r != MPI.REQUEST_NULL]
                for r in reqs:
                    if r != MPI.REQUEST_NULL:
                        r.Cancel()
                        r.Free()
                self.broken = True
                raise CollectiveTimeout(
                    f"pccl: {rank_name(self.rank, self.world_ranks)} timed out after {self.timeout:g} s at step {step} "
                    f"waiting to {waited_peers(pending, self.world_ranks)} (a peer died, or did not call the same "
                    "collective)")
            if now - start < SPIN:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(2 * nap, MAX_NAP)
