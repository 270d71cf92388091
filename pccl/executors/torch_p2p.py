"""Schedules over torch.distributed point-to-point (batch_isend_irecv): gloo for host
tensors, NCCL/RCCL for GPU tensors; and the backend's own collectives as the baseline."""
from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pccl.core.dtypes import average_
from pccl.core.errors import CollectiveTimeout, PeerLost, rank_name, waited_peers
from pccl.executors.base import ScheduleExecutor

# torch >= 2.13 names the tensor collectives *_single; older releases *_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN}


class TorchP2PExecutor(ScheduleExecutor):
    def __init__(self, group, timeout: float):
        super().__init__()
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        # P2POp takes global ranks (group_peer= only exists in recent torch releases).
        self.global_rank = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.timeout = timedelta(seconds=timeout)
        # NCCL's wait() orders the current stream after the collective without blocking the
        # CPU; given a timeout it would poll on the CPU until the GPU finishes. NCCL's own
        # watchdog applies the process group's timeout instead.
        self.wait_timeout = None if "nccl" in dist.get_backend(group) else self.timeout
        self.broken = False

    def _wait(self, issue: Callable[[], list], what: str, pending=()) -> None:
        """Issue the works (`issue()`) and wait for them. A timeout becomes CollectiveTimeout,
        a broken transport PeerLost (a peer died: gloo's "Connection reset/closed by peer",
        at issue or while waiting; NCCL's remote error), each naming `what` and the (peer,
        is_send) pairs `pending`; other errors at issue (bad arguments) stay as they are.
        After either the communicator is broken, as the MPI executors' are: the next call
        says so instead of meeting the transport's own error (gloo's, for a closed pair)."""
        if self.broken:
            raise RuntimeError("pccl: an earlier collective on this communicator timed out or failed and its message "
                               "state is unknown; create a new communicator")
        try:
            works = issue()
        except RuntimeError as e:
            if not any(word in str(e).lower() for word in ("connection", "by peer", "remote")):
                raise
            raise self._failure(e, what, pending) from e
        try:
            for w in works:
                w.wait() if self.wait_timeout is None else w.wait(self.wait_timeout)
        except RuntimeError as e:
            raise self._failure(e, what, pending) from e

    def _failure(self, e: RuntimeError, what: str, pending) -> CollectiveTimeout:
        self.broken = True
        peers = f" waiting to {waited_peers(pending, self.global_rank)}" if pending else ""
        text = str(e).lower()
        if "timed out" in text or "timeout" in text:
            return CollectiveTimeout(f"pccl: {rank_name(self.rank, self.global_rank)}: {what} timed out after "
                                     f"{self.timeout.total_seconds():g} s{peers}: {e}")
        return PeerLost(f"pccl: {rank_name(self.rank, self.global_rank)}: {what}: the transport failed{peers} "
                        f"(did a peer die?): {e}")

    def exchange(self, sends, recvs, step):
        # Each (peer, direction) carries its runs in order; the run index is the tag.
        ops, seen = [], {}
        for fn, pairs in ((dist.irecv, recvs), (dist.isend, sends)):
            for peer, t in pairs:
                tag = seen[(fn, peer)] = seen.get((fn, peer), -1) + 1
                ops.append(dist.P2POp(fn, t, self.global_rank[peer], group=self.group, tag=tag))
        if ops:
            self._wait(lambda: dist.batch_isend_irecv(ops), f"step {step}",
                       [(p, False) for p, _ in recvs] + [(p, True) for p, _ in sends])

    def native_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._wait(lambda: [all_gather_single(output, input, group=self.group, async_op=True)],
                   "all_gather_single")

    def native_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        self._wait(lambda: [reduce_scatter_single(output, input, op=TORCH_OPS[op], group=self.group, async_op=True)],
                   "reduce_scatter_single")
        if op == "avg":
            average_(output, self.size)

    def native_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        self._wait(lambda: [dist.all_reduce(tensor, op=TORCH_OPS[op], group=self.group, async_op=True)],
                   "all_reduce")
        if op == "avg":
            average_(tensor, self.size)

    def native_broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self._wait(lambda: [dist.broadcast(tensor, self.global_rank[root], group=self.group, async_op=True)],
                   "broadcast")

    def native_barrier(self) -> None:
        self._wait(lambda: [dist.barrier(group=self.group, async_op=True)], "barrier")
