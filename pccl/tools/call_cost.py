"""pccl-call-cost: what one small collective costs, stage by stage, from Python to MPI.

    mpiexec -n 4 pccl-call-cost --bytes 4 --calls 2000 --repeats 7

Each row times the same all-reduce (`--bytes` of float32, sum) entered one layer higher,
so the difference between consecutive rows is what that layer adds:

  mpi4py         MPI_Allreduce through mpi4py on a numpy buffer (MPI's own fixed cost)
  native entry   the C++ executor's MPI_Allreduce, called directly (binding, pointers)
  schedule       the C++ executor running the ring schedule, called directly
  call(ring)     Communicator.all_reduce with an explicit algorithm: after the first
                 call, the call cache's key and lookup, then the executor inline (the
                 first call validates, resolves and looks the schedule up once)
  call(native)   Communicator.all_reduce(algorithm="native")
  call(auto)     Communicator.all_reduce(algorithm="auto") (resolved once, like the others)

Microseconds per call: the slowest rank's mean over --calls, median over --repeats; the
rows take turns, so a burst of other work slows one repeat of each row, not one row.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from mpi4py import MPI

import pccl
from pccl.algorithms import schedule
from pccl.tools.cli import time_calls
from runkit.args import at_least
from runkit.closed_pipe import quiet_when_its_reader_goes


@quiet_when_its_reader_goes
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="pccl-call-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=at_least(4), default=4, help="buffer bytes (float32 elements x 4)")
    ap.add_argument("--calls", type=at_least(1), default=2000)
    ap.add_argument("--repeats", type=at_least(1), default=7)
    ap.add_argument("--executor", choices=("cpp", "python"), default="cpp")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.bytes % 4:   # (it timed the float32 elements that fit, and reported the bytes asked)
        ap.error(f"--bytes must be a multiple of 4 (float32 elements), got {args.bytes}")
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = pccl.init(executor=args.executor)
    n = args.bytes // 4
    tensor = torch.ones(n)
    array = np.ones(n, dtype=np.float32)
    out = np.empty_like(array)
    sched = schedule("all_reduce", "ring", comm.size, comm.rank)   # what call(ring) runs
    executor = comm.carrier.runner
    rows = {
        "mpi4py": lambda: world.Allreduce(array, out, op=MPI.SUM),
        "native entry": lambda: comm.carrier.native.native_all_reduce(tensor, "sum"),
        "schedule": lambda: executor.all_reduce(sched, tensor, "sum"),
        "call(ring)": lambda: comm.all_reduce(tensor, algorithm="ring"),
        "call(native)": lambda: comm.all_reduce(tensor, algorithm="native"),
        "call(auto)": lambda: comm.all_reduce(tensor),
    }
    seconds = time_calls(list(rows.values()), args.calls, max(10, args.calls // 10), args.repeats, world)
    times = {name: 1e6 * s for name, s in zip(rows, seconds)}
    if world.rank == 0:
        if args.json:
            print(json.dumps({"ranks": world.size, "bytes": args.bytes, "executor": args.executor,
                              "us_per_call": {k: round(v, 2) for k, v in times.items()}}))
        else:
            print(f"# {world.size} ranks, {args.bytes} bytes, {args.executor} executor: us per call")
            base = times["mpi4py"]
            for name, us in times.items():
                print(f"{name:>14}  {us:8.2f}  {us / base:5.2f}x mpi4py")


if __name__ == "__main__":
    main()
