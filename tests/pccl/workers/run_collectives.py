"""mpiexec worker: run the whole collective matrix for one world size, write a JSON report.

Usage: mpiexec -n P python -m tests.pccl.workers.run_collectives REPORT.json
The report maps group ids to the list of failing combinations (empty when it passed),
plus "_bad_input" for the argument-validation round trip and "_agree-COLLECTIVE-ALGORITHM"
for the executors' bit-identical avg of random values.
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from pccl.algorithms import NATIVES, algorithms_for
from tests.pccl.workers.cases import EXECUTORS, REDUCING, cases_for, group_id, groups
from tests.pccl.workers.harness import agreement, run_group

torch.set_num_threads(1)
world = MPI.COMM_WORLD
p, rank = world.size, world.rank


def bad_input_round_trip(comm) -> list[str]:
    """Every bad call must raise before sending; the communicator must work afterwards."""
    x, out = torch.ones(4), torch.empty(4 * p)
    bad_calls = [
        (ValueError, lambda: comm.all_gather(torch.empty(4 * p + 1), x)),
        (ValueError, lambda: comm.reduce_scatter(torch.empty(3), torch.ones(4 * p))),
        (TypeError, lambda: comm.all_gather(out, torch.ones(4, dtype=torch.float64))),
        (ValueError, lambda: comm.all_gather(torch.empty(8 * p)[::2], x)),
        (ValueError, lambda: comm.all_reduce(x, op="prod")),
        (ValueError, lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32), op="avg")),
        (TypeError, lambda: comm.all_reduce(torch.ones(4, dtype=torch.uint8))),
        (ValueError, lambda: comm.all_reduce(x, algorithm="tree")),
        (ValueError, lambda: comm.all_gather(out, x, algorithm="recursive_halving")),
        (ValueError, lambda: comm.all_gather(out.to("meta"), x)),
        (TypeError, lambda: comm.all_reduce([1.0, 2.0])),
    ]
    problems = []
    for i, (expected, call) in enumerate(bad_calls):
        try:
            call()
            problems.append(f"bad call {i} raised nothing")
        except expected:
            pass
        except Exception as e:  # noqa: BLE001
            problems.append(f"bad call {i} raised {type(e).__name__} instead of {expected.__name__}: {e}")
    y = torch.full((5,), float(rank))
    comm.all_reduce(y)
    if not torch.equal(y, torch.full((5,), float(sum(range(p))))):
        problems.append(f"communicator unusable after bad input: {y}")
    return problems


def main() -> None:
    report: dict[str, list[str]] = {}
    comms = {}
    for executor in EXECUTORS:
        comms[executor] = (pccl.init(transport="gloo", timeout=60) if executor == "gloo"
                           else pccl.init(executor=executor, timeout=60))
        report[f"_bad_input-{executor}"] = bad_input_round_trip(comms[executor])
    for executor, collective, algorithm in groups():
        try:
            report[group_id(executor, collective, algorithm)] = run_group(
                comms[executor], collective, algorithm, cases_for(executor, algorithm, collective, p),
                signs=algorithm not in NATIVES)   # the transport's own max signs zeros as its library does
        except Exception:  # noqa: BLE001
            report[group_id(executor, collective, algorithm)] = [traceback.format_exc()]
    for collective in REDUCING:
        for algorithm in algorithms_for(collective):
            report[f"_agree-{collective}-{algorithm}"] = agreement(comms, collective, algorithm)
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
