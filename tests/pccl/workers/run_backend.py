"""mpiexec worker: PyTorch's own stack on the "pccl" torch.distributed backend.

FSDP2 (fully_shard per block + root, fp32, and bf16 parameters with fp32 reduction), DDP and
DTensor train the same model on the same global batches three SGD steps, on the pccl
world and, in the same launch, on a gloo group of the same ranks; rank 0 trains the
single-process reference. Then: DTensor redistributions, every forwarded operation, a
sub-group, torch.distributed.checkpoint of an FSDP2 model, and bad input. Rank 0 writes
a JSON report to argv[1] (relative errors, checks that failed).
On GPUs (PCCL_TEST_DEVICE=cuda, one GPU per rank) the same runs on CUDA tensors, compared
with NCCL instead of gloo (the report's "gloo" keys).
Usage: mpiexec -n P python -m tests.pccl.workers.run_backend REPORT [DCP_DIR]
   or: torchrun --standalone --nproc-per-node P -m tests.pccl.workers.run_backend REPORT [DCP_DIR]
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import AllgatherOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _coalescing_manager
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import pccl.distributed
from pccl.tuning import self_calibration
from tests.pccl.workers import cases
from tests.pccl.workers.cases import reduce_reference
from tests.shard.engine_models import TinyTransformer, token_batch, token_loss
from tests.shard.reference import relative_error

torch.set_num_threads(1)
DEVICE = torch.device(os.environ.get("PCCL_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ.get("PMI_RANK", 0))) % torch.cuda.device_count())
pccl.distributed.init_process_group(timeout=timedelta(seconds=120))   # as torch's takes it (or seconds)
rank, p = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(list(range(p)), backend="gloo" if DEVICE.type == "cpu" else "nccl")
torch.set_default_device(DEVICE)   # every tensor below on the device under test
failures: list[str] = []
report: dict = {"backend": dist.get_backend(), "ranks": p, "transport": dist.group.WORLD.transport}
STEPS, PER_RANK, LR = 3, 2, 0.5


def make_input(r: int, numel: int, dtype, salt: int) -> torch.Tensor:
    """tests.pccl.workers.cases.make_input (a CPU generator's) on the device."""
    with torch.device("cpu"):
        return cases.make_input(r, numel, dtype, salt).to(DEVICE)


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(f"rank {rank}: {what}")


def batches():
    for step in range(STEPS):
        with torch.device("cpu"):   # the batches come from a CPU generator
            x, y = token_batch(step, PER_RANK * p)
        x, y = x.to(DEVICE), y.to(DEVICE)
        yield (x, y), (x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])


def fresh_model():
    torch.manual_seed(0)
    return TinyTransformer()


def train(model, on_global: bool):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for whole, mine in batches():
        x, y = whole if on_global else mine
        opt.zero_grad()
        token_loss(model(x), y).backward()
        opt.step()
    return model


def full_state(model) -> dict:
    """The full parameters (DTensors gathered with full_tensor, through the backend)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu().clone()
            for k, v in model.state_dict().items()}


reference = full_state(train(fresh_model(), on_global=True))


def fsdp2(mesh, mp=None):
    model = fresh_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    return full_state(train(model, on_global=False))


def ddp(group):
    model = torch.nn.parallel.DistributedDataParallel(fresh_model(), process_group=group)
    return {k.removeprefix("module."): v for k, v in full_state(train(model, on_global=False)).items()}


calls: dict[str, int] = {}


def counted(comm, collective):
    """The world communicator's `collective`, counting its calls: proof that torch's calls
    reached pccl."""
    method = getattr(comm, collective)

    def call(*args, **kwargs):
        calls[collective] = calls.get(collective, 0) + 1
        return method(*args, **kwargs)
    return call


world = dist.group.WORLD
for collective in ("all_gather", "reduce_scatter", "all_reduce"):
    setattr(world.comm, collective, counted(world.comm, collective))
report["resolved"] = {c: repr(world.comm.selector.resolve(c, "auto", 1 << 20))
                      for c in ("all_gather", "reduce_scatter")}
meshes = {"pccl": init_device_mesh(DEVICE.type, (p,)), "gloo": DeviceMesh.from_group(gloo, DEVICE.type)}
bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
runs = {"fsdp2_fp32": lambda name: fsdp2(meshes[name]),
        "fsdp2_bf16": lambda name: fsdp2(meshes[name], bf16),
        "ddp": lambda name: ddp(None if name == "pccl" else gloo)}
for run, fn in runs.items():
    calls.clear()
    states = {name: fn(name) for name in ("pccl", "gloo")}
    report[run] = {"pccl_calls": dict(calls),"pccl_vs_reference": relative_error(states["pccl"], reference),
                   "gloo_vs_reference": relative_error(states["gloo"], reference),
                   "pccl_vs_gloo": relative_error(states["pccl"], states["gloo"])}

# DTensor: each redistribution against the plain tensor it stands for.
mesh = meshes["pccl"]
full = torch.arange(4.0 * p * 3).view(4 * p, 3)
sharded = distribute_tensor(full, mesh, [Shard(0)])
check(torch.equal(sharded.full_tensor(), full), "DTensor full_tensor")
check(torch.equal(sharded.redistribute(mesh, [Replicate()]).to_local(), full), "DTensor Shard -> Replicate")
mine = make_input(rank, 4 * p * 3, torch.float32, 5).view(4 * p, 3)
everyone = reduce_reference([make_input(r, 4 * p * 3, torch.float32, 5) for r in range(p)], "sum").view(4 * p, 3)
partial = torch.distributed.tensor.DTensor.from_local(mine, mesh, [Partial()])
check(torch.equal(partial.redistribute(mesh, [Shard(0)]).to_local(), everyone[rank * 4:(rank + 1) * 4]),
      "DTensor Partial -> Shard (reduce-scatter)")
check(torch.equal(partial.redistribute(mesh, [Replicate()]).to_local(), everyone),
      "DTensor Partial -> Replicate (all-reduce)")

# Every forwarded operation once, against what it must produce.
t = torch.full((3,), float(rank))
dist.broadcast(t, src=p - 1)
check(torch.equal(t, torch.full((3,), float(p - 1))), "broadcast")
t = torch.full((3,), float(rank + 1))
dist.reduce(t, dst=0)
check(rank != 0 or torch.equal(t, torch.full((3,), p * (p + 1) / 2)), "reduce")
# a view that is not contiguous on one rank only: staged there (refused there before, while
# the other ranks waited out the timeout in the companion)
base = torch.zeros(3, 2)
t = base[:, 1] if rank == p - 1 else torch.full((3,), float(rank))
dist.broadcast(t, src=0)
check(torch.equal(t, torch.zeros(3)) and not base.any(), "broadcast into a view on one rank")
base[:, 1] = 1.0
dist.broadcast(base[:, 1] if rank == p - 1 else torch.ones(3), src=p - 1)
check(torch.equal(base, torch.tensor([[0.0, 1.0]] * 3)), "broadcast from a view on one rank")
flags = [torch.tensor([rank == 0, False]), torch.tensor([True])]
dist.all_reduce_coalesced(flags)   # bools: the companion's (a TypeError before)
check(flags[0].tolist() == [True, False] and flags[1].tolist() == [True], "coalesced all-reduce of bools")
if p > 1:
    if rank == 0:
        dist.send(torch.arange(5.0), dst=1)
    elif rank == 1:
        got = torch.empty(5)
        dist.recv(got, src=0)
        check(torch.equal(got, torch.arange(5.0)), "send/recv")
outs = [torch.empty(2) for _ in range(p)]
dist.all_to_all(outs, [torch.full((2,), float(rank * 10 + r)) for r in range(p)])
check(all(torch.equal(o, torch.full((2,), float(r * 10 + rank))) for r, o in enumerate(outs)), "all_to_all")
single = torch.empty(p)
dist.all_to_all_single(single, torch.arange(p, dtype=torch.float32) + 10 * rank)
check(torch.equal(single, torch.arange(p, dtype=torch.float32) * 10 + rank), "all_to_all_single")
got = torch.empty(2)
dist.scatter(got, [torch.full((2,), float(r)) for r in range(p)] if rank == 0 else None, src=0)
check(torch.equal(got, torch.full((2,), float(rank))), "scatter")
gathered = [torch.empty(2) for _ in range(p)] if rank == 0 else None
dist.gather(torch.full((2,), float(rank)), gathered, dst=0)
check(rank != 0 or all(torch.equal(g, torch.full((2,), float(r))) for r, g in enumerate(gathered)), "gather")
dist.barrier()
objects = [None] * p
dist.all_gather_object(objects, {"rank": rank})
check(objects == [{"rank": r} for r in range(p)], "all_gather_object (uint8, forwarded)")
# The pccl-run collectives in their other forms.
out = [torch.empty(3) for _ in range(p)]
dist.all_gather(out, torch.full((3,), float(rank)))
check(all(torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(out)), "all_gather (list)")
got = torch.empty(2)
dist.reduce_scatter(got, [torch.full((2,), float(rank + r)) for r in range(p)])
check(torch.equal(got, torch.full((2,), float(sum(r + rank for r in range(p))))), "reduce_scatter (list)")
for op, name in ((dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.AVG, "avg")):
    t = make_input(rank, 7, torch.float32, 9)
    dist.all_reduce(t, op=op)
    expected = reduce_reference([make_input(r, 7, torch.float32, 9) for r in range(p)], name).float()
    check(torch.allclose(t, expected), f"all_reduce {name}")
work = dist.all_reduce(t := torch.ones(5), async_op=True)
work.wait()
check(torch.equal(t, torch.full((5,), float(p))), "async all_reduce")
check(work.result()[0] is t, "Work.result() is the call's tensors, as gloo's")

# A sub-group: the even ranks, a pccl communicator of its own.
evens = dist.new_group(list(range(0, p, 2)), backend="pccl")
if rank % 2 == 0:
    t = torch.ones(4)
    dist.all_reduce(t, group=evens)
    check(torch.equal(t, torch.full((4,), float(len(range(0, p, 2))))), "sub-group all_reduce")
    check(evens.comm.size == len(range(0, p, 2)), "sub-group communicator size")
if p == 4:   # a 2x2 mesh: sub-meshes are sub-groups
    mesh2 = init_device_mesh(DEVICE.type, (2, 2), mesh_dim_names=("dp", "tp"))
    row = distribute_tensor(full, mesh2, [Replicate(), Shard(0)])
    check(torch.equal(row.full_tensor(), full), "2-D mesh full_tensor")

# Groups made and destroyed in a loop leave nothing registered behind: the gloo group a pccl
# group over torch makes for itself is destroyed too (as the next group is made).
registered = []
for _ in range(3):
    churned = dist.new_group(list(range(p)), backend="pccl", pg_options=pccl.distributed.Options(transport="torch"))
    dist.all_reduce(torch.ones(2), group=churned)
    dist.destroy_process_group(churned)
    registered.append(len(c10d._world.pg_map))
check(len(set(registered)) == 1, f"groups made and destroyed leave none registered: {registered}")

# torch.distributed.checkpoint of an FSDP2 model: saved, loaded into another, the same.
if len(sys.argv) > 2:
    model = fresh_model()
    fully_shard(model, mesh=mesh)
    train(model, on_global=False)
    dcp.save(model.state_dict(), checkpoint_id=sys.argv[2])
    other = fresh_model()
    fully_shard(other, mesh=mesh)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=sys.argv[2])
    other.load_state_dict(state)
    check(relative_error(full_state(other), full_state(model)) == 0, "dcp save/load")

# What gloo takes beside pccl's fast path, as gloo does it: views that are not contiguous
# (staged through copies), list forms of uneven sizes and coalesced calls of dtypes pccl does
# not carry (the companion's), a barrier after async work (which waits for it), and a
# wait with a timeout.
for group, name in ((None, "pccl"), (gloo, "gloo")):
    base = torch.arange(12.0).view(3, 4) + rank
    view = base.t()   # not contiguous
    dist.all_reduce(view, group=group)
    check(torch.equal(base, (torch.arange(12.0).view(3, 4) * p + sum(range(p)))), f"{name}: all_reduce of a view")
    out = torch.empty(4 * p, 3)
    dist.all_gather_into_tensor(out, (torch.arange(12.0).view(3, 4) + rank).t(), group=group)   # input: a view
    check(torch.equal(out, torch.cat([(torch.arange(12.0).view(3, 4) + r).t() for r in range(p)])),
          f"{name}: all_gather_into_tensor from a view")
    blocks = [torch.full((2 + r,), float(rank + 1)) for r in range(p)]   # uneven, alike on every rank
    got = torch.zeros(2 + rank)
    dist.reduce_scatter(got, blocks, group=group)
    check(torch.equal(got, torch.full((2 + rank,), float(sum(range(1, p + 1))))), f"{name}: uneven reduce_scatter")
    if group is None:   # gloo's group object has no coalesced form to hold it to
        flags = [torch.tensor([rank % 2 == 0, True])]
        outs = [torch.zeros(2 * p, dtype=torch.bool)]
        dist.group.WORLD.allgather_into_tensor_coalesced(outs, flags, AllgatherOptions()).wait()
        check(torch.equal(outs[0], torch.tensor([r % 2 == 0 or i == 1 for r in range(p) for i in range(2)])),
              f"{name}: coalesced all-gather of bools")
    t = torch.ones(1 << 16)
    work = dist.all_reduce(t, group=group, async_op=True)
    dist.barrier(group=group)
    check(work.is_completed() and t[-1].item() == p, f"{name}: a barrier after async work waits for it")
    check(work.wait(timeout=timedelta(seconds=30)), f"{name}: wait with a timeout")

# torch's coalescing with a device (DeepSpeed's coalesced calls): the calls inside run, and
# the one Work torch keeps completes after all of them, its fast-path forms' too.
gathered = [torch.empty(2 * p, device=DEVICE) for _ in range(2)]
sent = torch.full((3,), float(rank), device=DEVICE)
with _coalescing_manager(device=DEVICE, async_ops=True) as cm:
    for out in gathered:
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank + 1), device=DEVICE))
    dist.broadcast(sent, 0)
cm.wait()
check(all(torch.equal(o.cpu(), torch.arange(1.0, p + 1).repeat_interleave(2)) for o in gathered) and
      not sent.any(), "coalescing with a device: every call inside ran, and the Work waited for them")
try:   # a call refused inside: torch never ends the block, and the group must not stay in it
    with _coalescing_manager(device=DEVICE, async_ops=True):
        dist.all_reduce(torch.ones(2, device=DEVICE), op=dist.ReduceOp.PRODUCT)
except ValueError:
    pass
dist.all_reduce(torch.ones(2, device=DEVICE))
kept = list(dist.group.WORLD._coalesced or ())
with _coalescing_manager(device=DEVICE, async_ops=True) as cm:   # (it raised "coalescing started twice")
    dist.broadcast(sent, 0)
cm.wait()
check(not kept, f"after a refused call inside a coalescing block, calls outside it are not kept: {kept}")

# Bad input: a clear error before anything is sent, and the group still works.
for bad, expected in ((lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PRODUCT), "ReduceOp.PRODUCT"),
                      (lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)), "numel"),
                      (lambda: dist.all_reduce(torch.ones(2, device="meta")), "tensor on meta")):
    try:
        bad()
        check(False, f"no error for bad input ({expected})")
    except (ValueError, TypeError, RuntimeError) as e:
        check(expected in str(e), f"the error names {expected!r}: {e}")
t = torch.ones(3)
dist.all_reduce(t)
check(torch.equal(t, torch.full((3,), float(p))), "usable after bad input")

everyone_failed = [None] * p
dist.all_gather_object(everyone_failed, failures)
failures = [f for fs in everyone_failed for f in fs]
report["auto"] = self_calibration.basis(world.comm)   # what the training's auto calls decided with
if rank == 0:
    report["failures"] = failures
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1), flush=True)
