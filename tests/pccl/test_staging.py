"""The C++ executor's GPU paths checked on CPU: staging through host memory (the mirror
and double-buffer schedule), GPU-aware MPI, native fp16/bf16 reductions on the device, and
workspaces from torch's allocators. The native layer's stand-in device (emulate_gpu) runs
queued stream work only when the CPU waits for it, so a missing wait or a host buffer
reused too early gives wrong values here, as it would on a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.support.mpirun import mpiexec


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_staged_and_gpu_aware_paths_match_host_memory(ranks):
    run = mpiexec(ranks, "-m tests.pccl.workers.run_emulated_gpu", timeout=600)
    assert run.returncode == 0 and "OK emulated" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_workspaces_come_from_torch_allocators():
    from pccl.executors.mpi_cpp import workspace

    block = workspace(4096, -1, False)
    assert block.dtype == torch.uint8 and block.numel() == 4096 and block.device.type == "cpu"
    if torch.cuda.is_available():
        before = torch.cuda.memory_allocated()
        on_gpu = workspace(1 << 20, 0, False)
        assert on_gpu.is_cuda and torch.cuda.memory_allocated() - before >= 1 << 20
        assert workspace(4096, -1, True).is_pinned()


def test_gpu_buffers_on_a_cpu_build_are_refused_before_anything_is_sent():
    from mpi4py import MPI

    from pccl import _native
    from pccl.algorithms import schedule
    from pccl.core.dtypes import dtype_code

    if _native.gpu_platform is not None:
        pytest.skip("this build has a GPU path")
    comm = _native.MpiComm(MPI.COMM_SELF, 10)
    x = torch.arange(4, dtype=torch.float32)
    ops = schedule("reduce_scatter", "ring", 1, 0).ops
    with pytest.raises(ValueError, match="built without GPU support"):
        comm.reduce_scatter(ops, x.data_ptr(), x.data_ptr(), 4, dtype_code(x.dtype), 0, 0, 0)
