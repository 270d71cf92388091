"""Bring up torch.distributed for the gloo/NCCL transports.

Under torchrun (or with MASTER_ADDR, RANK, WORLD_SIZE set) the environment is used.
Under mpiexec, MPI itself is the rendezvous: rank 0 opens a TCPStore on a free port and
broadcasts its address, so no extra configuration is needed.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

_span: timedelta | None = None   # while torch.distributed is pccl's to shut down at exit


def mpi_world():
    """MPI.COMM_WORLD, with MPI_THREAD_MULTIPLE requested where MPI is not started yet (its
    import starts it; communicators check what it provides)."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI.COMM_WORLD


def init_torch_distributed(backend: str, timeout: float, pg_options=None, same_backend: bool = True) -> None:
    """torch.distributed's default group on `backend`, made unless it exists. An existing
    one on another backend is refused with `same_backend` (what runs over the default group
    itself: pccl.init's communicator, pccl.distributed's group), kept without (groups made
    with a backend of their own, dist.new_group's, which any default group can make)."""
    if dist.is_initialized():
        if same_backend and dist.get_backend() != backend:
            raise ValueError(f"torch.distributed's default group is already on backend {dist.get_backend()!r}, and "
                             f"this asks for {backend!r}: destroy it first (torch.distributed."
                             f"destroy_process_group()), or ask for {dist.get_backend()!r}")
        return
    span = timedelta(seconds=timeout)
    if all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
        dist.init_process_group(backend, timeout=span, pg_options=pg_options)
        _shut_down_at_exit(span)
        return
    comm = mpi_world()
    hosts = comm.allgather(socket.gethostname())
    one_host = len(set(hosts)) == 1
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    address = None
    store = None
    if comm.rank == 0:
        host = "127.0.0.1" if one_host else socket.gethostbyname(hosts[0])
        store = dist.TCPStore(host, 0, comm.size, True, timeout=span, wait_for_workers=False)
        address = (host, store.port)
    host, port = comm.bcast(address, root=0)
    if store is None:
        store = dist.TCPStore(host, port, comm.size, False, timeout=span)
    dist.init_process_group(backend, store=store, rank=comm.rank, world_size=comm.size, timeout=span,
                            pg_options=pg_options)
    # Tear down before MPI_Finalize (mpi4py's exit hook, registered earlier, runs after this).
    _shut_down_at_exit(span)


def _shut_down_at_exit(span: timedelta) -> None:
    global _span
    _span = span
    atexit.register(shut_down)


def shut_down() -> None:
    """Destroy the process groups pccl made once every rank got here (once: later calls do
    nothing): a rank that tore its gloo connections down while a peer still read from them
    would crash that peer."""
    global _span
    span, _span = _span, None
    if span is None or not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=span)  # raises instead of hanging if a rank is gone
    else:
        dist.barrier()
    dist.destroy_process_group()
