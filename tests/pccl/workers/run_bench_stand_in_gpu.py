"""mpiexec worker: pccl-bench --device cuda on a stand-in GPU, for machines without one.
torch.cuda's answers are stand-ins (GPUS GPUs per node, a GPU build, NCCL in torch) and the
buffers stay on the host, but the rest is the GPU path: each rank's GPU from its local
rank, the executors and rows skipped and why, the device header, the timing around a
synchronize (counted) and the check against the host reference. Usage:
mpiexec -n P python -m tests.pccl.workers.run_bench_stand_in_gpu GPUS [pccl-bench args]
Rank 0 prints "chosen: [GPU of each rank]" and "synchronized: N" on stderr at the end."""
from __future__ import annotations

import sys

import torch.distributed as dist
from mpi4py import MPI

from pccl.tools import bench

GPUS = int(sys.argv[1])
chosen: list[int] = []
syncs = [0]

bench.visible_gpus = lambda: GPUS
bench.use_gpu = lambda local_rank: chosen.append(local_rank % GPUS) or "Stand-in GPU"
bench.gpu_mpi = lambda: (True, False)   # GPU kernels, MPI staged
dist.is_nccl_available = lambda: True


class HostCase(bench.Case):
    """A case on host buffers that runs the GPU path (device "cuda": its synchronize around each timed loop)."""

    def __init__(self, *args):
        *head, device = args
        super().__init__(*head)
        self.device = device

    def synchronize(self) -> None:
        syncs[0] += 1


bench.Case = HostCase
try:
    bench.main(sys.argv[2:])
finally:
    world = MPI.COMM_WORLD
    every = world.gather(chosen, root=0)
    if world.rank == 0:
        print(f"chosen: {[c for mine in every for c in mine]}", file=sys.stderr)
        print(f"synchronized: {syncs[0]}", file=sys.stderr, flush=True)
