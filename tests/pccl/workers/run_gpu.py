"""mpiexec worker: collectives on CUDA tensors through the C++ executor, checked against
the same call on CPU tensors. Usage: mpiexec -n P python -m tests.pccl.workers.run_gpu
Prints "OK gpu" on rank 0 when every case matched."""
from __future__ import annotations

import torch

import pccl
from tests.pccl.workers.cases import make_input

comm = pccl.init(executor="cpp", timeout=120)
p, rank = comm.size, comm.rank
torch.cuda.set_device(rank % torch.cuda.device_count())
failures = []
for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
    for n in (1, 7, 1001, 1 << 18):
        for algorithm in ("ring", "recursive_doubling", "bruck", "native"):
            x = make_input(rank, n, dtype, n)
            cpu_out, gpu_out = torch.empty(n * p, dtype=dtype), torch.empty(n * p, dtype=dtype, device="cuda")
            comm.all_gather(cpu_out, x, algorithm=algorithm)
            comm.all_gather(gpu_out, x.cuda(), algorithm=algorithm)
            if not torch.equal(gpu_out.cpu(), cpu_out):
                failures.append(f"all_gather {algorithm} {dtype} n={n}")
        for algorithm in ("ring", "recursive_halving", "native"):
            for op in ("sum", "max") + (("avg",) if dtype.is_floating_point else ()):
                x = make_input(rank, n * p, dtype, n)
                cpu_out, gpu_out = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype, device="cuda")
                comm.reduce_scatter(cpu_out, x, op=op, algorithm=algorithm)
                work = comm.reduce_scatter(gpu_out, x.cuda(), op=op, algorithm=algorithm, async_op=True)
                work.wait()
                if not torch.equal(gpu_out.cpu(), cpu_out):   # exact sums of small integers; avg divides alike
                    failures.append(f"reduce_scatter {algorithm} {op} {dtype} n={n}")
        for algorithm in ("ring", "recursive_doubling", "rabenseifner", "native"):
            x = make_input(rank, n, dtype, n)
            cpu, gpu = x.clone(), x.cuda()
            comm.all_reduce(cpu, algorithm=algorithm)
            comm.all_reduce(gpu, algorithm=algorithm)
            if not torch.equal(gpu.cpu(), cpu):
                failures.append(f"all_reduce {algorithm} {dtype} n={n}")
torch.cuda.synchronize()
assert not failures, failures[:10]
if rank == 0:
    print("OK gpu", flush=True)
