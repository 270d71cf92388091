"""mpiexec worker: every rank decides "auto" from rank 0's machine profile.

Usage: mpiexec -n 4 python -m tests.pccl.workers.run_profile REPORT.json
Rank 0 names "frontier", the others "perlmutter" (PCCL_PROFILE); then rank 0 alone names
a missing file, which must fail on every rank, not only on rank 0.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from pccl.tuning import profiles as profile
from pccl.tuning.selection import Tuner

torch.set_num_threads(1)
world = MPI.COMM_WORLD
report: dict = {}

os.environ["PCCL_PROFILE"] = "frontier" if world.rank == 0 else "perlmutter"
comm = pccl.init(ranks_per_node=2)
report["names"] = world.allgather(comm.selector.profile.name)
reference = Tuner(comm.topology, profile.load("frontier"), natives=comm.selector.tuner.natives)
sizes = [1 << k for k in range(10, 31, 2)]
report["same_choice"] = all(comm.selector.resolve(c, "auto", n) == reference.choose(c, n)
                            for c in ("all_gather", "reduce_scatter", "all_reduce") for n in sizes)
x = torch.arange(8, dtype=torch.float32) + world.rank
out = torch.empty(8 * world.size)
comm.all_gather(out, x)  # auto, with the agreed profile
report["gathered"] = bool(torch.equal(out, torch.cat([torch.arange(8.0) + r for r in range(world.size)])))

os.environ["PCCL_PROFILE"] = "/nonexistent/profile.json" if world.rank == 0 else "generic"
try:
    pccl.init(ranks_per_node=2)
    report["bad_profile"] = "no error"
except ValueError as e:
    report["bad_profile"] = str(e)

others = world.gather(report["bad_profile"], root=0)
if world.rank == 0:
    report["others_bad_profile"] = others[1:]
    Path(sys.argv[1]).write_text(json.dumps(report))
