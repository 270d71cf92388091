"""mpiexec worker: the engine's trace on real ranks against its dry run (shard/planning/predict.py).

Usage: mpiexec -n 4 python -m tests.shard.workers.run_trace REPORT.json

On 2 emulated nodes of 2 ranks, for several strategies and collective layers, one step of
a tiny transformer is traced twice: on this rank's real communicator with real values,
and on the meta device over a DryRunCommunicator of the same topology and profile. Every
rank reports whether the two event sequences (computations, lane tasks with their
collectives' levels, sizes and resolved algorithms, waits) are identical.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

import pccl
from pccl.runtime.dry_run import DryRunCommunicator
from shard.planning.predict import Workload, trace_step
from tests.shard.engine_models import TinyTransformer

torch.set_num_threads(1)
warnings.simplefilter("ignore")
# The dry run decides as the profile it is given says (here the built-in one, unmeasured);
# the real communicator must decide alike for the traces to match, so it does not measure
# itself (measured choices are what the self-calibration's own tests check).
os.environ["PCCL_SELF_CALIBRATION"] = "0"
comm = pccl.init(ranks_per_node=2)
RUNS = [("zero3", "auto"), ("zero3", "native"), ("paro-iig", "auto"), ("paro-nig", "ring"), ("mics", "auto"),
        ("zero2", "hierarchical")]
MICRO = Workload(seq=8, micro_batch=2, micro_batches=2)


def events(trace) -> list:
    """The trace with each task's collectives inlined (communicators left out)."""
    out = []
    for event in trace.events:
        if event[0] == "submit":
            task = trace.tasks[event[1]]
            out.append(["submit", event[1], task.lane,
                        [[c.level, c.collective, c.nbytes, repr(c.algorithm)] for c in task.calls]])
        elif event[0] == "call":
            c = event[1]
            out.append(["call", c.level, c.collective, c.nbytes, repr(c.algorithm)])
        else:
            out.append(list(event))
    return out


def compare(strategy: str, algorithm: str) -> dict:
    settings = dict(strategy=strategy, algorithm=algorithm, group_size=2, prefetch=1, min_shard_numel=0)
    torch.manual_seed(0)
    real, _ = trace_step(TinyTransformer(), comm, MICRO, **settings)
    with torch.device("meta"):
        model = TinyTransformer()
    dry, _ = trace_step(model, DryRunCommunicator(comm.topology, comm.selector.profile, comm.rank,
                                                trust_native=comm.selector.trust_native), MICRO, **settings)
    a, b = events(real), events(dry)
    return {"equal": a == b, "events": len(a), "collectives": len(real.calls()),
            "first_difference": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None),
            "real": a if a != b else None, "dry": b if a != b else None}


def main() -> None:
    out = sys.argv[1]
    report = {}
    for strategy, algorithm in RUNS:
        try:
            report[f"{strategy}/{algorithm}"] = compare(strategy, algorithm)
        except Exception:   # noqa: BLE001 - reported to the test
            report[f"{strategy}/{algorithm}"] = {"exception": traceback.format_exc()}
    reports = comm.mpi_comm.gather(report, root=0)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump({"ranks": reports}, f)


if __name__ == "__main__":
    main()
