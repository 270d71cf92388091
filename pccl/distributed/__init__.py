"""pccl as a torch.distributed backend. `import pccl.distributed` registers "pccl":

    import torch.distributed as dist
    import pccl.distributed
    pccl.distributed.init_process_group()      # or, under torchrun, dist.init_process_group("pccl")

after which FSDP2, DDP, DTensor and plain `dist.*` calls run their all-gathers,
reduce-scatters and all-reduces on pccl (backend.py): over MPI where mpiexec or srun
launched the job, over gloo (CPU) or NCCL (CUDA) groups under torchrun.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist

from pccl.distributed.backend import FORWARDED, Options, ProcessGroupPccl, create, op_name
from pccl.runtime.rendezvous import init_torch_distributed

__all__ = ["FORWARDED", "Options", "ProcessGroupPccl", "init_process_group", "op_name"]

if "pccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("pccl", create, extended_api=True, devices=["cpu", "cuda"])


def init_process_group(backend: str = "pccl", timeout: Union[float, timedelta] = 300.0,
                       options: Optional[Options] = None) -> None:
    """torch.distributed's default group (on the pccl backend unless told otherwise): from
    the environment where torchrun's variables are set, else through MPI (rank 0 opens the
    store), so the same script runs under torchrun, mpiexec and srun. `timeout`: seconds,
    or a timedelta as torch's init_process_group takes it."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    init_torch_distributed(backend, seconds, options)

