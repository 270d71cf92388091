"""mpiexec worker: collectives on GPU tensors over NCCL, and over MPI where run_gpu.py
does not reach, each checked against a torch reference built from every rank's input.

Usage: mpiexec -n P python -m tests.pccl.workers.run_gpu_nccl MODE REPORT.json
  nccl       transport="nccl": every flat algorithm, native and auto; with P >= 4 (nodes
             emulated by ranks_per_node) the two-level plans hierarchical and ho_ring
  staged     the MPI transport on GPU tensors, messages staged through host memory: the
             pairwise reduce-scatter, auto and the plans over MPI levels, and the PCCL
             design intra="nccl", inter="mpi" (run_gpu.py covers the other flat algorithms)
  gpu_aware  the same with device pointers handed to MPI (PCCL_GPU_AWARE_MPI=1)
Each rank uses GPU (local rank) % device count; where ranks share GPUs (one GPU, several
ranks over MPI) the groups that need NCCL are left out. The report maps group ids to the failing
cases (empty when the group passed), as tests/pccl/workers/run_collectives.py does.

The module-level names are shared with tests/pccl/test_gpu_collectives.py, so importing
it starts nothing (no MPI, no GPU work).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

from pccl.algorithms import algorithms_for
from tests.pccl.workers.cases import make_input, matches, reduce_reference

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
PLANS = ("hierarchical", "ho_ring")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODES = ("nccl", "staged", "gpu_aware")


def groups(mode: str) -> list[tuple[str, str, str]]:
    """(transport, collective, algorithm) of each group a mode runs. Transports: "nccl",
    "mpi" (the C++ executor on GPU tensors), "pccl" (MPI communicator, intra="nccl",
    inter="mpi")."""
    if mode == "nccl":
        flat = [("nccl", c, a) for c in COLLECTIVES for a in algorithms_for(c) + ("native", "auto")]
        return flat + [("nccl", c, s) for c in COLLECTIVES for s in PLANS]
    mpi = [("mpi", "reduce_scatter", "pairwise")] + [("mpi", c, a) for c in COLLECTIVES for a in ("auto",) + PLANS]
    return mpi + [("pccl", c, a) for c in COLLECTIVES for a in ("auto",) + PLANS]


def group_id(transport: str, collective: str, algorithm: str) -> str:
    return f"{transport}-{collective}-{algorithm}"


def emulated_nodes(p: int) -> list[int]:
    """Ranks per node for the emulated multi-node topologies of p ranks: every divisor d
    with 1 < d < p (none for p < 4 or p prime)."""
    return [d for d in range(2, p) if p % d == 0]


def needs_topology(transport: str, algorithm: str) -> bool:
    """Whether a group runs on emulated nodes (plans, and everything on the PCCL design)."""
    return algorithm in PLANS or transport == "pccl"


def op_list(collective: str) -> tuple[str, ...]:
    return ("sum",) if collective == "all_gather" else ("sum", "avg", "max")


def counts(collective: str, p: int) -> tuple[int, ...]:
    """Per-rank counts (all-gather, reduce-scatter) or totals (all-reduce): one element,
    odd, not divisible by p, and a few hundred KiB (NCCL's larger protocols)."""
    if collective == "all_reduce":
        return (1, 5 * p + 3, 1001, (1 << 16) * p + 1)
    return (1, 7, 1001, 1 << 16)


def run_case(comm, collective: str, algorithm, dtype, op: str, n: int, salt: int, async_op: bool,
             device: torch.device) -> bool:
    """One call on GPU tensors; True when this rank's result equals the reference bit for
    bit (small integers sum exactly; avg is their sum divided by p, rounded once; see cases.py)."""
    p, rank = comm.size, comm.rank
    total = n * p if collective == "reduce_scatter" else n
    inputs = [make_input(r, total, dtype, salt) for r in range(p)]
    x = inputs[rank].to(device, copy=True)   # a copy even where device is the CPU (dry runs)
    if collective == "all_gather":
        expected = torch.cat(inputs)
        out = torch.full((n * p,), -99, dtype=dtype, device=device)
        work = comm.all_gather(out, x, algorithm=algorithm, async_op=async_op)
    elif collective == "reduce_scatter":
        expected = reduce_reference(inputs, op)[rank * n:(rank + 1) * n]
        out = torch.full((n,), -99, dtype=dtype, device=device)
        work = comm.reduce_scatter(out, x, op=op, algorithm=algorithm, async_op=async_op)
    else:
        expected = reduce_reference(inputs, op)
        out = x
        work = comm.all_reduce(out, op=op, algorithm=algorithm, async_op=async_op)
    if work is not None:
        work.wait()
    result = out.cpu()   # on the caller's stream, after the collective's work
    kept = collective == "all_reduce" or torch.equal(x.cpu(), inputs[rank])   # inputs come back untouched
    return kept and matches(result, expected)


def run_group(world, comm, collective: str, algorithm, device, label: str = "") -> list[str]:
    """Every dtype x op x count; a case fails when it failed on any rank."""
    failures = []
    salt = 0
    for dtype in DTYPES:
        for op in op_list(collective):
            for n in counts(collective, comm.size):
                salt += 1
                async_op = salt % 2 == 0   # half the cases through the async path (Work.wait)
                case = f"{label}{str(dtype).replace('torch.', '')} {op} n={n} async={async_op}"
                try:
                    ok = run_case(comm, collective, algorithm, dtype, op, n, salt, async_op, device)
                except Exception as e:  # noqa: BLE001 - reported per case
                    ok, case = False, f"{case}: {type(e).__name__}: {e}"
                bad = world.allgather(not ok)
                if any(bad):
                    failures.append(f"{case} (wrong on ranks {[r for r, b in enumerate(bad) if b]})")
    return failures


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {MODES}, got {mode!r}")
    # Read when the C++ executor is built (pccl.executors.mpi_cpp.gpu_aware_mpi).
    os.environ["PCCL_GPU_AWARE_MPI"] = "1" if mode == "gpu_aware" else "0"
    from mpi4py import MPI

    import pccl

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    local = node.rank
    node.Free()
    torch.cuda.set_device(local % torch.cuda.device_count())   # before any NCCL group exists
    device = torch.device("cuda", torch.cuda.current_device())
    p = world.size

    comms: dict = {}

    def communicator(transport: str, ranks_per_node=None):
        """Created on first use; every rank runs the same groups in the same order, so
        every rank creates the same communicators in the same order."""
        key = (transport, ranks_per_node)
        if key not in comms:
            options = {} if ranks_per_node is None else {"ranks_per_node": ranks_per_node}
            if transport == "nccl":
                comms[key] = pccl.init(transport="nccl", timeout=120, **options)
            elif transport == "mpi":
                comms[key] = pccl.init(transport="mpi", timeout=120, **options)
            else:
                comms[key] = pccl.init(transport="mpi", intra="nccl", inter="mpi", timeout=120, **options)
        return comms[key]

    report: dict[str, list[str]] = {}
    shared = p > torch.cuda.device_count()   # ranks share GPUs: only MPI takes that
    for transport, collective, algorithm in groups(mode):
        key = group_id(transport, collective, algorithm)
        if shared and transport != "mpi":
            continue   # NCCL refuses two ranks on one GPU; the driver skips these with the reason
        try:
            if needs_topology(transport, algorithm):
                topologies = emulated_nodes(p)
                if not topologies:
                    continue   # the driver skips these groups with the reason
                report[key] = []
                for d in topologies:
                    comm = communicator(transport, d)
                    report[key] += run_group(world, comm, collective, algorithm, device, f"{p // d}x{d}: ")
            else:
                report[key] = run_group(world, communicator(transport), collective, algorithm, device)
        except Exception:  # noqa: BLE001 - reported
            report[key] = [traceback.format_exc()]
    torch.cuda.synchronize()
    if world.rank == 0:
        Path(out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
