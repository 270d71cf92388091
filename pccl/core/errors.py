"""Exceptions raised by pccl, in pure Python so that they import without MPI or the native
module (which raises these same classes)."""


class CollectiveTimeout(TimeoutError):
    """Peers did not arrive within the communicator's timeout. Raised by every executor;
    the communicator's message state is then unknown: create a new communicator."""
