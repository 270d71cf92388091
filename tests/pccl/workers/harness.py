"""Running one test group under mpiexec and comparing with the reference (shared by workers)."""
from __future__ import annotations

import torch
from mpi4py import MPI

from tests.pccl.workers.cases import make_input, matches, reduce_reference


def run_case(comm, collective, algorithm, dtype, op, n, salt) -> bool:
    """One call of `collective` on `comm`; True when this rank's result is right."""
    p, rank = comm.size, comm.rank
    if collective == "all_gather":
        inputs = [make_input(r, n, dtype, salt) for r in range(p)]
        out = torch.full((n * p,), -99, dtype=dtype)
        comm.all_gather(out, inputs[rank].clone(), algorithm=algorithm)
        return matches(out, torch.cat(inputs), op)
    if collective == "reduce_scatter":
        inputs = [make_input(r, n * p, dtype, salt) for r in range(p)]
        mine = inputs[rank].clone()
        out = torch.full((n,), -99, dtype=dtype)
        comm.reduce_scatter(out, mine, op=op, algorithm=algorithm)
        untouched = torch.equal(mine, inputs[rank])
        expected = reduce_reference(inputs, op)[rank * n:(rank + 1) * n]
        return untouched and matches(out, expected.to(dtype), op)
    inputs = [make_input(r, n, dtype, salt) for r in range(p)]
    buf = inputs[rank].clone()
    comm.all_reduce(buf, op=op, algorithm=algorithm)
    return matches(buf, reduce_reference(inputs, op).to(dtype), op)


def run_group(comm, collective, algorithm, cases) -> list[str]:
    """Every (dtype, op, count) case; the failures, each agreed on by all ranks."""
    world = MPI.COMM_WORLD
    failures = []
    for salt, (dtype, op, n) in enumerate(cases):
        label = f"{str(dtype).replace('torch.', '')} {op} n={n}"
        try:
            ok = run_case(comm, collective, algorithm, dtype, op, n, salt)
        except Exception as e:  # noqa: BLE001 - reported per case
            ok, label = False, f"{label}: {type(e).__name__}: {e}"
        bad = world.allgather(not ok)  # a case passes only if it passed on every rank
        if any(bad):
            failures.append(f"{label} (wrong on ranks {[r for r, b in enumerate(bad) if b]})")
    return failures


