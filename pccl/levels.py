"""Sub-communicators of a Communicator: any partition of its ranks (split), and the
intra-node and inter-node levels of the two-level plans, over the transport chosen for
each level ("mpi" or "gloo"; mixed transports are allowed).

intra: the ranks of one node, in local order. inter: the ranks with one local index, one
per node, in node order. Creating them is collective over the parent: every rank builds
every group in the same order (torch.distributed requires it).
Mixed transports assume torch.distributed's ranks are MPI.COMM_WORLD's ranks, as they are
when pccl brings torch.distributed up through MPI or the launcher numbers both alike.
"""
from __future__ import annotations

from typing import Optional


def member_world_ranks(parent) -> list[int]:
    """The global (world) rank of each rank of `parent`."""
    if parent.transport == "torch":
        return list(parent._native.global_rank)  # the torch executor's map, computed once
    from mpi4py import MPI

    return parent.mpi_comm.allgather(MPI.COMM_WORLD.rank)


def _mpi_world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.size


def split(parent, groups, transport: Optional[str] = None):
    """The Communicator of the group that holds this rank, for `groups`: a partition of
    the parent's ranks, each group listing its members in their new rank order. Over
    `transport` ("mpi" or "gloo"; default the parent's own), with the parent's executor
    and timeout and its topology restricted to the group. Collective over the parent."""
    from .communicator import Communicator

    groups = [list(g) for g in groups]
    if sorted(r for g in groups for r in g) != list(range(parent.size)):
        raise ValueError(f"groups must hold each rank 0..{parent.size - 1} exactly once, got {groups}")
    transport = transport or ("gloo" if parent.transport == "torch" else "mpi")
    index = next(i for i, g in enumerate(groups) if parent.rank in g)
    members = groups[index]
    topology = parent.topology.restrict(members)
    if transport == "mpi":
        if parent.transport != "mpi":
            raise ValueError("an 'mpi' sub-communicator needs a Communicator built on an mpi4py communicator")
        sub = parent.mpi_comm.Split(index, members.index(parent.rank))
        return Communicator(sub, executor=parent.executor, timeout=parent.timeout, topology=topology,
                            profile=parent.profile)
    if transport != "gloo":
        raise ValueError(f"transport must be 'mpi' or 'gloo', got {transport!r}")
    import torch.distributed as dist

    from .rendezvous import init_torch_distributed

    world = member_world_ranks(parent)
    if len(world) != (dist.get_world_size() if dist.is_initialized() else _mpi_world_size()):
        # new_group (and pccl's MPI rendezvous) are collective over all ranks.
        raise ValueError(f"gloo sub-communicators need a parent over all ranks; this one has {len(world)}")
    init_torch_distributed("gloo", parent.timeout)
    mine = None
    for ranks in groups:  # every rank creates every group, in the same order
        group = dist.new_group([world[r] for r in ranks], backend="gloo")
        if parent.rank in ranks:
            mine = group
    return Communicator(mine, timeout=parent.timeout, topology=topology, profile=parent.profile)


def build_levels(parent, intra: str, inter: str) -> dict:
    topo = parent.topology
    n_local = topo.ranks_per_node
    groups = {"intra": [list(n) for n in topo.nodes],
              "inter": [[n[l] for n in topo.nodes] for l in range(n_local)]}
    return {level: split(parent, groups[level], transport)
            for level, transport in (("intra", intra), ("inter", inter))}
