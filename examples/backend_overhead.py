"""The cost of one small collective through the pccl backend, against pccl itself and gloo.

    .venv/bin/mpiexec -n 4 .venv/bin/python examples/backend_overhead.py [--calls 300] [--repeats 5]

A 4-byte all-reduce (one float32), timed three ways in the same job, interleaved:
`dist.all_reduce` on the pccl backend, the same on the pccl group's own Communicator
(no torch.distributed layer), and `dist.all_reduce` on a gloo group of the same ranks.
Per way: the slowest rank's mean over `calls` calls, the median over `repeats` (the order of
the ways rotates between repeats); printed as a JSON line by rank 0.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import pccl.distributed

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=300)
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--algorithm", default="auto", help="what the pccl ways run (auto: the cost model's choice)")
args = parser.parse_args()

torch.set_num_threads(1)
pccl.distributed.init_process_group(options=pccl.distributed.Options(algorithm=args.algorithm))
gloo = dist.new_group(backend="gloo")
comm = dist.group.WORLD.comm
x = torch.ones(1)
ways = {"dist_on_pccl": lambda: dist.all_reduce(x),
        "pccl_communicator": lambda: comm.all_reduce(x, algorithm=args.algorithm),
        "dist_on_gloo": lambda: dist.all_reduce(x, group=gloo)}
samples = {name: [] for name in ways}
names = list(ways)
for repeat in range(args.repeats):
    for name in names[repeat % 3:] + names[:repeat % 3]:   # each way in each position, in turn
        call = ways[name]
        for _ in range(10):
            call()
        dist.barrier(group=gloo)
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        mine = torch.tensor([(time.perf_counter() - start) / args.calls])
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=gloo)
        samples[name].append(mine.item())
if dist.get_rank() == 0:
    result = {name: round(statistics.median(s) * 1e6, 1) for name, s in samples.items()}
    print(json.dumps({"ranks": dist.get_world_size(), "bytes": 4, "algorithm": args.algorithm,
                      "median_us_per_call": result,
                      "resolved": repr(comm.selector.resolve("all_reduce", args.algorithm, 4))}), flush=True)
