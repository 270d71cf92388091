"""The kinds of transport: which tensors each one carries, whether this machine has it, and the MPI
thread level pccl needs. The communicator asks these questions before anything is sent.

  mpi   MPI point-to-point (the C++ executor): host tensors, and GPU tensors where the
        native module was built for GPUs and a GPU is present
  gloo  torch.distributed's gloo: host tensors
  nccl  torch.distributed's NCCL (RCCL in ROCm builds of torch, under the same name):
        GPU tensors

A torch.distributed group may also carry a device map such as "cpu:gloo,cuda:nccl", as
dist.get_backend reports it; it carries the devices it names.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

TORCH_BACKENDS = ("gloo", "nccl")
TRANSPORTS = ("mpi",) + TORCH_BACKENDS
DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",)}


def devices_of(transport: str, gpu_mpi: bool = False) -> tuple[str, ...]:
    """The device types a transport's tensors may live on. gpu_mpi: whether the MPI path
    takes GPU tensors here (a GPU build of the native module and a GPU)."""
    if transport == "mpi":
        return ("cpu", "cuda") if gpu_mpi else ("cpu",)
    if transport in DEVICES:
        return DEVICES[transport]
    pairs = [pair.split(":") for pair in transport.split(",")]
    if all(len(p) == 2 and p[1].strip() in DEVICES for p in pairs):
        return tuple(dict.fromkeys(p[0].strip() for p in pairs))
    raise ValueError(f"transport must be one of {TRANSPORTS} or a torch device map such as 'cpu:gloo,cuda:nccl', "
                     f"got {transport!r}")


def uses_torch(transport: str) -> bool:
    """Whether a transport is a torch.distributed backend (a process group)."""
    return transport != "mpi"


def check_available(transport: str) -> None:
    """Raise ValueError, before any group is created, when this machine cannot run `transport`."""
    if "nccl" not in transport:
        return
    if not torch.cuda.is_available():
        raise ValueError(f"transport {transport!r} needs a GPU (NCCL on CUDA, RCCL on ROCm) and this machine has "
                         "none visible to torch; use 'gloo' or 'mpi' for host tensors")
    if not dist.is_nccl_available():
        raise ValueError(f"transport {transport!r} needs a torch built with NCCL (or RCCL); this torch has neither")


def check_level_devices(device: str, levels: dict[str, str], supported: tuple[str, ...]) -> None:
    """Raise ValueError when a two-level plan over `levels` cannot take a `device` tensor."""
    if device not in supported:
        described = ", ".join(f"{level}={transport!r}" for level, transport in levels.items())
        raise ValueError(f"a two-level plan over {described} takes {supported} tensors, got a {device} tensor; "
                         "for GPU tensors use intra='nccl' (and inter='nccl' or GPU-aware 'mpi'), or a flat algorithm")


# Why every MPI communicator needs MPI_THREAD_MULTIPLE: each runs its asynchronous calls
# on a worker thread, the engine's two lanes are two communicators at work at once, and a
# plan's concurrent phases (HO-Ring) call MPI from two threads together.
THREAD_HINT = ("request it before MPI starts (pccl.init does; with mpi4py keep mpi4py.rc.thread_level = "
               "'multiple', its default) and enable it in the library: Cray MPICH needs "
               "MPICH_MAX_THREAD_SAFETY=multiple")


def check_thread_level(provided: int, names: dict[int, str]) -> None:
    """Raise RuntimeError unless MPI provides MPI_THREAD_MULTIPLE. names: each level's
    value (as the MPI library numbers them) to its name, e.g. {MPI.THREAD_MULTIPLE:
    "MPI_THREAD_MULTIPLE", ...}."""
    multiple = next(level for level, name in names.items() if name == "MPI_THREAD_MULTIPLE")
    if provided != multiple:
        raise RuntimeError(f"pccl calls MPI from several threads at once and needs MPI_THREAD_MULTIPLE, but this "
                           f"MPI provides {names.get(provided, provided)}: {THREAD_HINT}")
