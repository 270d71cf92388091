"""The self-calibration on several ranks (tests/pccl/test_self_calibration.py):

    mpiexec -n 3 python -m tests.pccl.workers.run_self_calibration DIR REPORT

Each rank caches in DIR/rank-R (no shared file system). In turn: a first communicator
measures all-gather and bf16 all-reduce at their first auto call; a second reads rank 0's
file; rank 0's file is corrupted and a third measures again; a tiny budget stops after the
first size; a call beyond the sweep is measured at its size; of two communicators of one
shape open at once, the second takes what the first measured since it read the file; an
interruptible communicator has a key (and candidates) of its own; a gloo communicator
(torch.distributed, brought up through MPI) measures as MPI's do; GPU buffers, on a
stand-in GPU (torch.cuda's answers stood in, host tensors for the device's), are measured
apart, into a file of their own, and read back by the next communicator. Rank 0 writes
what each step saw to REPORT."""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from mpi4py import MPI

import pccl
from pccl.runtime.transport import Transport
from pccl.tuning import self_calibration as sc

root, report_path = Path(sys.argv[1]), Path(sys.argv[2])
world = MPI.COMM_WORLD
rank, p = world.rank, world.size
torch.set_num_threads(1)
os.environ.update(PCCL_SELF_CALIBRATION="1", PCCL_CACHE_DIR=str(root / f"rank-{rank}"), PCCL_CALIBRATION_BUDGET="0.05")
SIZES = (4, 64, 1024, 1 << 14, 1 << 18, 1 << 22, 1 << 26)


def step(comm_options: dict, dtype=torch.bfloat16) -> dict:
    """A new communicator's first auto calls (an all-gather, an all-reduce of `dtype`),
    checked against the exact sums, and what its self-calibration holds."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = pccl.init(**comm_options)
        x = (torch.arange(1000) % 7 + rank).to(dtype)   # small integers: exact sums in every dtype
        comm.all_reduce(x)
        expected = ((torch.arange(1000) % 7) * p + p * (p - 1) // 2).float()
        gathered = torch.empty(4 * p)
        comm.all_gather(gathered, torch.full((4,), float(rank)))
    own = comm.selector.self_calibration
    exact = torch.equal(x.float(), expected) and torch.equal(gathered, torch.arange(p).repeat_interleave(4).float())
    choices = [comm.selector.resolve(c, "auto", n, dtype=d) for c in ("all_gather", "all_reduce") for n in SIZES
               for d in (torch.float32, torch.bfloat16)]
    mine = json.dumps([own.measured, [str(c) for c in choices], sorted(map(str, comm.selector.profile.calibration))],
                      sort_keys=True)
    agree = len(set(world.allgather(mine))) == 1 and world.allreduce(int(exact), op=MPI.MIN) == 1
    files = world.gather(len(list(Path(os.environ["PCCL_CACHE_DIR"]).rglob("*.json"))), root=0)
    out = {"agree": agree, "exact": bool(world.allreduce(int(exact), op=MPI.MIN)), "figures": own.measured,
           "measured_now": sorted(own.seconds), "seconds": own.seconds, "path": str(own.path), "files": files,
           "warning": " ".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))}
    if rank == 0:
        out["valid_after"] = sc.read(own.path, own.key)[1] is None
    comm.close()
    return out


report = {"first": step({})}
report["second"] = step({})
if rank == 0:
    Path(report["first"]["path"]).write_bytes(b"\x00 not json")
world.Barrier()
report["corrupt"] = step({})
os.environ["PCCL_CALIBRATION_BUDGET"] = "1e-9"
os.environ["PCCL_CACHE_DIR"] = str(root / f"tiny-{rank}")
report["tiny"] = step({}, dtype=torch.float32)
os.environ["PCCL_CALIBRATION_BUDGET"] = "0.05"


def reaching() -> dict:
    """A call twice the sweep's largest size is measured at its size (the budget for it
    made ample: this checks the mechanism, not the budget), stored, and read back by the
    next communicator, which measures nothing; a call inside the sweep adds no size."""
    os.environ["PCCL_CACHE_DIR"] = str(root / f"reach-{rank}")
    sc.REACH = 1e6
    comm = pccl.init()
    comm.all_reduce(torch.ones(1000))
    own = comm.selector.self_calibration
    swept = [n for n, _ in next(iter(own.measured["all_reduce/full"].values()))]
    x = torch.full((swept[-1] // 2,), float(rank))   # 2x the largest in bytes: fp32 elements
    comm.all_reduce(x)
    comm.all_reduce(torch.ones(swept[-1] // 8))
    grown = [n for n, _ in next(iter(own.measured["all_reduce/full"].values()))]
    mine = json.dumps([own.measured, str(comm.selector.resolve("all_reduce", "auto", 2 * swept[-1]))], sort_keys=True)
    out = {"swept": swept, "grown": grown, "agree": len(set(world.allgather(mine))) == 1,
           "exact": bool(world.allreduce(int(torch.equal(x, torch.full_like(x, p * (p - 1) / 2))), op=MPI.MIN))}
    comm.close()
    again = pccl.init()
    again.all_reduce(torch.full((swept[-1] // 2,), 1.0))
    out["read_back"] = again.selector.self_calibration.measured["all_reduce/full"] == own.measured["all_reduce/full"]
    out["measured_again"] = sorted(again.selector.self_calibration.seconds)
    again.close()
    sc.REACH = REACH
    return out


def side_by_side() -> dict:
    """Two communicators of one shape open at once (as the engine's lanes and shard-train's
    own): the second reads the file first, for an all-reduce; the first then measures
    all-gather and reaches a call beyond its sweep; the second's first all-gather takes
    those figures from the file instead of measuring again, and the file keeps them."""
    os.environ["PCCL_CACHE_DIR"] = str(root / f"side-{rank}")
    sc.REACH = 1e6
    lane, own = pccl.init(), pccl.init()
    own.all_reduce(torch.ones(8))
    lane.all_gather(torch.empty(4 * p), torch.ones(4))
    swept = sc.largest(lane.selector.self_calibration.measured["all_gather"])
    block = torch.full((2 * swept // (4 * p),), float(rank))   # 2x the largest in bytes: fp32 elements
    full = torch.empty(p * len(block))
    lane.all_gather(full, block)
    gathered = torch.empty(4 * p)
    own.all_gather(gathered, torch.full((4,), float(rank)))
    mine, theirs = own.selector.self_calibration, lane.selector.self_calibration
    stored = sc.read(theirs.path, theirs.key)[0] if rank == 0 else None
    out = {"measured_now": sorted(mine.seconds), "lane_measured_now": sorted(theirs.seconds),
           "same": mine.measured["all_gather"] == theirs.measured["all_gather"],
           "grown": sc.largest(theirs.measured["all_gather"]) > swept,
           "kept": world.bcast(stored is not None and stored.get("all_gather") == theirs.measured["all_gather"]),
           "exact": bool(world.allreduce(int(torch.equal(full, torch.arange(p).repeat_interleave(len(block)).float())
                                             and torch.equal(gathered, torch.arange(p).repeat_interleave(4).float())),
                                         op=MPI.MIN))}
    own.close()
    lane.close()
    sc.REACH = REACH
    return out


REACH = sc.REACH
report["reach"] = reaching()
report["side_by_side"] = side_by_side()
os.environ["PCCL_CACHE_DIR"] = str(root / f"rank-{rank}")
report["interruptible"] = step({"interruptible": True}, dtype=torch.float32)
os.environ["PCCL_CACHE_DIR"] = str(root / f"gloo-{rank}")
report["gloo"] = step({"transport": "gloo"})


def on_stand_in_gpu() -> dict:
    """Two communicators' first auto all-reduce of GPU buffers: the first measures them
    (with synchronized loops), the second reads its file; neither touches the host's."""
    Transport.gpu_type = lambda self, device: {"type": device, "gpu": "Stand-in GPU", "visible": 1, "mpi": "staged"}
    host_calls = sc.calls
    sc.calls = lambda comm, collective, count, dtype, device="cpu": host_calls(comm, collective, count, dtype)
    synced = [0]
    torch.cuda.synchronize = lambda: synced.__setitem__(0, synced[0] + 1)
    os.environ["PCCL_CACHE_DIR"] = str(root / f"gpu-{rank}")
    out = {}
    for name in ("first", "second"):
        comm = pccl.init()
        comm.selector.measure_auto("all_reduce", "auto", torch.float32, "cuda")
        gpu = comm.selector.calibration_for("cuda")
        choices = [str(comm.selector.resolve("all_reduce", "auto", n, "cuda")) for n in SIZES]
        mine = json.dumps([gpu.measured, choices], sort_keys=True)
        out[name] = {"agree": len(set(world.allgather(mine))) == 1, "measured_now": sorted(gpu.seconds),
                     "figures": gpu.measured, "path": str(gpu.path), "host": comm.selector.self_calibration.measured,
                     "device": gpu.key.get("device"), "synchronized": world.allreduce(synced[0], op=MPI.MIN)}
        comm.close()
    return out


report["gpu"] = on_stand_in_gpu()
if rank == 0:
    report_path.write_text(json.dumps(report))
