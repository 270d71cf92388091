"""One rank of a fault scenario on collectives: every rank runs the same collective
repeatedly, and the victim rank SIGKILLs itself at a planned place of a planned call.
Each rank writes what happened to it (completed, or the error, its message and how long
the failing call took) to OUT/rank-R.json before the error leaves the process.

    python -m tests.faults.collective_worker --executor cpp --place plan-inter --out DIR

Places: flat (a flat ring all-gather), plan-intra / plan-inter (a two-level plan, the
victim dying as its intra-node or inter-node phase starts), plan-native (the plan with its
default intra-node level, "native", on an interruptible communicator such as the
engine's: MPI_Iallgather, polled; the victim dies as its intra-node phase starts), lane
(an async all-gather on the communicator's worker thread while the caller computes),
native (the transport's own collective: MPI_Allgather, or gloo's), native_nonblocking
(MPI_Iallgather, polled).
Executors: cpp, python (MPI), torch (gloo, brought up through MPI under mpiexec or from
torchrun's environment)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

import pccl
from pccl.executors.plan import PlanExecutor
from pccl.plans import Hierarchical

PLACES = ("flat", "plan-intra", "plan-inter", "plan-native", "lane", "native", "native_nonblocking")
EXECUTORS = ("cpp", "python", "torch")
CALLS, VICTIM_CALL = 6, 3
# The plan's levels run rings, so that a missing peer surfaces as pccl's own timeout (the
# default intra level, "native", is plan-native's case).
PLAN = Hierarchical(inter="ring", intra="ring")
PLAN_NATIVE = Hierarchical(inter="ring")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_in_level(level: str, rank: int, victim: int) -> None:
    """Make the victim die as its `level` phase of call VICTIM_CALL starts."""
    calls = {"n": 0}
    original = PlanExecutor._phase

    def phase(self, p, *args, **kwargs):
        if p.level == level and rank == victim:
            calls["n"] += 1
            if calls["n"] > VICTIM_CALL:
                die()
        return original(self, p, *args, **kwargs)
    PlanExecutor._phase = phase


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executor", choices=EXECUTORS, required=True)
    ap.add_argument("--place", choices=PLACES, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--victim", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.executor == "torch":
        comm = pccl.init("gloo", timeout=a.timeout, ranks_per_node=2)
    else:
        comm = pccl.init("mpi", executor=a.executor, timeout=a.timeout, ranks_per_node=2,
                         interruptible=a.place == "plan-native")
    rank = comm.rank
    if a.place.startswith("plan-"):
        die_in_level("intra" if a.place == "plan-native" else a.place.removeprefix("plan-"), rank, a.victim)
    algorithm = {"flat": "ring", "lane": "ring", "native": "native", "native_nonblocking": "native_nonblocking",
                 "plan-native": PLAN_NATIVE}.get(a.place, PLAN)
    x = torch.full((4096,), float(rank))
    out = torch.empty(4096 * comm.size)
    work = torch.randn(256, 256)
    report = {"rank": rank, "pid": os.getpid(), "outcome": "completed"}
    for call in range(CALLS):
        if rank == a.victim and call == VICTIM_CALL and not a.place.startswith("plan-"):
            die()
        started = time.monotonic()
        try:
            if a.place == "lane":
                pending = comm.all_gather(out, x, algorithm=algorithm, async_op=True)
                for _ in range(4):
                    work = torch.tanh(work @ work)   # the caller computes meanwhile
                pending.wait()
            else:
                comm.all_gather(out, x, algorithm=algorithm)
        except Exception as e:
            report.update(outcome="raised", error=type(e).__name__, message=str(e), call=call,
                          seconds=round(time.monotonic() - started, 3))
            (a.out / f"rank-{rank}.json").write_text(json.dumps(report))
            raise
        assert torch.equal(out.view(comm.size, -1)[:, 0], torch.arange(comm.size, dtype=out.dtype))
    (a.out / f"rank-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
