"""mpiexec worker: pccl-bench's auto rows name what their calls ran.

Usage: mpiexec -n 2 python -m tests.pccl.workers.run_bench_auto_pick REPORT.json
Each auto row of measure() against what its calls ran (the choices the transport was
handed to run, recorded), for sums, floating-point max (which takes a schedule where
auto would pick MPI's own) and an int8-compressed auto (which never runs MPI's own).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from pccl.tools import bench

torch.set_num_threads(1)
world = MPI.COMM_WORLD
comm = pccl.init(executor="python")
handed: list = []
runs = comm.carrier.runs
comm.carrier.runs = lambda choice, *rest: handed.append(choice.algorithm) or runs(choice, *rest)
rows, wrong = [], []
for op, compression in (("sum", "none"), ("max", "none"), ("sum", "int8")):
    for collective in ("reduce_scatter", "all_reduce"):
        for nbytes in (4096, 65536):
            args = argparse.Namespace(iters=2, warmup_iters=1, repeats=1, check=1, datatype="float", op=op)
            case = bench.Case(collective, nbytes, torch.float32, op, world.rank, world.size)
            case.fill()
            case.call(comm, "auto", compression)()   # where auto first measures its candidates
            comm._calls.clear()   # (a cached call is not handed over again)
            handed.clear()
            row, = bench.measure(case, [("python", comm, "auto", compression)], args, world)
            ran = set(handed)
            rows.append(f"{collective} {nbytes} {op} {compression}: labelled {row.picked}, ran {sorted(ran)}")
            if ran != {row.picked}:
                wrong.append(rows[-1])
if world.rank == 0:
    Path(sys.argv[1]).write_text(json.dumps({"wrong": wrong, "rows": rows}))
