"""Running one test group under mpiexec and comparing with the reference (shared by workers)."""
from __future__ import annotations

import torch
from mpi4py import MPI

from tests.pccl.workers.cases import make_input, matches, reduce_reference


def run_case(comm, collective, algorithm, dtype, op, n, salt, signs: bool = False) -> bool:
    """One call of `collective` on `comm`; True when this rank's result is right (with
    `signs`, a max's or min's zeros' signs too: matches)."""
    p, rank = comm.size, comm.rank
    signs = signs and op in ("max", "min")
    if collective == "all_gather":
        inputs = [make_input(r, n, dtype, salt) for r in range(p)]
        out = torch.full((n * p,), -99, dtype=dtype)
        comm.all_gather(out, inputs[rank].clone(), algorithm=algorithm)
        return matches(out, torch.cat(inputs))
    if collective == "reduce_scatter":
        inputs = [make_input(r, n * p, dtype, salt) for r in range(p)]
        mine = inputs[rank].clone()
        out = torch.full((n,), -99, dtype=dtype)
        comm.reduce_scatter(out, mine, op=op, algorithm=algorithm)
        untouched = torch.equal(mine, inputs[rank])
        expected = reduce_reference(inputs, op)[rank * n:(rank + 1) * n]
        return untouched and matches(out, expected, signs)
    inputs = [make_input(r, n, dtype, salt) for r in range(p)]
    buf = inputs[rank].clone()
    comm.all_reduce(buf, op=op, algorithm=algorithm)
    return matches(buf, reduce_reference(inputs, op), signs)


def run_group(comm, collective, algorithm, cases, signs: bool = False) -> list[str]:
    """Every (dtype, op, count) case; the failures, each agreed on by all ranks (`signs`: the
    zeros' signs checked, where pccl's kernels reduce throughout). The ranks
    compare notes once, at the end: an MPI call per case would spin on the cores that the
    ranks still computing need."""
    world = MPI.COMM_WORLD
    wrong = {}
    for salt, (dtype, op, n) in enumerate(cases):
        label = f"{str(dtype).replace('torch.', '')} {op} n={n}"
        try:
            if not run_case(comm, collective, algorithm, dtype, op, n, salt, signs):
                wrong[salt] = label
        except Exception as e:  # noqa: BLE001 - reported per case
            wrong[salt] = f"{label}: {type(e).__name__}: {e}"
    everyone = world.allgather(wrong)   # a case passes only if it passed on every rank
    return [f"{label} (wrong on ranks {[r for r, w in enumerate(everyone) if salt in w]})"
            for salt, label in sorted({k: v for w in everyone for k, v in w.items()}.items())]


AGREEMENT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def agreement(comms: dict, collective: str, algorithm) -> list[str]:
    """op avg of random values (not small integers: their sums round) on every communicator
    of `comms`, the same ranks under different executors or transports: the results must be
    bit-identical, since each runs the same schedule (the same sums in the same order) and
    divides the same way."""
    world = MPI.COMM_WORLD
    p, rank = world.size, world.rank
    failures = []
    for salt, dtype in enumerate(AGREEMENT_DTYPES):
        total = 37 * p if collective == "reduce_scatter" else 37 * p + 3
        g = torch.Generator().manual_seed(rank * 7919 + salt)
        x = (torch.randn(total, generator=g) * 10).to(dtype)
        results = {}
        for name, comm in comms.items():
            if collective == "reduce_scatter":
                results[name] = torch.empty(37, dtype=dtype)
                comm.reduce_scatter(results[name], x, op="avg", algorithm=algorithm)
            else:
                results[name] = x.clone()
                comm.all_reduce(results[name], op="avg", algorithm=algorithm)
        first, reference = next(iter(results.items()))
        differ = [name for name, r in results.items() if not torch.equal(r, reference)]
        everyone = world.allgather(differ)
        if any(everyone):
            failures.append(f"{str(dtype).replace('torch.', '')} avg: {sorted(set(sum(everyone, [])))} differ "
                            f"from {first} (on ranks {[r for r, d in enumerate(everyone) if d]})")
    return failures
