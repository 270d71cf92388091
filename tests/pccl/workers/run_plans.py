"""mpiexec worker: every two-level plan on one emulated topology, written as a JSON report.

Usage: mpiexec -n P python -m tests.pccl.workers.run_plans RANKS_PER_NODE REPORT.json
Consecutive groups of RANKS_PER_NODE ranks are treated as nodes, and where cases.PLAN_GROUPS
says so, consecutive nodes as network groups (the three-level plans' topology).
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from tests.pccl.workers.cases import (
    AGREEING_PLANS,
    PLAN_GROUPS,
    PLAN_TRANSPORTS,
    REDUCING,
    combos,
    group_id,
    light_combos,
    plan_groups,
)
from tests.pccl.workers.harness import agreement, run_group

torch.set_num_threads(1)
world = MPI.COMM_WORLD
SPECS = {
    "hierarchical": "hierarchical",
    "ho_ring": "ho_ring",
    "hier_ring_ring": pccl.Hierarchical(inter="ring", intra="ring"),
    "hier_bruck_native": pccl.Hierarchical(inter="bruck", intra="native"),
    "three_level": "three_level",
}


def async_plans(comm) -> list[str]:
    """Two async plans and a sync one queued between them, in issue order."""
    p, rank = comm.size, comm.rank
    x, out = torch.full((100,), float(rank)), torch.empty(100 * p)
    w1 = comm.all_gather(out, x, algorithm="hierarchical", async_op=True)
    y = torch.full((3 * p,), 1.0)
    o = torch.empty(3)
    comm.reduce_scatter(o, y, algorithm="ho_ring")
    z = torch.full((11,), float(rank))
    w2 = comm.all_reduce(z, op="max", algorithm="ho_ring", async_op=True)
    w2.wait()
    w1.wait()
    problems = []
    if not torch.equal(out, torch.arange(p, dtype=torch.float32).repeat_interleave(100)):
        problems.append("async hierarchical all_gather wrong")
    if not torch.equal(o, torch.full((3,), float(p))):
        problems.append("queued ho_ring reduce_scatter wrong")
    if not torch.equal(z, torch.full((11,), float(p - 1))):
        problems.append("async ho_ring all_reduce wrong")
    return problems


def main() -> None:
    ranks_per_node, path = int(sys.argv[1]), sys.argv[2]
    p = world.size
    topology = pccl.Topology.regular(p, ranks_per_node, 1, PLAN_GROUPS.get((p, ranks_per_node)))
    comms = {label: pccl.init(timeout=60, topology=topology, **kwargs)
             for label, (kwargs, _, _) in PLAN_TRANSPORTS.items()}
    report = {}
    for transport, collective, spec in plan_groups():
        whole = spec in PLAN_TRANSPORTS[transport][2]
        cases = list((combos if whole else light_combos)(collective, p))
        try:
            report[group_id(transport, collective, spec)] = run_group(comms[transport], collective, SPECS[spec], cases,
                                                                      signs=spec in AGREEING_PLANS)
        except Exception:  # noqa: BLE001
            report[group_id(transport, collective, spec)] = [traceback.format_exc()]
    for label, comm in comms.items():
        report[f"_async-{label}"] = async_plans(comm)
    for collective in REDUCING:
        for spec in AGREEING_PLANS:
            report[f"_agree-{collective}-{spec}"] = agreement(comms, collective, SPECS[spec])
    if world.rank == 0:
        Path(path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
