"""Communicators of one shape in different processes measuring at once, as the groups of a
nested strategy do, into one cache directory (tests/pccl/test_self_calibration.py):

    mpiexec -n 4 python -m tests.pccl.workers.run_calibration_groups DIR REPORT

The world splits into two groups of 2, whose ranks 0 are different processes (world ranks 0
and 2). Each group's first auto all-gather measures, then a call beyond the sweep reaches
its size (4 MB). Rank 0 writes to REPORT what every rank decides with and what the file holds."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from pccl.tuning import self_calibration as sc

root, report_path = Path(sys.argv[1]), Path(sys.argv[2])
world = MPI.COMM_WORLD
torch.set_num_threads(1)
os.environ.update(PCCL_SELF_CALIBRATION="1", PCCL_CACHE_DIR=str(root), PCCL_CALIBRATION_BUDGET="0.05")
sc.REACH = 1e6   # every reach fits: this checks whose figures are kept, not the budget

BEYOND = 4 << 20   # bytes: beyond what a sweep of this budget reaches

group = pccl.init().split([[0, 1], [2, 3]])
p, rank = group.size, group.rank
gathered = torch.empty(4 * p)   # the sizes a group asks for do not depend on what it measured, as in an engine
group.all_gather(gathered, torch.full((4,), float(rank)))
block = torch.full((BEYOND // (4 * p),), float(rank))
full = torch.empty(p * len(block))
group.all_gather(full, block)
own = group.selector.self_calibration
world.Barrier()   # both groups done: what the file holds now is what the next run reads
stored = sc.read(own.path, own.key)[0].get("all_gather")
exact = torch.equal(gathered, torch.arange(p).repeat_interleave(4).float()) and \
    torch.equal(full, torch.arange(p).repeat_interleave(len(block)).float())
mine = {"figures": own.measured["all_gather"], "stored": stored, "measured_now": sorted(own.seconds),
        "grown": sc.largest(own.measured["all_gather"]) >= BEYOND, "path": str(own.path), "exact": exact}
everyone = world.gather(mine, root=0)
if world.rank == 0:
    report_path.write_text(json.dumps(everyone))
group.close()
