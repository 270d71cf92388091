"""A smoke check to run on every rank of an emulated cluster: detect the topology, all-gather
a float32 buffer with pccl, check every value, time the calls. Rank 0 prints one JSON line:

    {"hosts": [host of each rank], "nodes": [[ranks of each node]], "ok": true,
     "algorithm": "ring", "count": elements, "itemsize": 4, "seconds": [per timed call]}

(seconds: the slowest rank's time of each call, between barriers.)

    python launch/emulate/run.py --nodes 2 --ranks-per-node 2 -- \\
        .venv/bin/python launch/emulate/check.py --bytes 1M --algorithm ring
"""
from __future__ import annotations

import argparse
import json
import socket
import time

SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * SUFFIX[text[-1]]) if text[-1:] in SUFFIX else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=size, default=1 << 20, help="all-gather output bytes (K/M/G)")
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--iters", type=int, default=2, help="timed calls after one warm-up call")
    args = ap.parse_args()

    import torch
    from mpi4py import MPI

    import pccl

    comm = pccl.init()
    world = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    block = max(1, args.bytes // 4 // p)
    shard = torch.arange(block, dtype=torch.float32) + rank * block
    out = torch.empty(p * block, dtype=torch.float32)
    seconds, ok = [], True
    for i in range(1 + args.iters):
        out.fill_(-1)
        world.Barrier()
        start = time.perf_counter()
        comm.all_gather(out, shard, algorithm=args.algorithm)
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        ok = ok and torch.equal(out, torch.arange(p * block, dtype=torch.float32))
        if i:
            seconds.append(elapsed)
    ok = world.allreduce(ok, op=MPI.LAND)
    hosts = world.gather(socket.gethostname(), root=0)
    if rank == 0:
        print(json.dumps({"hosts": hosts, "nodes": [list(n) for n in comm.topology.nodes], "ok": ok,
                          "algorithm": args.algorithm, "count": p * block, "itemsize": 4,
                          "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
