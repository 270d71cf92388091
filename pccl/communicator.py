"""The Communicator: validated collectives over one process group, any executor."""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from . import validation
from .algorithms import schedule
from .dtypes import op_code
from .schedule import Schedule
from .selection import choose
from .work import SerialQueue, Work

DEFAULT_TIMEOUT = float(os.environ.get("PCCL_TIMEOUT", 300.0))
EXECUTORS = {"mpi": ("cpp", "python"), "torch": ("torch",)}


class Communicator:
    """Collectives over an mpi4py communicator or a torch.distributed process group.

    All ranks of the group must construct it together (it duplicates the MPI
    communicator) and then call the same collectives in the same order.
    """

    def __init__(self, comm, executor: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT):
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        import torch.distributed as dist

        if isinstance(comm, dist.ProcessGroup):
            from .executors.torch_p2p import TorchP2PExecutor

            self.transport = "torch"
            self.backend = dist.get_backend(comm)
            executor = self._check_executor(executor or "torch")
            self._executor = self._native = TorchP2PExecutor(comm, self.timeout)
            self.devices = ("cpu",) if self.backend == "gloo" else ("cuda",)
        else:
            from mpi4py import MPI

            if not isinstance(comm, MPI.Comm):
                raise TypeError(f"comm must be an mpi4py.MPI.Comm or a torch.distributed.ProcessGroup, "
                                f"got {type(comm).__name__}")
            from .executors.mpi_cpp import MpiCppExecutor

            self.transport = "mpi"
            self.backend = "mpi"
            executor = self._check_executor(executor or "cpp")
            self._native = MpiCppExecutor(comm, self.timeout)
            if executor == "python":
                from .executors.mpi_python import MpiPythonExecutor

                self._executor = MpiPythonExecutor(comm, self.timeout)
            else:
                self._executor = self._native
            self.devices = ("cpu",)
        self.executor = executor
        self.rank, self.size = self._native.rank, self._native.size
        self._queue = SerialQueue(f"pccl-{self.transport}")

    def _check_executor(self, executor: str) -> str:
        valid = EXECUTORS[self.transport]
        if executor not in valid:
            raise ValueError(f"executor {executor!r} does not run on transport {self.transport!r}; "
                             f"expected one of {valid}")
        return executor

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, transport={self.backend!r}, "
                f"executor={self.executor!r})")

    def _check_buffers(self, output: torch.Tensor, input: torch.Tensor, full: str) -> None:
        """Validate an (output, input) pair whose `full` side holds size blocks of the other."""
        validation.check_tensor("output", output, self.devices)
        validation.check_tensor("input", input, self.devices)
        validation.check_pair(output, input)
        big, small = (output, input) if full == "output" else (input, output)
        other = "input" if full == "output" else "output"
        validation.check_numel(full, big.numel(), self.size * small.numel(),
                               f"size * {other}.numel() = {self.size} * {small.numel()}")

    def _run(self, collective: str, algorithm: str, nbytes: int, async_op: bool,
             native: Callable[[], None], scheduled: Callable[[Schedule], None]) -> Optional[Work]:
        validation.check_algorithm(collective, algorithm)
        if algorithm == "auto":
            algorithm = choose(collective, nbytes, self.size)
        if algorithm == "native":
            return self._queue.run(native, async_op)
        sched = schedule(collective, algorithm, self.size, self.rank)
        return self._queue.run(lambda: scheduled(sched), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algorithm: str = "auto",
                   async_op: bool = False) -> Optional[Work]:
        """Gather every rank's `input` into `output`: rank i's input lands at block i."""
        self._check_buffers(output, input, full="output")
        return self._run("all_gather", algorithm, output.numel() * output.element_size(), async_op,
                         lambda: self._native.native_all_gather(output, input),
                         lambda sched: self._executor.all_gather(sched, output, input))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       algorithm: str = "auto", async_op: bool = False) -> Optional[Work]:
        """Reduce `input` over all ranks; this rank receives block `rank` in `output`."""
        self._check_buffers(output, input, full="input")
        op_code(op, input.dtype)
        return self._run("reduce_scatter", algorithm, input.numel() * input.element_size(), async_op,
                         lambda: self._native.native_reduce_scatter(output, input, op),
                         lambda sched: self._executor.reduce_scatter(sched, output, input, op))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto",
                   async_op: bool = False) -> Optional[Work]:
        """Reduce `tensor` over all ranks, in place."""
        validation.check_tensor("tensor", tensor, self.devices)
        op_code(op, tensor.dtype)
        return self._run("all_reduce", algorithm, tensor.numel() * tensor.element_size(), async_op,
                         lambda: self._native.native_all_reduce(tensor, op),
                         lambda sched: self._executor.all_reduce(sched, tensor, op))


def init(transport: str = "mpi", executor: Optional[str] = None,
         timeout: float = DEFAULT_TIMEOUT) -> Communicator:
    """A communicator over all ranks: MPI.COMM_WORLD ("mpi") or torch.distributed
    ("gloo", "nccl"; initialized from the environment or through MPI if needed)."""
    if transport == "mpi":
        from mpi4py import MPI

        return Communicator(MPI.COMM_WORLD, executor=executor, timeout=timeout)
    if transport in ("gloo", "nccl"):
        import torch.distributed as dist

        from .rendezvous import init_torch_distributed

        init_torch_distributed(transport, timeout)
        return Communicator(dist.group.WORLD, executor=executor, timeout=timeout)
    raise ValueError(f"transport must be 'mpi', 'gloo' or 'nccl', got {transport!r}")
