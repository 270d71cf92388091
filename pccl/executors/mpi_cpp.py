"""The fast path: schedules and MPI's own collectives run by the C++ executor (GIL released)."""
from __future__ import annotations

import torch
from mpi4py import MPI

from .. import _native
from ..dtypes import dtype_code, op_code
from ..schedule import Schedule


def check_same_mpi() -> None:
    """The extension must use the MPI library mpi4py loaded (same vendor)."""
    loaded = MPI.Get_library_version()
    if _native.compiled_mpi.lower() not in loaded.lower():
        raise ImportError(
            f"pccl's native module was built against {_native.compiled_mpi} but mpi4py loaded: "
            f"{loaded.splitlines()[0]}. Rebuild pccl with the MPI that mpi4py uses (see README).")


check_same_mpi()


class MpiCppExecutor:
    def __init__(self, comm: MPI.Comm, timeout: float):
        self.native = _native.MpiComm(comm, timeout)
        self.rank, self.size = self.native.rank, self.native.size

    def all_gather(self, sched: Schedule, output: torch.Tensor, input: torch.Tensor) -> None:
        self.native.all_gather(sched.ops, output.data_ptr(), input.data_ptr(), input.numel(),
                               dtype_code(input.dtype))

    def reduce_scatter(self, sched: Schedule, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        self.native.reduce_scatter(sched.ops, output.data_ptr(), input.data_ptr(), output.numel(),
                                   dtype_code(input.dtype), op_code(op, input.dtype))

    def all_reduce(self, sched: Schedule, tensor: torch.Tensor, op: str) -> None:
        self.native.all_reduce(sched.ops, tensor.data_ptr(), tensor.numel(), dtype_code(tensor.dtype),
                               op_code(op, tensor.dtype))

    def native_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.native.native_all_gather(output.data_ptr(), input.data_ptr(), input.numel(), dtype_code(input.dtype))

    def native_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        self.native.native_reduce_scatter(output.data_ptr(), input.data_ptr(), output.numel(),
                                          dtype_code(input.dtype), op_code(op, input.dtype))

    def native_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        self.native.native_all_reduce(tensor.data_ptr(), tensor.numel(), dtype_code(tensor.dtype),
                                      op_code(op, tensor.dtype))
