"""Shared by the GPU test suite (make test-gpu, docs/gpu.md "GPU test suite"): how many
GPUs torch sees, why a GPU test cannot run here, and where results are kept."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# Ranks of a multi-rank test over MPI where there is one GPU: MPI, unlike NCCL (which refuses
# two ranks on one GPU: ncclInvalidUsage), lets ranks share it.
SHARED_RANKS = 4
SHARING = "NCCL refuses two ranks on one GPU (ncclInvalidUsage)"


def mpi_ranks() -> int:
    """Ranks of a multi-rank GPU test over MPI: one per GPU where there are 2+, else
    SHARED_RANKS sharing the one GPU."""
    return GPUS if GPUS >= 2 else SHARED_RANKS


def no_mpi_gpu_reason() -> Optional[str]:
    """Why GPU tensors cannot travel over MPI here (it needs one GPU and pccl's native module
    built for GPUs); None when they can."""
    reason = no_gpu_reason(1, nccl=False)
    if reason:
        return reason
    try:
        from mpi4py import MPI  # noqa: F401 - loads libmpi for the native module

        from pccl.executors.mpi_cpp import gpu_available
    except ImportError as e:
        return f"pccl's native module does not load: {e}"
    if not gpu_available():
        return ("needs pccl's native module built for GPUs (make GPU=cuda or GPU=hip): "
                "pccl.executors.mpi_cpp.gpu_available() is False")
    return None


def no_gpu_reason(gpus: int = 1, nccl: bool = True) -> Optional[str]:
    """Why a test that needs `gpus` GPUs (and NCCL in torch, if `nccl`: one rank per GPU)
    cannot run here; None when it can."""
    if not torch.cuda.is_available():
        return "needs a GPU: torch.cuda.is_available() is False"
    if GPUS < gpus:
        # on one GPU the ranks would share it, which NCCL refuses (MPI tests run so instead)
        return f"needs {gpus}+ GPUs, torch sees {GPUS}" + (f": {SHARING}" if nccl and GPUS == 1 else "")
    if nccl and not dist.is_nccl_available():
        return "needs a torch built with NCCL (or RCCL): torch.distributed.is_nccl_available() is False"
    return None


def keep(*paths: Path) -> Optional[Path]:
    """Copy results into $PCCL_GPU_TRACE_DIR, where set, for the user to keep; the directory."""
    target = os.environ.get("PCCL_GPU_TRACE_DIR")
    if not target:
        return None
    directory = Path(target)
    directory.mkdir(parents=True, exist_ok=True)
    for path in paths:
        shutil.copy2(path, directory / path.name)
    return directory
