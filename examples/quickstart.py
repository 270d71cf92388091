"""pccl in a few lines. Run: .venv/bin/mpiexec -n 4 .venv/bin/python examples/quickstart.py"""
import torch

import pccl

comm = pccl.init()                      # MPI.COMM_WORLD, C++ executor
rank, size = comm.rank, comm.size

# All-gather: rank i's input lands in block i of the output.
shard = torch.full((3,), float(rank))
full = torch.empty(3 * size)
comm.all_gather(full, shard, algorithm="recursive_doubling")

# Reduce-scatter: every rank contributes a full buffer and keeps its reduced block.
grads = torch.arange(2.0 * size) * (rank + 1)
mine = torch.empty(2)
comm.reduce_scatter(mine, grads, op="avg", algorithm="ring")

# All-reduce, asynchronously: the call returns at once; wait() when the result is needed.
t = torch.ones(1000, dtype=torch.bfloat16)
work = comm.all_reduce(t, op="sum", algorithm="rabenseifner", async_op=True)
# ... compute here while the collective runs ...
work.wait()

# Broadcast: rank 0's values (or any picklable value) on every rank; a barrier.
seed = torch.tensor([1234 if rank == 0 else 0])
comm.broadcast(seed, root=0)
settings = comm.broadcast_object({"lr": 3e-4} if rank == 0 else None)
comm.barrier()
assert seed.item() == 1234 and settings == {"lr": 3e-4}

if rank == 0:
    print(f"{comm}\nall_gather -> {full.tolist()}\nreduce_scatter(avg) -> {mine.tolist()}\n"
          f"all_reduce(bf16) -> {t[0].item()} (= size)\nbroadcast -> {seed.item()}, {settings}")
