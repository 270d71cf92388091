"""mpiexec worker: the C++ executor's GPU paths (staged through host memory, and GPU-aware)
on the native layer's stand-in device, whose stream runs queued work only when the CPU
waits for it, checked against the same calls on host memory and against the double-buffer
schedule's wait counts. Usage: mpiexec -n P python -m tests.pccl.workers.run_emulated_gpu
Prints "OK emulated" on rank 0 when every case matched."""
from __future__ import annotations

import torch
from mpi4py import MPI

from pccl import _native
from pccl.algorithms import NATIVES, algorithms_for, schedule
from pccl.core.dtypes import dtype_code, op_code
from tests.pccl.workers.cases import counts, make_input

world = MPI.COMM_WORLD
p, rank = world.Get_size(), world.Get_rank()
host = _native.MpiComm(world, 60)
devices = {"staged": _native.MpiComm(world, 60, gpu_aware=False, emulate_gpu=True),
           "gpu_aware": _native.MpiComm(world, 60, gpu_aware=True, emulate_gpu=True)}
failures: list[str] = []


def call(comm, collective, algorithm, out, x, op, device):
    """One collective on `comm`; device 0 is the stand-in GPU, -1 host memory."""
    d, o = dtype_code(x.dtype), op_code(op, x.dtype)
    native, polled = algorithm in NATIVES, algorithm == "native_nonblocking"
    ops = None if native else schedule(collective, algorithm, p, rank).ops
    if collective == "all_gather":
        args = (out.data_ptr(), x.data_ptr(), x.numel(), d, device, 0)
        comm.native_all_gather(*args, polled) if native else comm.all_gather(ops, *args)
    elif collective == "reduce_scatter":
        args = (out.data_ptr(), x.data_ptr(), out.numel(), d, o, device, 0)
        comm.native_reduce_scatter(*args, polled) if native else comm.reduce_scatter(ops, *args)
    else:
        args = (x.data_ptr(), x.numel(), d, o, device, 0)
        comm.native_all_reduce(*args, polled) if native else comm.all_reduce(ops, *args)
    if device >= 0:
        comm.emulated_synchronize()  # the caller's stream synchronize
    return x if collective == "all_reduce" else out


def run(comm, collective, algorithm, dtype, op, n, device, salt):
    length = n * p if collective == "reduce_scatter" else n
    x = make_input(rank, length, dtype, salt) if salt >= 0 else random_input(length, dtype)
    out = torch.full((n * p if collective == "all_gather" else n,), -99, dtype=dtype)
    return call(comm, collective, algorithm, out, x, op, device)


def random_input(numel, dtype):
    g = torch.Generator().manual_seed(rank + 1)
    return (torch.randn(numel, generator=g) * 10).to(dtype)


for collective in ("all_gather", "reduce_scatter", "all_reduce"):
    for algorithm in algorithms_for(collective) + NATIVES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
            ops = ("sum",) if collective == "all_gather" else ("sum", "max") + (
                ("avg",) if dtype.is_floating_point else ())
            for op in ops:
                for n in counts(collective, p):
                    # Integer-valued inputs, and random ones where the sum order decides rounding.
                    for salt in (n, -1):
                        expected = run(host, collective, algorithm, dtype, op, n, -1, salt)
                        for name, comm in devices.items():
                            actual = run(comm, collective, algorithm, dtype, op, n, 0, salt)
                            exact = algorithm not in NATIVES or salt >= 0 or op == "max"
                            if exact and not torch.equal(actual, expected):
                                failures.append(f"{name} {collective} {algorithm} {op} {dtype} n={n} salt={salt}")


# One communicator takes host and device calls in any order (pccl keeps one per process
# group, whatever the tensors' device): a workspace grown by a host call must not pass for
# a device one. Each size is called host, device, host, so a call of each kind follows a
# larger one of the other; the stand-in device refuses a copy past a workspace's end.
for name, comm in devices.items():
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        for algorithm in algorithms_for(collective) + NATIVES:
            for dtype in (torch.float32, torch.bfloat16):
                op = "sum" if collective == "all_gather" else "avg"
                for n in (1, 1001, 7, 4099, 3):
                    expected = run(host, collective, algorithm, dtype, op, n, -1, n)
                    for device in (-1, 0, -1):
                        try:
                            actual = run(comm, collective, algorithm, dtype, op, n, device, n)
                        except ValueError as e:
                            failures.append(f"{name} {collective} {algorithm} {dtype} n={n} device={device}: {e}")
                            continue
                        if not torch.equal(actual, expected):
                            failures.append(f"{name} mixed {collective} {algorithm} {dtype} n={n} device={device}")


def fp_reference_in_rank_order(collective, dtype, op, n):
    """native on fp16/bf16 device buffers reduces in rank order, rounding after each rank."""
    inputs = []
    for r in range(p):
        g = torch.Generator().manual_seed(r + 1)
        inputs.append((torch.randn(n * p if collective == "reduce_scatter" else n, generator=g) * 10).to(dtype))
    acc = inputs[0].clone()
    for x in inputs[1:]:
        acc = (acc.float() + x.float()).to(dtype)
    if op == "avg":
        acc = acc / p   # torch on the CPU: a true division in float, rounded once
    return acc[rank * n:(rank + 1) * n] if collective == "reduce_scatter" else acc


for dtype in (torch.float16, torch.bfloat16):
    for collective in ("reduce_scatter", "all_reduce"):
        for op in ("sum", "avg"):
            n = 1001
            expected = fp_reference_in_rank_order(collective, dtype, op, n)
            for name, comm in devices.items():
                actual = run(comm, collective, "native", dtype, op, n, 0, -1)
                if not torch.equal(actual, expected):
                    failures.append(f"{name} native {collective} {op} {dtype}: not the rank-order sum")


def waits(comm, collective, algorithm, n=1001):
    before = comm.emulated_stats["waits"]
    run(comm, collective, algorithm, torch.float32, "sum", n, 0, n)
    return comm.emulated_stats["waits"] - before - 1  # less the caller's own synchronize


# The double-buffer schedule, staged: an all-gather forwards received blocks from host
# memory, so the CPU waits for the device once at the start (its own block) and once at the
# end, whatever p; a ring reduce-scatter sends a block the device has just reduced in every
# step, so it waits once per step (p - 1) and at the end. GPU-aware, MPI reads device memory
# and waits for the stream before every step.
if p > 1:
    for algorithm in ("ring", "recursive_doubling", "bruck"):
        if (got := waits(devices["staged"], "all_gather", algorithm)) != 2:
            failures.append(f"staged all_gather {algorithm}: {got} waits, expected 2")
    if (got := waits(devices["staged"], "reduce_scatter", "ring")) != p:
        failures.append(f"staged reduce_scatter ring: {got} waits, expected {p}")
    steps = schedule("all_gather", "ring", p, rank).num_steps
    if (got := waits(devices["gpu_aware"], "all_gather", "ring")) != steps:
        failures.append(f"gpu_aware all_gather ring: {got} waits, expected {steps}")

failures = [f for fs in world.allgather(failures) for f in fs]
assert not failures, failures[:10]
if rank == 0:
    print("OK emulated", flush=True)
