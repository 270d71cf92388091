"""Starting MPI jobs from Python (benchmark drivers, tests): the mpiexec next to this
interpreter, with what Open MPI needs to run as root and with more ranks than cores
(MPICH needs nothing)."""
from __future__ import annotations

import subprocess
import sys
from functools import lru_cache
from pathlib import Path

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


@lru_cache(maxsize=1)
def launcher() -> tuple[str, ...]:
    """The mpiexec command and the flags this MPI needs, before -n."""
    version = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        return (MPIEXEC, "--allow-run-as-root", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1")
    return (MPIEXEC,)
