"""pccl as a torch.distributed backend. `import pccl.distributed` registers "pccl":

    import torch.distributed as dist
    import pccl.distributed
    pccl.distributed.init_process_group()      # or dist.init_process_group("pccl") under torchrun's env

after which FSDP2, DDP, DTensor and plain `dist.*` calls run their all-gathers,
reduce-scatters and all-reduces on pccl (backend.py). Launch with mpiexec or srun: the
backend's collectives run over MPI.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from pccl.distributed.backend import FORWARDED, Options, ProcessGroupPccl, create, op_name
from pccl.runtime.rendezvous import init_torch_distributed

__all__ = ["FORWARDED", "Options", "ProcessGroupPccl", "init_process_group", "op_name"]

if "pccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("pccl", create, extended_api=True, devices=["cpu", "cuda"])


def init_process_group(timeout: float = 300.0, options: Optional[Options] = None) -> None:
    """torch.distributed's default group on the pccl backend: from the environment where
    torchrun-style variables are set, else through MPI (rank 0 opens the store)."""
    init_torch_distributed("pccl", timeout, options)

