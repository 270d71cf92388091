"""Fixtures of the engine tests that run one rank in this process (a singleton MPI world,
no mpiexec)."""
import pytest
from mpi4py import MPI

import pccl


@pytest.fixture(scope="module")
def comm():
    return pccl.Communicator(MPI.COMM_SELF, timeout=60)


@pytest.fixture
def engines():
    """Engines a test builds, closed after it (their communication threads)."""
    built = []
    yield built
    for engine in built:
        engine.close()
