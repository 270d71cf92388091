"""The fast path: schedules and MPI's own collectives run by the C++ executor (GIL released).

CPU tensors, and GPU tensors where the build has a GPU path: local work is queued on the
caller's current stream. With a GPU-aware MPI (see gpu_aware_mpi) MPI gets device
pointers; otherwise messages are staged through pinned host memory. The executor's GPU
and pinned workspaces come from torch's allocators (workspace), so they are counted in
torch's memory statistics and never cost a cudaMalloc once grown.
"""
from __future__ import annotations

import os

import torch
from mpi4py import MPI

from pccl import _native
from pccl.core.dtypes import dtype_code, op_code
from pccl.ir.compressed import compress
from pccl.ir.schedule import Schedule


def check_same_mpi() -> None:
    """The extension must use the MPI library mpi4py loaded (same vendor)."""
    loaded = MPI.Get_library_version()
    if _native.compiled_mpi.lower() not in loaded.lower():
        raise ImportError(
            f"pccl's native module was built against {_native.compiled_mpi} but mpi4py loaded: "
            f"{loaded.splitlines()[0]}. Rebuild pccl with the MPI that mpi4py uses (see README).")


check_same_mpi()


def gpu_aware_mpi(env=os.environ, query=_native.mpi_gpu_support) -> bool:
    """Whether MPI may be handed device pointers: PCCL_GPU_AWARE_MPI=1 or 0 decides where
    set; else the library's own answer where it has a query (MPICH >= 4.0, Open MPI built
    with its CUDA/ROCm extension); else Cray MPICH's switch, MPICH_GPU_SUPPORT_ENABLED=1.
    Otherwise GPU buffers are staged through host memory."""
    setting = env.get("PCCL_GPU_AWARE_MPI")
    if setting is not None:
        if setting not in ("0", "1"):
            raise ValueError(f"PCCL_GPU_AWARE_MPI must be 0 or 1, got {setting!r}")
        return setting == "1"
    answer = query("hip" if _native.gpu_platform == "hip" else "cuda")
    if answer >= 0:
        return bool(answer)
    return env.get("MPICH_GPU_SUPPORT_ENABLED") == "1"


def gpu_available() -> bool:
    """Whether the native layer can take GPU tensors here."""
    return _native.gpu_platform is not None and torch.cuda.is_available()


def placement(t: torch.Tensor) -> tuple[int, int]:
    """(device index, stream handle) for the native layer; (-1, 0) for host memory."""
    if t.is_cpu:
        return -1, 0
    return t.device.index, torch.cuda.current_stream(t.device).cuda_stream


def workspace(nbytes: int, device: int, pinned: bool) -> torch.Tensor:
    """A workspace block for the native executor: GPU memory from torch's caching allocator
    (allocated on the calling thread's current stream, the one the executor uses), or
    page-locked host memory from torch's pinned allocator for staging."""
    if device >= 0:
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def exit_timer(seconds: float, code: int, message: str):
    """A native thread that ends the process with `code`, saying `message` on stderr,
    unless the returned timer's cancel() comes within `seconds`; it needs no GIL
    (pccl.runtime.teardown times MPI's finalize with it)."""
    return _native.ExitTimer(seconds, code, message)


class MpiCppExecutor:
    def __init__(self, comm: MPI.Comm, timeout: float):
        self.native = _native.MpiComm(comm, timeout, gpu_aware_mpi(), allocate=workspace)
        self.rank, self.size = self.native.rank, self.native.size

    @staticmethod
    def takes(codec) -> bool:
        """Whether it runs schedules compressed with `codec`: the native codecs (int8, bf16,
        fp16, and their p2p: baselines), on host buffers."""
        return codec.native is not None

    @staticmethod
    def _table(sched: Schedule, codec) -> tuple:
        """The ops table and codec code of a call: the schedule's, or its compressed plan's."""
        return (sched.ops, -1) if codec is None else (compress(sched, codec.per_message).ops, codec.native)

    def all_gather(self, sched: Schedule, output: torch.Tensor, input: torch.Tensor, codec=None) -> None:
        ops, code = self._table(sched, codec)
        self.native.all_gather(ops, output.data_ptr(), input.data_ptr(), input.numel(),
                               dtype_code(input.dtype), *placement(input), code)

    def reduce_scatter(self, sched: Schedule, output: torch.Tensor, input: torch.Tensor, op: str,
                       codec=None) -> None:
        ops, code = self._table(sched, codec)
        self.native.reduce_scatter(ops, output.data_ptr(), input.data_ptr(), output.numel(),
                                   dtype_code(input.dtype), op_code(op, input.dtype), *placement(input), code)

    def all_reduce(self, sched: Schedule, tensor: torch.Tensor, op: str, codec=None) -> None:
        ops, code = self._table(sched, codec)
        self.native.all_reduce(ops, tensor.data_ptr(), tensor.numel(), dtype_code(tensor.dtype),
                               op_code(op, tensor.dtype), *placement(tensor), code)

    # MPI's own collectives. polled: the nonblocking call (MPI_Iallgather, ...), tested until
    # done like a schedule's messages, so a missing peer raises CollectiveTimeout; else the
    # blocking call, which a missing peer leaves to the watchdog.
    def native_all_gather(self, output: torch.Tensor, input: torch.Tensor, polled: bool = False) -> None:
        self.native.native_all_gather(output.data_ptr(), input.data_ptr(), input.numel(), dtype_code(input.dtype),
                                      *placement(input), polled)

    def native_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, polled: bool = False) -> None:
        self.native.native_reduce_scatter(output.data_ptr(), input.data_ptr(), output.numel(),
                                          dtype_code(input.dtype), op_code(op, input.dtype), *placement(input),
                                          polled)

    def native_all_reduce(self, tensor: torch.Tensor, op: str, polled: bool = False) -> None:
        self.native.native_all_reduce(tensor.data_ptr(), tensor.numel(), dtype_code(tensor.dtype),
                                      op_code(op, tensor.dtype), *placement(tensor), polled)

    def native_broadcast(self, tensor: torch.Tensor, root: int, polled: bool = False) -> None:
        self.native.native_broadcast(tensor.data_ptr(), tensor.numel(), dtype_code(tensor.dtype), root,
                                     *placement(tensor), polled)

    def native_barrier(self, polled: bool = False) -> None:
        self.native.native_barrier(polled)
