"""pccl: collectives for sharded data-parallel training.

Algorithms are schedules (data) run by interchangeable executors: C++ over MPI, Python
over mpi4py, torch.distributed point-to-point. See README.md and docs/.

`import pccl` loads none of MPI, the native module or torch.distributed: each public name
is imported from its sub-package when first used (PEP 562), so the cost model and the
simulator run where MPI is absent.
"""
from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "Communicator": "pccl.runtime.communicator",
    "init": "pccl.runtime.communicator",
    "DEFAULT_TIMEOUT": "pccl.runtime.transport",
    "Work": "pccl.runtime.work",
    "SerialQueue": "pccl.runtime.work",
    "DryRunCommunicator": "pccl.runtime.dry_run",
    "mpi_world": "pccl.runtime.rendezvous",
    "exit_within": "pccl.runtime.teardown",
    "SideStream": "pccl.executors.streams",
    "average_": "pccl.core.dtypes",
    "CollectiveTimeout": "pccl.core.errors",
    "PeerLost": "pccl.core.errors",
    "CallMismatch": "pccl.runtime.call_check",
    "Topology": "pccl.core.topology",
    "TopologyError": "pccl.core.topology",
    "MACHINES": "pccl.core.topology",
    "FRONTIER_ENV": "pccl.core.topology",
    "COLLECTIVES": "pccl.core.collectives",
    "schedule": "pccl.algorithms",
    "algorithms_for": "pccl.algorithms",
    "GENERATORS": "pccl.algorithms",
    "Hierarchical": "pccl.plans",
    "HORing": "pccl.plans",
    "ThreeLevel": "pccl.plans",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pccl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
