"""Topology detection for a live process group: MPI's shared-memory split, or the host
names of a torch.distributed group's members."""
from __future__ import annotations

import socket
from typing import Optional

import torch.distributed as dist

from pccl.core.topology import Topology, from_hosts


def detect_torch(group, nics_per_node: Optional[int] = None) -> Topology:
    """The topology of a torch.distributed group from its members' host names."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return from_hosts(hosts, nics_per_node)


def detect(comm, nics_per_node: Optional[int] = None) -> Topology:
    """The topology of an mpi4py communicator from its shared-memory split."""
    from mpi4py import MPI  # only where an MPI communicator is given

    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    leader = node_comm.bcast(comm.rank, root=0)  # the node's lowest rank names it
    node_comm.Free()
    return from_hosts(comm.allgather(leader), nics_per_node)
