"""After a collective failed (a peer died or never came), MPI_Finalize at exit can wait
forever for the missing peer: MPI_Finalize waits for every peer to reach it. The process
then shuts torch.distributed down and finalizes MPI itself, before mpi4py's exit hook
would, and exits without the finalize after FINALIZE_LIMIT seconds, with status 1, so a
failed run ends (the launcher sees a rank fail and ends the others) rather than hanging.
The limit bounds the finalize alone: a run that finalizes in time exits as it would have,
however long the rest of its exit takes.

A process that fails on its own (an exception on one rank, Ctrl-C) is the other way
round: its peers wait for it in their next collective, and its exit waits for them (a
communication thread's collective joined at exit, MPI_Finalize), until the communicators'
timeout. `exit_within` ends such a process within seconds, so the launcher ends the job."""
from __future__ import annotations

import atexit
import os
import sys
import threading

# seconds; finalize waits for the slowest peer's own exit (its torch.distributed shut-down,
# on loaded shared cores), then takes milliseconds
FINALIZE_LIMIT = 5.0
_armed = False
_deadline = None   # exit_within's timer, kept alive until the process ends


def exit_if_finalize_hangs() -> None:
    """From now on, a process exit that MPI_Finalize holds up past FINALIZE_LIMIT ends
    without it (once; nothing where MPI was never started, as under torchrun)."""
    global _armed
    if _armed or "mpi4py.MPI" not in sys.modules:
        return
    _armed = True
    atexit.register(_bounded_finalize)   # atexit runs last-registered first: before mpi4py's finalize


def exit_within(seconds: float, code: int = 1) -> None:
    """End this process with `code` if it has not exited `seconds` from now, and bound its
    finalize. Where MPI runs, a native thread (it needs no GIL, which a blocked exit may
    hold); elsewhere (torchrun: MPI is not started for this) a daemon thread."""
    global _deadline
    if _deadline is not None:
        return
    if "mpi4py.MPI" in sys.modules:
        from pccl.executors.mpi_cpp import exit_timer

        exit_if_finalize_hangs()
        _deadline = exit_timer(seconds, code, f"pccl: this process failed, and {seconds:g} s later its exit still "
                                              "waits (for peers that wait for it): exiting without it")
    else:
        _deadline = threading.Timer(seconds, os._exit, (code,))
        _deadline.daemon = True
        _deadline.start()


def _bounded_finalize() -> None:
    from mpi4py import MPI

    from pccl.executors.mpi_cpp import exit_timer
    from pccl.runtime.rendezvous import shut_down

    try:
        # first: the peers' torch.distributed shut-down waits for this rank's, and this
        # rank's finalize for theirs (its own exit hook then finds nothing to do)
        shut_down()
    finally:
        if not MPI.Is_finalized():
            sys.stdout.flush()
            sys.stderr.flush()
            timer = exit_timer(FINALIZE_LIMIT, 1, "pccl: MPI_Finalize still waits for a peer after a failed "
                                                  "collective (a peer is gone): exiting without it")
            MPI.Finalize()   # mpi4py's own exit hook then finds MPI finalized and does nothing
            timer.cancel()
