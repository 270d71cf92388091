"""Exceptions raised by pccl."""
from mpi4py import MPI  # noqa: F401  (the native module needs libmpi loaded first)

# Raised when peers do not arrive within the communicator's timeout, by every executor.
# A subclass of TimeoutError, defined by the native module so C++ and Python raise one type.
# The communicator's message state is then unknown: create a new communicator.
from ._native import CollectiveTimeout  # noqa: E402

__all__ = ["CollectiveTimeout"]
