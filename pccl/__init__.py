"""pccl: collectives for sharded data-parallel training.

Algorithms are schedules (data) run by interchangeable executors: C++ over MPI, Python
over mpi4py, torch.distributed point-to-point. See README.md.
"""
from .algorithms import GENERATORS, algorithms_for, schedule
from .communicator import DEFAULT_TIMEOUT, Communicator, init
from .errors import CollectiveTimeout
from .plans import Hierarchical, HORing
from .topology import FRONTIER_ENV, MACHINES, Topology, TopologyError
from .work import Work

__all__ = ["Communicator", "init", "CollectiveTimeout", "Work", "schedule", "algorithms_for",
           "GENERATORS", "DEFAULT_TIMEOUT", "Hierarchical", "HORing", "Topology", "TopologyError",
           "MACHINES", "FRONTIER_ENV"]
__version__ = "0.1.0"
