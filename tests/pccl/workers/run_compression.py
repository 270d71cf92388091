"""mpiexec worker: every collective x algorithm x codec with compression, one world size.

Usage: mpiexec -n P python -m tests.pccl.workers.run_compression [nccl] REPORT.json

With "nccl" (the GPU suite), the native codecs on GPU tensors over pccl.init(transport=
"nccl"), one GPU per rank, with the same references: GPU encodings equal the CPU's.

Inputs are uniform in [-1, 1], seeded by (rank, case), so every rank knows every input.
The references, per case:
  all-gather       block i == the codec's own round trip of rank i's input (exactly), on
                   every rank alike (one rank: the input itself, nothing is sent)
  reduce-scatter,  |result - the float64 sum| <= encodes x unit x p per element: each of
  all-reduce       the block's encodings (counted by the symbolic verifier) is of a partial
                   sum of at most p values, so of magnitude <= p, and loses at most the
                   codec's unit of it (int8 1/254, bf16 2^-9, fp16 2^-11, zfp:R 2^-(R-5));
                   all-reduce results identical on every rank (per message: not), in fp16
                   and bf16 payloads too
A call repeated (kept in the call cache) gives the same bits as its first run.
The C++ executor runs the native codecs itself: its results equal the Python executor's
bit for bit, sum and avg (same plan, same kernels, same order of reductions, the same
division; checked at one size), and avg is the sum divided by p, exactly.
Two-level plans (2 ranks per emulated node) compress their inter-node phases only.
The report maps case names to failures (empty lists pass).
"""
from __future__ import annotations

import hashlib
import json
import sys
import traceback
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from pccl.algorithms import GENERATORS
from pccl.analysis.verify import verify_compressed
from pccl.compression.codecs import codec

torch.set_num_threads(1)
world = MPI.COMM_WORLD
p, rank = world.size, world.rank
GPU = sys.argv[1:2] == ["nccl"]
DEVICE = torch.device("cuda", rank % torch.cuda.device_count()) if GPU else torch.device("cpu")
CODECS = ("int8", "bf16", "fp16", "zfp:16", "zfp:8", "p2p:int8")   # p2p: per message (the baseline)
UNIT = {"int8": 1 / 254, "bf16": 2 ** -8, "fp16": 2 ** -11, "zfp:16": 2 ** -10, "zfp:8": 2 ** -2,
        "p2p:int8": 1 / 254}
SIZES = (1, 37, 1000)   # elements per rank's block (all-reduce: p blocks of these, plus 3)


def data(r: int, case: str, n: int) -> torch.Tensor:
    seed = int(hashlib.sha256(f"{r}/{case}".encode()).hexdigest()[:8], 16)
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def same_everywhere(t: torch.Tensor) -> bool:
    digest = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return len(set(world.allgather(digest))) == 1


def call(comm, collective: str, algorithm, compression, case: str, n: int, op: str = "sum") -> torch.Tensor:
    """One compressed collective on this rank's inputs; its output."""
    if collective == "all_gather":
        out = torch.empty(p * n, device=DEVICE)
        comm.all_gather(out, data(rank, case, n).to(DEVICE), algorithm=algorithm, compression=compression)
    elif collective == "reduce_scatter":
        out = torch.empty(n, device=DEVICE)
        comm.reduce_scatter(out, data(rank, case, n * p).to(DEVICE), op=op, algorithm=algorithm,
                            compression=compression)
    else:
        out = data(rank, case, n * p + 3).to(DEVICE)
        comm.all_reduce(out, op=op, algorithm=algorithm, compression=compression)
    return out.cpu()


def run_case(comm, collective: str, algorithm, name: str, n: int, plan: bool, twin=None) -> list[str]:
    """The checks of one case; `twin` (a Python-executor communicator) must agree exactly."""
    c, case = codec(name), f"{collective}/{algorithm}/{name}/{n}"
    compression = {"inter": name} if plan else name
    per_message = name.startswith("p2p:")
    if plan:   # phases on levels: a loose bound, each level's encodings at most p
        encodes = [p * p] * p
    else:
        encodes = verify_compressed(collective, algorithm, p, per_message)["encodes"]
    out = call(comm, collective, algorithm, compression, case, n)
    problems = []
    if n == SIZES[1]:   # another codec on the same buffers, then the call again (kept in the call cache)
        other = "bf16" if name != "bf16" else "int8"
        if not plan and p > 1 and torch.equal(out, call(comm, collective, algorithm, other, case, n)):
            problems.append(f"{case}: {other} after {name} on the same buffers gave {name}'s bits")
        # (a plan's codec named once is its inter level's: as a string the call is kept)
        if not torch.equal(out, call(comm, collective, algorithm, name, case, n)):
            problems.append(f"{case}: the call kept from the first (the call cache) gave other bits")
    if collective != "all_gather" and n == SIZES[1]:
        avg = call(comm, collective, algorithm, compression, case, n, "avg")
        if not torch.equal(avg, out / p):
            problems.append(f"{case}: avg is not the sum divided by {p}")
        if twin is not None and c.native is not None and \
                not torch.equal(avg, call(twin, collective, algorithm, compression, case, n, "avg")):
            problems.append(f"{case}: the C++ and Python executors' avg disagree")
    if twin is not None and c.native is not None and n == SIZES[1] and \
            not torch.equal(out, call(twin, collective, algorithm, compression, case, n)):
        problems.append(f"{case}: the C++ and Python executors disagree")
    if collective == "all_gather":
        for r in range(p):
            x = data(r, case, n)
            if not (plan or per_message) and p > 1 and not torch.equal(out[r * n:(r + 1) * n], c.round_trip(x)):
                problems.append(f"{case}: block {r} is not the round trip of rank {r}'s input")
            hops = p if per_message else 1   # per message: re-encoded at every hop
            if (plan or per_message) and ((out[r * n:(r + 1) * n] - x).abs() > hops * UNIT[name] * (1 + 1e-6)).any():
                problems.append(f"{case}: block {r} beyond {hops} round trips' bound")
        if p == 1 and not torch.equal(out, data(rank, case, n)):
            problems.append(f"{case}: one rank changed its own block")
        if not per_message and not same_everywhere(out):
            problems.append(f"{case}: outputs differ between ranks")
        return problems
    total = n * p if collective == "reduce_scatter" else n * p + 3
    exact = sum(data(r, case, total).double() for r in range(p))
    if collective == "reduce_scatter":
        exact, blocks = exact[rank * n:(rank + 1) * n], [rank]
    else:
        blocks = list(range(p))
    bound = max(encodes[b] for b in blocks) * UNIT[name] * p + 1e-5
    error = (out.double() - exact).abs().max().item()
    if error > bound:
        problems.append(f"{case}: error {error:.3g} beyond {bound:.3g}")
    if collective == "all_reduce" and not per_message and not same_everywhere(out):
        problems.append(f"{case}: all-reduce results differ between ranks")
    return problems


def sixteen_bit_all_reduces(comms: dict, twin) -> list[str]:
    """int8 on fp16 and bf16 payloads: every all-reduce algorithm ends identical on every
    rank (exchange partners add the same two values in the payload's dtype), and the C++
    executor's result is the Python executor's."""
    problems = []
    for executor in [e for e in comms if e != "plans"]:
        for algorithm in GENERATORS["all_reduce"]:
            for dtype in (torch.float16, torch.bfloat16):
                case = f"16-bit/{executor}/{algorithm}/{dtype}"
                out = (data(rank, case, 37 * p + 3) * 3).to(dtype).to(DEVICE)
                mine = out.clone()
                comms[executor].all_reduce(out, algorithm=algorithm, compression="int8")
                if not same_everywhere(out.cpu().view(torch.int16)):
                    problems.append(f"{case}: all-reduce results differ between ranks")
                if executor == "cpp":
                    twin.all_reduce(mine, algorithm=algorithm, compression="int8")
                    if not torch.equal(out, mine):
                        problems.append(f"{case}: the C++ and Python executors disagree")
    return problems


def main() -> None:
    report: dict[str, list[str]] = {}
    if GPU:
        torch.cuda.set_device(DEVICE)
        comms, twin = {"nccl": pccl.init(transport="nccl", timeout=120)}, None
    else:
        comms = {"cpp": pccl.init(executor="cpp", timeout=60), "gloo": pccl.init(transport="gloo", timeout=60)}
        twin = pccl.init(executor="python", timeout=60)
    cases = [(e, coll, alg, False) for e in comms for coll, algs in GENERATORS.items() for alg in algs]
    if p % 2 == 0 and p >= 4:
        comms["plans"] = pccl.init(transport="nccl" if GPU else "mpi", ranks_per_node=2, timeout=60)
        cases += [("plans", coll, alg, True) for coll in GENERATORS for alg in ("hierarchical", "ho_ring")
                  if (coll, alg) not in (("all_gather", "ho_ring"), ("all_reduce", "ho_ring"))]   # refused: bad calls
    for executor, collective, algorithm, plan in cases:
        key = f"{executor}/{collective}/{algorithm}"
        problems: list[str] = []
        try:
            names = {"cpp": CODECS, "gloo": ("int8",), "nccl": ("int8", "bf16", "fp16"),
                     "plans": ("int8", "bf16") if GPU else CODECS[:-1]}[executor]
            for name in names:
                for n in SIZES:
                    problems += run_case(comms[executor], collective, algorithm, name, n, plan,
                                         twin if executor == "cpp" else None)
        except Exception:  # noqa: BLE001
            problems.append(traceback.format_exc())
        report[key] = problems
    report["_16_bit_payloads"] = sixteen_bit_all_reduces(comms, twin)
    if GPU:
        if rank == 0:
            Path(sys.argv[-1]).write_text(json.dumps(report, indent=1))
        return
    problems = []
    for call, expected in ((lambda: comms["cpp"].all_reduce(torch.ones(4), compression="int4"), ValueError),
                           (lambda: comms["cpp"].all_reduce(torch.ones(4, dtype=torch.int32), compression="int8"),
                            ValueError),
                           (lambda: comms["cpp"].all_reduce(torch.ones(4), algorithm="native", compression="int8"),
                            ValueError)) + ((
                           lambda: comms["plans"].all_gather(torch.empty(4 * p), torch.ones(4), algorithm="ho_ring",
                                                             compression="int8"), ValueError),
                           (lambda: comms["plans"].all_reduce(torch.ones(4 * p), algorithm="ho_ring",
                                                              compression="int8"), ValueError)) * ("plans" in comms):
        try:
            call()
            problems.append("a bad compressed call raised nothing")
        except expected:
            pass
    y = torch.ones(3)
    comms["cpp"].all_reduce(y, compression="bf16")
    if not torch.equal(y, torch.full((3,), float(p))):
        problems.append(f"communicator unusable after bad input: {y}")
    report["_bad_input"] = problems
    if rank == 0:
        Path(sys.argv[-1]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
