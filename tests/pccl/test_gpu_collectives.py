"""Collectives on GPU tensors on all local GPUs, against a torch reference.

One mpiexec launch per mode (worker: tests/pccl/workers/run_gpu_nccl.py), one rank per GPU:
- nccl: pccl.init(transport="nccl"): every flat algorithm of every collective, native and
  auto; with 4+ GPUs the two-level plans (hierarchical, ho_ring) on nodes emulated with
  ranks_per_node (every divisor of the GPU count);
- staged / gpu_aware: the MPI transport on GPU tensors (needs a GPU build of pccl's native
  module): the pairwise reduce-scatter, auto and the plans over MPI levels, which
  tests/pccl/workers/run_gpu.py does not run, and the PCCL design intra="nccl", inter="mpi".
  On one GPU, 4 ranks share it over MPI (the PCCL design, whose NCCL groups need a GPU
  per rank, skips there).
fp32, bf16 and fp16; sum, avg and max; sync and async calls. Skipped, with the reason,
without a GPU, with fewer than 2 where NCCL carries the tensors, without NCCL in torch, or
without a GPU build where MPI carries them. make test-gpu runs these (docs/gpu.md, "GPU
test suite").
"""
from __future__ import annotations

import os

import pytest

from tests.pccl.workers.run_gpu_nccl import emulated_nodes, group_id, groups, needs_topology
from tests.support.gpu import GPUS, mpi_ranks, no_gpu_reason, no_mpi_gpu_reason
from tests.support.mpirun import check_group, report_of

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

WORKER = "-m tests.pccl.workers.run_gpu_nccl"

_reports: dict = {}


def ranks_of(mode: str) -> int:
    """NCCL: one rank per GPU; MPI: the same, or 4 ranks sharing one GPU."""
    return GPUS if mode == "nccl" else mpi_ranks()


def skip_reason(mode: str, transport: str, algorithm: str) -> str | None:
    if transport == "mpi":
        reason = no_mpi_gpu_reason()
    else:   # NCCL groups: one rank per GPU, 2+ of them
        reason = no_gpu_reason(2) or (transport == "pccl" and no_mpi_gpu_reason())
    if reason:
        return reason
    if mode == "gpu_aware" and os.environ.get("PCCL_TEST_GPU_AWARE_MPI") != "1":
        return "set PCCL_TEST_GPU_AWARE_MPI=1 where the MPI library is GPU-aware"
    if needs_topology(transport, algorithm) and not emulated_nodes(ranks_of(mode)):
        return f"needs emulated nodes: a rank count of 4+ that is not prime, here {ranks_of(mode)}"
    return None


CASES = [(mode, *g) for mode in ("nccl", "staged", "gpu_aware") for g in groups(mode)]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(mode: str) -> dict:
        return report_of(_reports, mode, tmp_path_factory.mktemp(mode), ranks_of(mode), WORKER, mode,
                         timeout=1200)
    return get


@pytest.mark.parametrize("mode,transport,collective,algorithm", CASES, ids=lambda v: str(v))
def test_gpu_collective_matches_reference(report, mode, transport, collective, algorithm):
    reason = skip_reason(mode, transport, algorithm)
    if reason:
        pytest.skip(reason)
    check_group(report(mode), group_id(transport, collective, algorithm))
