"""The intra-node and inter-node sub-communicators of a Communicator, over the transport
chosen for each level ("mpi" or "gloo"; mixed transports are allowed).

intra: the ranks of one node, in local order. inter: the ranks with one local index, one
per node, in node order. Creating them is collective over the parent: every rank builds
every group in the same order (torch.distributed requires it).
Mixed transports assume torch.distributed's ranks are MPI.COMM_WORLD's ranks, as they are
when pccl brings torch.distributed up through MPI or the launcher numbers both alike.
"""
from __future__ import annotations

def member_world_ranks(parent) -> list[int]:
    """The global (world) rank of each rank of `parent`."""
    if parent.transport == "torch":
        return list(parent._native.global_rank)  # the torch executor's map, computed once
    from mpi4py import MPI

    return parent.mpi_comm.allgather(MPI.COMM_WORLD.rank)


def _mpi_world_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.size


def build_levels(parent, intra: str, inter: str) -> dict:
    from .communicator import Communicator
    from .topology import Topology

    topo = parent.topology
    n_nodes, n_local = topo.num_nodes, topo.ranks_per_node
    node, local = topo.node_of(parent.rank), topo.local_of(parent.rank)
    shapes = {"intra": (Topology.regular(n_local, n_local), node, local, [list(n) for n in topo.nodes]),
              "inter": (Topology.regular(n_nodes, 1), local, node,
                        [[n[l] for n in topo.nodes] for l in range(n_local)])}
    levels = {}
    for level, transport in (("intra", intra), ("inter", inter)):
        topology, color, key, groups = shapes[level]
        if transport == "mpi":
            sub = parent.mpi_comm.Split(color, key)
            levels[level] = Communicator(sub, executor=parent.executor, timeout=parent.timeout, topology=topology)
        else:
            import torch.distributed as dist

            from .rendezvous import init_torch_distributed

            world = member_world_ranks(parent)
            if len(world) != (dist.get_world_size() if dist.is_initialized() else _mpi_world_size()):
                # new_group (and pccl's MPI rendezvous) are collective over all ranks.
                raise ValueError(f"{level}='gloo' needs a communicator over all ranks; this one has "
                                 f"{len(world)}")
            init_torch_distributed("gloo", parent.timeout)
            mine = None
            for ranks in groups:  # every rank creates every group, in the same order
                group = dist.new_group([world[r] for r in ranks], backend="gloo")
                if parent.rank in ranks:
                    mine = group
            levels[level] = Communicator(mine, timeout=parent.timeout, topology=topology)
    return levels
