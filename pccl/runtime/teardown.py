"""After a collective failed (a peer died or never came), MPI_Finalize at exit can wait
forever for the missing peer: the process then exits without it after FINALIZE_LIMIT
seconds, with status 1, so a failed run ends (the launcher sees a rank fail and ends the
others) rather than hanging. A run that finalizes in time exits as it would have."""
from __future__ import annotations

import atexit
import sys

FINALIZE_LIMIT = 3.0   # seconds; a finalize with every peer alive takes milliseconds
_armed = False


def exit_if_finalize_hangs() -> None:
    """From now on, a process exit that MPI_Finalize holds up past FINALIZE_LIMIT ends
    without it (once; nothing where MPI was never started, as under torchrun)."""
    global _armed
    if _armed or "mpi4py.MPI" not in sys.modules:
        return
    _armed = True
    atexit.register(_bound_finalize)   # atexit runs last-registered first: before mpi4py's finalize


def _bound_finalize() -> None:
    from pccl.executors.mpi_cpp import exit_if_stuck

    sys.stdout.flush()
    sys.stderr.flush()
    exit_if_stuck(FINALIZE_LIMIT, 1)
