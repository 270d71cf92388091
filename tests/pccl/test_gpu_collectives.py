"""Collectives on GPU tensors on all local GPUs, against a torch reference.

One mpiexec launch per mode (worker: tests/pccl/workers/run_gpu_nccl.py), one rank per GPU:
- nccl: pccl.init(transport="nccl"): every flat algorithm of every collective, native and
  auto; with 4+ GPUs the two-level plans (hierarchical, ho_ring) on nodes emulated with
  ranks_per_node (every divisor of the GPU count);
- staged / gpu_aware: the MPI transport on GPU tensors (needs a GPU build of pccl's native
  module): the pairwise reduce-scatter, auto and the plans over MPI levels, which
  tests/pccl/workers/run_gpu.py does not run, and the PCCL design intra="nccl", inter="mpi".
fp32, bf16 and fp16; sum, avg and max; sync and async calls. Skipped, with the reason,
without a GPU, with fewer than 2, without NCCL in torch, or without a GPU build where MPI
carries GPU tensors. make test-gpu runs these (docs/gpu.md, "GPU test suite").
"""
from __future__ import annotations

import os
from functools import lru_cache

import pytest
import torch.distributed as dist

from tests.pccl.workers.run_gpu_nccl import emulated_nodes, group_id, groups, needs_topology
from tests.support.gpu import GPUS, launch_report, no_gpu_reason
from tests.support.mpirun import check_group

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

WORKER = "-m tests.pccl.workers.run_gpu_nccl"

_reports: dict = {}


@lru_cache(maxsize=1)
def gpu_build() -> str | None:
    """None when the MPI transport takes GPU tensors here, else why not."""
    try:
        from mpi4py import MPI  # noqa: F401 - loads libmpi for the native module

        from pccl.executors.mpi_cpp import gpu_available
    except ImportError as e:
        return f"pccl's native module does not load: {e}"
    if not gpu_available():
        return ("needs pccl's native module built for GPUs (make GPU=cuda or GPU=hip): "
                "pccl.executors.mpi_cpp.gpu_available() is False")
    return None


def skip_reason(mode: str, transport: str, algorithm: str) -> str | None:
    reason = no_gpu_reason(2, nccl=False)   # one rank per GPU
    if reason:
        return reason
    if transport in ("nccl", "pccl") and not dist.is_nccl_available():
        return "needs a torch built with NCCL (or RCCL): torch.distributed.is_nccl_available() is False"
    if transport in ("mpi", "pccl") and gpu_build() is not None:
        return gpu_build()
    if mode == "gpu_aware" and os.environ.get("PCCL_TEST_GPU_AWARE_MPI") != "1":
        return "set PCCL_TEST_GPU_AWARE_MPI=1 where the MPI library is GPU-aware"
    if needs_topology(transport, algorithm) and not emulated_nodes(GPUS):
        return f"needs emulated nodes: a GPU count of 4+ that is not prime, torch sees {GPUS}"
    return None


CASES = [(mode, *g) for mode in ("nccl", "staged", "gpu_aware") for g in groups(mode)]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(mode: str) -> dict:
        return launch_report(_reports, mode, tmp_path_factory.mktemp(mode), GPUS, WORKER, mode, timeout=1200)
    return get


@pytest.mark.parametrize("mode,transport,collective,algorithm", CASES, ids=lambda v: str(v))
def test_gpu_collective_matches_reference(report, mode, transport, collective, algorithm):
    reason = skip_reason(mode, transport, algorithm)
    if reason:
        pytest.skip(reason)
    check_group(report(mode), group_id(transport, collective, algorithm))
