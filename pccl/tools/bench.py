"""pccl-bench: time pccl's collectives the way NVIDIA's nccl-tests times NCCL's.

Run it under mpiexec, e.g. ``mpiexec -n 4 pccl-bench -b 4K -e 64M -f 4 -n 20 -w 5``.
For every collective, buffer size, executor and algorithm it prints one row: the time of
one call (the slowest rank's: nccl-tests averages over ranks unless run with `-a 3`), the
algorithm and bus bandwidths, and how many elements came out wrong. The size of a row is
the whole buffer, as in nccl-tests: the all-gather output, the reduce-scatter input, the
all-reduce tensor.
With ``--device cuda`` the buffers are on each rank's GPU (local rank modulo the GPUs
here); rows that an executor cannot run on GPU buffers are skipped, with the reason.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from mpi4py import MPI

import pccl
from pccl import vocabulary
from pccl.algorithms import NATIVES
from pccl.compression.codecs import codec
from pccl.core.collectives import COLLECTIVES
from pccl.core.dtypes import DATATYPES, OPS, REDUCTION_CLASSES
from pccl.plans import NAMED, compresses_consistently, three_level
from pccl.tools.cli import comma_list, size_arg, size_sweep, time_calls
from pccl.tuning import self_calibration
from pccl.tuning.calibrate import calibrate
from pccl.tuning.cost_model import calibrated
from runkit.args import at_least, comma_names, output
from runkit.closed_pipe import quiet_when_its_reader_goes
from runkit.files import write_atomic
from runkit.sizes import parse_size

EXECUTORS = ("cpp", "python", "gloo", "nccl")
DEFAULT_EXECUTORS = {"cpu": ["cpp", "python", "gloo"], "cuda": ["cpp", "nccl"]}
MPI_EXECUTORS = ("cpp", "python")
TORCH_EXECUTORS = ("gloo", "nccl")   # torch.distributed backends: "native" is the backend's own collective
PLANS = tuple(NAMED)  # the plans: run by default on multi-node topologies (three_level where there are groups)


# ---------------------------------------------------------------------- bandwidth


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' ratio of bus bandwidth to algorithm bandwidth."""
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    return (ranks - 1) / ranks


def bandwidths(collective: str, nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) for moving an `nbytes` buffer in `seconds`."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(collective, ranks)


# ----------------------------------------------------------------- test data


def value_modulus(dtype: torch.dtype, ranks: int) -> int:
    """Input values lie in [0, modulus): small enough that a sum over all ranks stays an
    exactly representable integer in `dtype` (half: 2048, bfloat16: 256), at most 13."""
    if dtype.is_floating_point:
        exact = int(2 / torch.finfo(dtype).eps)  # the first integer after which gaps exceed 1
        return max(2, min(13, exact // ranks))
    return 13


# Elements generated, reduced or compared at a time: the wide temporaries (8 bytes an
# element, several at once) stay small and in cache. Whole buffers at once, one rank took
# 4.5 GB and 22 s to fill a 256 MB bf16 reduce-scatter's input (the hash's int64 steps),
# and 6.8 GB with an all-reduce's expected result: 4 ranks of a 24 GB machine were killed.
CHUNK = 1 << 16


def rank_values(rank: int, start: int, count: int, dtype: torch.dtype, ranks: int) -> torch.Tensor:
    """Elements [start, start+count) of rank `rank`'s input: small integers hashed from the
    rank and the position, so any rank can regenerate any other rank's input, and data
    moved anywhere else (another rank's block, shifted by any amount) differs from the
    expected in about (1 - 1/modulus) of its elements. (A pattern linear in the rank and
    position repeats with the modulus: a block swapped with one 13 ranks on, or a result
    shifted by 13 elements, came out bit for bit right.)"""
    out = torch.empty(count, dtype=dtype)
    modulus = value_modulus(dtype, ranks)
    for lo in range(0, count, CHUNK):
        index = torch.arange(start + lo, start + min(lo + CHUNK, count), dtype=torch.int64)
        out[lo:lo + len(index)] = (mixed(index * 0x9E3779B1 + rank * 0x85EBCA77 + 1) % modulus).to(dtype)
    return out


def mixed(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash's finalizer (xor-shifts and odd multipliers, each product
    below 2**63 so int64 never overflows)."""
    x = x & 0xFFFFFFFF
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x46B5F2A9), (16, None)):
        x = x ^ (x >> shift)
        if multiplier is not None:
            x = (x * multiplier) & 0xFFFFFFFF
    return x


def reduce_over_ranks(op: str, start: int, count: int, dtype: torch.dtype, ranks: int) -> torch.Tensor:
    """Elements [start, start+count) of the reduction of every rank's input, computed in
    a wide type and rounded to `dtype` once."""
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    out = torch.empty(count, dtype=dtype)
    for lo in range(0, count, CHUNK):
        n = min(CHUNK, count - lo)
        total = rank_values(0, start + lo, n, dtype, ranks).to(wide)
        for rank in range(1, ranks):
            values = rank_values(rank, start + lo, n, dtype, ranks).to(wide)
            if op in ("sum", "avg"):
                total += values
            elif op == "max":
                torch.maximum(total, values, out=total)
            else:
                torch.minimum(total, values, out=total)
        if op == "avg":
            total /= ranks
        out[lo:lo + n] = total.to(dtype)
    return out


def count_wrong(actual: torch.Tensor, expected: torch.Tensor, op: str) -> int:
    """Mismatching elements, bit for bit: the inputs sum exactly, and avg is SUM / p rounded
    once (a float64 quotient rounded to the dtype is the correctly rounded one)."""
    return int((actual != expected).sum())


# --------------------------------------------------------------------- cases


class Case:
    """One collective on one buffer size: its tensors (on `device`: "cpu", or "cuda" for
    this rank's current GPU), its call and its expected result (always on the host)."""

    def __init__(self, collective: str, nbytes: int, dtype: torch.dtype, op: str, rank: int, ranks: int,
                 device: str = "cpu"):
        self.collective, self.nbytes, self.dtype, self.op = collective, nbytes, dtype, op
        self.rank, self.ranks, self.device = rank, ranks, device
        self.count = nbytes // dtype.itemsize
        self.block = self.count // ranks
        self.overflows = False   # timed loops reach inf (refill_for)
        new = lambda n: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
        if collective == "all_gather":
            self.input, self.output = new(self.block), new(self.count)
        elif collective == "reduce_scatter":
            self.input, self.output = new(self.count), new(self.block)
        else:
            self.input = self.output = new(self.count)  # in place

    def synchronize(self) -> None:
        """Wait until the GPU has finished all queued work (kernels, NCCL's too); nothing on CPU."""
        if self.device != "cpu":
            torch.cuda.synchronize()

    def fill(self) -> None:
        """Write this rank's input and poison a separate output, so a call that writes
        nothing is caught."""
        if self.output is not self.input:
            self.output.fill_(-1)
        self.input.copy_(rank_values(self.rank, 0, self.input.numel(), self.dtype, self.ranks))

    def call(self, comm: pccl.Communicator, algorithm: str, compression: str = "none") -> Callable[[], None]:
        """A no-argument function that runs the collective once with `algorithm` (and a codec)."""
        if self.collective == "all_gather":
            return lambda: comm.all_gather(self.output, self.input, algorithm=algorithm, compression=compression)
        if self.collective == "reduce_scatter":
            return lambda: comm.reduce_scatter(self.output, self.input, op=self.op, algorithm=algorithm,
                                               compression=compression)
        return lambda: comm.all_reduce(self.output, op=self.op, algorithm=algorithm, compression=compression)

    @cached_property
    def expected(self) -> torch.Tensor:
        """What this rank's output must hold, computed locally from every rank's input."""
        if self.collective == "all_gather":
            every = torch.empty(self.ranks, self.block, dtype=self.dtype)   # one block at a time, not a list to cat
            for r in range(self.ranks):
                every[r] = rank_values(r, 0, self.block, self.dtype, self.ranks)
            return every.view(-1)
        if self.collective == "reduce_scatter":
            return reduce_over_ranks(self.op, self.rank * self.block, self.block, self.dtype, self.ranks)
        return reduce_over_ranks(self.op, 0, self.count, self.dtype, self.ranks)

    def refill_for(self, calls: int) -> Optional[Callable[[], None]]:
        """For an in-place floating-point all-reduce sum, whose values grow p-fold a call: a
        function that restores, before a timed loop of `calls` calls, this rank's input
        scaled by a power of two that keeps the loop's sums finite (a codec encodes inf
        several times faster than numbers: rows timed on overflowed values, as every row
        after the first few of a size was, flattered compression). Sets `overflows` where no
        scale can (fp16, or many ranks and calls: the smallest value stays 2^8 above the
        smallest normal, so int8's scales do too). None where nothing grows. Call after
        fill()."""
        if self.collective != "all_reduce" or self.op != "sum" or not self.dtype.is_floating_point:
            return None
        info = torch.finfo(self.dtype)
        grown = math.log2(value_modulus(self.dtype, self.ranks) - 1) + calls * math.log2(self.ranks)
        needed = max(0, math.ceil(grown + 1 - math.log2(info.max)))
        room = math.floor(-math.log2(info.tiny)) - 8
        self.overflows = needed > room
        start = self.input * 2.0 ** -min(needed, room)
        return lambda: self.input.copy_(start)

    def wrong(self) -> int:
        """Elements of this rank's output that differ from the expected result (compared on
        the host: .cpu() copies a GPU output once, and is the tensor itself on CPU)."""
        return count_wrong(self.output.cpu(), self.expected, self.op)

    def error_sums(self) -> tuple[float, float, float]:
        """(largest |error|, sum of squared errors, sum of squared expected values) of this
        rank's output against the exact result."""
        output, expected = self.output.cpu(), self.expected
        largest = torch.zeros((), dtype=torch.float64)   # torch.maximum keeps a NaN, Python's max would not
        squares = reference = 0.0
        for lo in range(0, len(expected), CHUNK):
            exact = expected[lo:lo + CHUNK].double()
            error = output[lo:lo + CHUNK].double() - exact
            largest = torch.maximum(largest, error.abs().max())
            squares += error.square().sum().item()
            reference += exact.square().sum().item()
        return largest.item(), squares, reference


# ------------------------------------------------------------------ measuring


@dataclass
class Row:
    """One line of the table and one object of the JSON output."""

    collective: str
    size: int
    count: int
    dtype: str
    op: str
    executor: str
    algorithm: str
    picked: str
    time_us: float
    algbw: float
    busbw: float
    wrong: Optional[int]
    ranks: int
    compression: str = "none"
    max_error: Optional[float] = None   # compressed rows: largest |error| / largest |exact value|
    rms_error: Optional[float] = None   # compressed rows: RMS error / RMS exact value
    device: str = "cpu"                 # where the buffers were: cpu or cuda
    overflowed: bool = False            # its timed sums reached inf within a loop (Case.refill_for)


def check(case: Case, call: Callable[[], None], world: MPI.Comm) -> int:
    """Wrong elements over all ranks after one call on fresh inputs."""
    case.fill()
    call()
    case.synchronize()
    return world.allreduce(case.wrong(), op=MPI.SUM)


def errors(case: Case, call: Callable[[], None], world: MPI.Comm) -> tuple[float, float]:
    """(max, RMS) error of one call on fresh inputs, over all ranks, relative to the exact
    result's largest and RMS value."""
    case.fill()
    call()
    case.synchronize()
    largest, squares, reference = case.error_sums()
    largest = world.allreduce(largest, op=MPI.MAX)
    squares, reference = world.allreduce(squares), world.allreduce(reference)
    scale = world.allreduce(float(case.expected.abs().max()), op=MPI.MAX)   # exact in any dtype
    return largest / scale if scale else largest, (squares / reference) ** 0.5 if reference else squares ** 0.5


def measure(case: Case, todo: list[tuple[str, pccl.Communicator, str, str]], args: argparse.Namespace,
            world: MPI.Comm) -> list[Row]:
    """A row for each (executor label, communicator, algorithm, compression) of `todo` on one
    case: timed with their repeats taking turns (time_calls), then checked if asked; a lossy
    codec's row gets its error against the exact result instead of a count of wrong elements."""
    calls = [case.call(comm, algorithm, compression) for _, comm, algorithm, compression in todo]
    case.fill()
    for (_, _, algorithm, _), call in zip(todo, calls):
        if algorithm == "auto":
            call()   # a first call may measure auto's candidates (the self-calibration): not timed
    refill = case.refill_for(calls_a_loop(args))
    times = time_calls(calls, args.iters, args.warmup_iters, args.repeats, world, case.synchronize, refill)
    rows = []
    for (executor, comm, algorithm, compression), call, seconds in zip(todo, calls, times):
        wrong, error = None, (None, None)
        if compression != "none":
            error = errors(case, call, world)
        elif args.check:
            wrong = check(case, call, world)
        algbw, busbw = bandwidths(case.collective, case.nbytes, seconds, case.ranks)
        picked = auto_pick(case, comm, compression) if algorithm == "auto" else algorithm
        rows.append(Row(case.collective, case.nbytes, case.count, args.datatype, args.op, executor, algorithm,
                        picked, seconds * 1e6, algbw, busbw, wrong, case.ranks, compression, *error, case.device,
                        case.overflows))
    return rows


def calls_a_loop(args: argparse.Namespace) -> int:
    """The most calls of one row between two refills (time_calls): its warm-up or switching
    calls and its timed ones."""
    return max(args.warmup_iters, 1) + args.iters


def auto_pick(case: Case, comm: pccl.Communicator, compression: str) -> str:
    """The name of what an auto call of `case` runs, resolved as the call resolves it: for
    its buffers' device (plans only where their levels carry it), its reduction (floating-
    point max and min take a schedule) and its codec (a compressed auto never runs MPI's
    own collective)."""
    full = case.output if case.collective == "all_gather" else case.input
    op = None if case.collective == "all_gather" else case.op
    spec = comm.choose(case.collective, "auto", full, None if compression == "none" else codec(compression),
                       op).algorithm
    if isinstance(spec, str):
        return spec
    return next((name for name, named in NAMED.items() if named == spec), repr(spec))


# ------------------------------------------------------------------ variants


def make_communicator(executor: str, args: argparse.Namespace) -> pccl.Communicator:
    """The communicator over all ranks that runs schedules with `executor`; its topology
    and level transports (for the two-level plans) come from the options."""
    options = dict(ranks_per_node=args.ranks_per_node)
    if executor in TORCH_EXECUTORS:
        return pccl.init(transport=executor, **options)
    return pccl.init(executor=executor, intra=args.intra, inter=args.inter, **options)


def variants(collective: str, algorithms: Optional[list[str]],
             comms: dict[str, pccl.Communicator]) -> list[tuple[str, pccl.Communicator, str]]:
    """(executor label, communicator, algorithm) to run for `collective`.

    "native" is the transport's own collective: torch.distributed's for gloo and nccl
    (labels "gloo", "nccl"), MPI's for the MPI executors; MPI's is the same call under
    either MPI executor, so it runs once, under the first one listed (label "mpi"), as
    does its nonblocking form "native_nonblocking" (which torch.distributed has not).
    """
    # the table's rows: the schedules, the natives, auto, then the plans
    valid = tuple(n for k in ("schedule", "native", "auto", "plan") for n in vocabulary.names(collective)
                  if vocabulary.kind(n) == k)
    two_level = all(c.topology.num_nodes > 1 and c.topology.ranks_per_node > 1 for c in comms.values())
    groups = all(three_level.applies(c.topology) for c in comms.values())   # as auto offers it
    default = tuple(a for a in valid if a not in PLANS or (two_level and (a != "three_level" or groups)))
    chosen = [a for a in (algorithms or default) if a in valid]
    first_mpi = next((e for e in comms if e in MPI_EXECUTORS), None)
    out = []
    for executor, comm in comms.items():
        for algorithm in chosen:
            if algorithm not in NATIVES:
                out.append((executor, comm, algorithm))
            elif executor in TORCH_EXECUTORS:
                if algorithm == "native":
                    out.append((executor, comm, algorithm))
            elif executor == first_mpi:
                out.append(("mpi", comm, algorithm))
    return out


# ------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Gpus:
    """What decides which executors take GPU buffers, agreed by all ranks (every rank must
    skip the same rows, or their collectives would not match)."""

    name: str             # rank 0's GPU, as torch.cuda.get_device_name names it
    per_node: int         # the fewest GPUs a rank sees
    ranks_per_node: int   # the most ranks on one node: beyond per_node they share GPUs
    kernels: bool         # pccl's native module has GPU kernels on every rank (C++ executor, codecs)
    gpu_aware: bool       # MPI gets device pointers on every rank; else staged through pinned host memory
    nccl: bool            # torch has NCCL on every rank


def visible_gpus() -> int:
    """GPUs torch sees on this rank (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def use_gpu(local_rank: int) -> str:
    """Make GPU local_rank % count this rank's current device (before any NCCL group
    exists, as NCCL asks); its name."""
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.cuda.get_device_name(index)


def gpu_mpi() -> tuple[bool, bool]:
    """(the native module has GPU kernels, MPI takes device pointers), as the C++ executor
    decides them (PCCL_GPU_AWARE_MPI=0/1 decides the second where set)."""
    from pccl.executors.mpi_cpp import gpu_available, gpu_aware_mpi  # the native module: only with GPUs

    return gpu_available(), gpu_aware_mpi()


def probe_gpus(world: MPI.Comm) -> Gpus:
    """Select this rank's GPU (its rank on its node, from MPI's shared-memory split, modulo
    the GPUs) and agree on what the job's GPUs can do; collective over `world`."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    local_rank, local_ranks = node.rank, node.size
    node.Free()
    name = use_gpu(local_rank)
    every = world.allgather((name, visible_gpus(), local_ranks, *gpu_mpi(), dist.is_nccl_available()))
    names, gpus, ranks, kernels, aware, nccl = zip(*every)
    return Gpus(names[0], min(gpus), max(ranks), all(kernels), all(aware), all(nccl))


def device_header(gpus: Gpus) -> str:
    mpi = "GPU-aware (device pointers)" if gpus.gpu_aware else "staged through pinned host memory"
    if not gpus.kernels:
        mpi = "no GPU kernels in pccl's native module"
    return (f"# device: cuda  gpu: {gpus.name}  gpus per node: {gpus.per_node}  ranks per node: "
            f"{gpus.ranks_per_node}  MPI: {mpi}")


def executor_skip(executor: str, device: str, gpus: Optional[Gpus]) -> Optional[str]:
    """Why `executor` cannot run on `device` buffers in this job (gpus: None on cpu), or None."""
    if device == "cpu":
        return "NCCL carries GPU buffers only (--device cuda)" if executor == "nccl" else None
    if executor == "python":
        return "the Python executor runs on host buffers only"
    if executor == "gloo":
        return "gloo carries host buffers only"
    if executor == "cpp" and not gpus.kernels:
        return "pccl's native module has no GPU kernels: build it on a GPU machine (make GPU=cuda)"
    if executor == "nccl" and not gpus.nccl:
        return "this torch has no NCCL (torch.distributed.is_nccl_available() is False)"
    if executor == "nccl" and gpus.ranks_per_node > gpus.per_node:
        return (f"NCCL refuses two ranks on one GPU (ncclInvalidUsage), and {gpus.ranks_per_node} ranks share "
                f"{gpus.per_node} GPU(s) on a node; run at most one rank per GPU for NCCL (cpp, over MPI, shares GPUs)")
    return None


def row_skip(collective: str, executor: str, algorithm: str, compression: str, dtype: torch.dtype,
             device: str, plan_devices: tuple[str, ...], gpus: Optional[Gpus]) -> Optional[str]:
    """Why one row (an executor's algorithm, with a codec or "none") cannot run, or None.
    plan_devices: the buffers its communicator's plan levels carry. The same on every rank."""
    if algorithm in PLANS and device not in plan_devices:
        return f"the plans' levels (--intra/--inter) carry {'/'.join(plan_devices)} buffers only"
    if compression == "none":
        return None
    try:
        codec(compression).check(dtype)
    except ValueError as e:
        return str(e)
    if algorithm in PLANS and not compresses_consistently(NAMED[algorithm], collective):
        return "compressed, HO-Ring's concurrent phases would leave ranks with different results"
    if device == "cpu":
        return None
    if executor in MPI_EXECUTORS:
        return "the MPI executors compress host buffers only (GPU buffers: over nccl)"
    if codec(compression).native is None:
        return "GPU buffers take the native codecs only (int8, bf16, fp16)"
    if not gpus.kernels:
        return "GPU codecs need pccl's native module built with GPU kernels (make GPU=cuda)"
    return None


def runs(collective: str, args: argparse.Namespace, comms: dict[str, pccl.Communicator],
         gpus: Optional[Gpus]) -> tuple[list[tuple[str, pccl.Communicator, str, str]], dict[str, list[str]]]:
    """The rows of `collective`: those to run, (executor label, communicator, algorithm,
    codec), and those skipped, {reason: ["executor algorithm+codec", ...]}."""
    todo, skipped = [], {}
    dtype = DATATYPES[args.datatype]
    for executor, comm, algorithm in variants(collective, args.algorithms, comms):
        for name in ["none"] + ([] if algorithm in NATIVES else args.compression):
            reason = row_skip(collective, executor, algorithm, name, dtype, args.device,
                              comm.selector.plan_devices, gpus)
            if reason is None:
                todo.append((executor, comm, algorithm, name))
            else:
                label = f"{executor} {algorithm}" + ("" if name == "none" else f"+{name}")
                skipped.setdefault(reason, []).append(label)
    return todo, skipped


# ------------------------------------------------------------------- output

COLUMNS: tuple[tuple[str, int, Callable[[Row], str]], ...] = (
    ("size(B)", 12, lambda r: str(r.size)),
    ("count", 12, lambda r: str(r.count)),
    ("type", 8, lambda r: r.dtype),
    ("executor", 8, lambda r: r.executor),
    ("algorithm", 26, lambda r: (f"auto({r.picked})" if r.algorithm == "auto" else r.algorithm)
     + ("" if r.compression == "none" else f"+{r.compression}")),
    ("time(us)", 11, lambda r: f"{r.time_us:.2f}"),
    ("algbw(GB/s)", 11, lambda r: f"{r.algbw:.3f}"),
    ("busbw(GB/s)", 11, lambda r: f"{r.busbw:.3f}"),
    ("#wrong", 7, lambda r: "N/A" if r.wrong is None else str(r.wrong)),
    ("maxerr", 9, lambda r: "-" if r.max_error is None else f"{r.max_error:.1e}"),
    ("rmserr", 9, lambda r: "-" if r.rms_error is None else f"{r.rms_error:.1e}"),
)


def table_line(cells: list[str]) -> str:
    return " ".join(cell.rjust(width) for cell, (_, width, _) in zip(cells, COLUMNS))


def table_header(collective: str) -> str:
    rule = "#" + "-" * (len(table_line([""] * len(COLUMNS))) - 1)
    return f"#\n# {collective}\n{rule}\n#{table_line([name for name, _, _ in COLUMNS])[1:]}\n{rule}"


def format_row(row: Row) -> str:
    return table_line([fmt(row) for _, _, fmt in COLUMNS])


def run_header(args: argparse.Namespace, ranks: int, topology: pccl.Topology) -> str:
    return (f"# pccl-bench  ranks: {ranks}  nodes: {topology.num_nodes}x{topology.ranks_per_node}  "
            f"type: {args.datatype}  op: {args.op}  "
            f"minBytes: {args.minbytes}  maxBytes: {args.maxbytes}  step: {args.stepfactor}(factor)  "
            f"warmup iters: {args.warmup_iters}  iters: {args.iters}  repeats: {args.repeats}  "
            f"validation: {int(args.check)}")


def fastest(rows: list[Row]) -> dict[tuple[int, str], Row]:
    """The fastest row per (size, executor), among the concrete algorithms (not auto)."""
    best: dict[tuple[int, str], Row] = {}
    for row in rows:
        key = (row.size, row.executor)
        concrete = row.algorithm != "auto" and row.compression == "none"
        if concrete and (key not in best or row.time_us < best[key].time_us):
            best[key] = row
    return best


def summary(collective: str, rows: list[Row]) -> str:
    """Per size, the fastest algorithm of each executor; '*' marks auto's pick."""
    best = fastest(rows)
    if not best:
        return f"# {collective}: no rows"
    executors = list(dict.fromkeys(e for _, e in best))
    sizes = list(dict.fromkeys(s for s, _ in best))
    picks: dict[tuple[int, str], set[str]] = {}
    for r in rows:
        if r.algorithm == "auto" and r.compression == "none":
            picks.setdefault((r.size, r.executor), set()).add(r.picked)
            if r.picked in NATIVES and r.executor in ("cpp", "python"):   # MPI's own: its rows are "mpi"'s
                picks.setdefault((r.size, "mpi"), set()).add(r.picked)

    def cell(size: int, executor: str) -> str:
        row = best.get((size, executor))
        if row is None:
            return "-"
        mark = "*" if row.algorithm in picks.get((size, executor), ()) else ""
        return f"{row.algorithm}{mark} {row.time_us:.1f}us"

    lines = [f"# {collective}: fastest algorithm per executor (* = auto's pick)",
             "#" + f"{'size(B)':>11} " + " ".join(f"{e:>28}" for e in executors)]
    lines += [f"{s:>12} " + " ".join(f"{cell(s, e):>28}" for e in executors) for s in sizes]
    return "\n".join(lines)


def auto_summary(collective: str, rows: list[Row]) -> str:
    """Per size and executor running auto: auto's time against the fastest concrete
    algorithm of the same transport (the MPI library's own collective counts for the MPI
    executors, under "mpi"), and what each was."""
    transport = {"mpi": "mpi", "cpp": "mpi", "python": "mpi", "gloo": "gloo", "nccl": "nccl"}
    lines = [f"# {collective}: auto against the fastest of native and every algorithm",
             f"#{'size(B)':>11} {'executor':>8} {'auto(us)':>10} {'best(us)':>10} {'auto/best':>9}  "
             "auto ran -> fastest"]
    for r in rows:
        if r.algorithm != "auto" or r.compression != "none":
            continue
        rivals = [o for o in rows if o.size == r.size and o.algorithm != "auto" and o.compression == "none"
                  and transport[o.executor] == transport[r.executor] and (o.executor == r.executor or
                                                                          o.algorithm in NATIVES)]
        if rivals:
            best = min(rivals, key=lambda o: o.time_us)
            lines.append(f"{r.size:>12} {r.executor:>8} {r.time_us:>10.2f} {best.time_us:>10.2f} "
                         f"{r.time_us / best.time_us:>9.2f}  {r.picked} -> {best.algorithm}")
    return "\n".join(lines)


def compression_summary(collective: str, rows: list[Row]) -> str:
    """Per compressed row: its speed-up over the same algorithm uncompressed, and its error."""
    plain = {(r.size, r.executor, r.algorithm): r for r in rows if r.compression == "none"}
    lines = [f"# {collective}: compressed vs the same algorithm uncompressed",
             f"#{'size(B)':>11} {'executor':>8} {'algorithm':>26} {'codec':>8} {'speed-up':>9} {'rmserr':>9}"]
    for r in rows:
        base = plain.get((r.size, r.executor, r.algorithm))
        if r.compression != "none" and base is not None:
            lines.append(f"{r.size:>12} {r.executor:>8} {r.algorithm:>26} {r.compression:>8} "
                         f"{base.time_us / r.time_us:>8.2f}x {r.rms_error:>9.1e}")
    return "\n".join(lines)


def write_json(rows: list[Row], path: str) -> None:
    text = json.dumps([asdict(row) for row in rows], indent=1)
    if path == "-":
        print(text, flush=True)
    else:
        write_atomic(Path(path), (text + "\n").encode())   # a reader never sees half a file


# -------------------------------------------------------------------- options


def codec_list(text: str) -> list[str]:
    """An argparse type: a comma-separated list of codec names (pccl.compression.codecs)."""
    names = comma_names(text)
    try:
        for name in names:
            codec(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pccl-bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("-b", "--minbytes", type=size_arg, default=parse_size("32M"), help="smallest buffer (K/M/G suffixes)")
    add("-e", "--maxbytes", type=size_arg, default=parse_size("32M"), help="largest buffer")
    add("-f", "--stepfactor", type=at_least(2), default=2, help="multiply the size by this between rows")
    add("-n", "--iters", type=at_least(1), default=20, help="timed calls per loop")
    add("-w", "--warmup_iters", type=at_least(0), default=5, help="untimed calls first")
    add("-c", "--check", type=int, choices=(0, 1), default=1, help="check correctness")
    add("-d", "--datatype", choices=tuple(DATATYPES), default="float")
    add("-o", "--op", choices=tuple(OPS), default="sum", help="reduction (reduce_scatter, all_reduce)")
    add("--collectives", type=comma_list(COLLECTIVES), default=["all_gather", "reduce_scatter"])
    add("--algorithms", type=comma_list(vocabulary.names()), default=None,
        help="default: every algorithm of each collective, plus native and auto, plus the "
             "two-level plans when there are several nodes of several ranks")
    add("--ranks-per-node", type=at_least(1), default=None,
        help="treat consecutive groups of this many ranks as nodes (default: detected)")
    add("--intra", choices=("mpi", "gloo"), default=None, help="transport of the intra-node level (MPI executors)")
    add("--inter", choices=("mpi", "gloo"), default=None, help="transport of the inter-node level (MPI executors)")
    add("--device", choices=("cpu", "cuda"), default="cpu",
        help="where the buffers are: cuda puts each rank's on GPU local_rank %% GPUs (MPI ranks may share "
             "one; NCCL needs one per rank)")
    add("--executors", type=comma_list(EXECUTORS), default=None,
        help="default: cpp,python,gloo on cpu, cpp,nccl on cuda; rows an executor cannot run on the device's "
             "buffers are skipped, with the reason")
    add("--repeats", type=at_least(1), default=1,
        help="timed loops per row, the rows of a size taking turns; the median is reported")
    add("--compression", type=codec_list, default=[],
        help="codecs (int8, bf16, fp16, zfp:RATE) to add rows for: each algorithm (not native) again with "
             "compression, with its max and RMS error against the exact result")
    add("--json", metavar="PATH", type=output(), default=None, help="write the rows as JSON ('-': stdout, no table)")
    add("--calibrate", metavar="PATH", type=output(parents=True), default=None,
        help="instead of timing collectives, measure this machine's profile (alpha, bandwidths, and "
             "every algorithm auto chooses among, the native one too, at 4 B, 16 B, ... up to --maxbytes) "
             "and write it to PATH, for PCCL_PROFILE and pccl-sim --profile")
    add("--profile-name", default="calibrated", help="the name written into a calibrated profile")
    args = parser.parse_args(argv)
    if args.minbytes > args.maxbytes:
        parser.error(f"--minbytes ({args.minbytes}) must not exceed --maxbytes ({args.maxbytes})")
    if args.op == "avg" and not DATATYPES[args.datatype].is_floating_point:
        parser.error(f"op avg needs a floating-point datatype, got {args.datatype}")
    if args.device == "cuda" and args.calibrate:
        parser.error("--calibrate measures host buffers; leave out --device cuda")
    world = MPI.COMM_WORLD.size
    itemsize = DATATYPES[args.datatype].itemsize
    if not size_sweep(args.minbytes, args.maxbytes, args.stepfactor, world, itemsize):   # (it printed "no rows")
        parser.error(f"no size from --minbytes {args.minbytes} to --maxbytes {args.maxbytes} splits into {world} "
                     f"blocks of whole {args.datatype} elements: give --maxbytes {world * itemsize} or more")
    if args.ranks_per_node is not None and world % args.ranks_per_node:
        parser.error(f"--ranks-per-node {args.ranks_per_node} does not divide the {world} ranks")
    if args.device == "cuda" and visible_gpus() == 0:
        parser.error("--device cuda needs a GPU, and torch sees none (a CPU-only torch, or CUDA_VISIBLE_DEVICES "
                     "hides them)")
    args.executors = args.executors or DEFAULT_EXECUTORS[args.device]
    return args


# ----------------------------------------------------------------------- main


def time_candidates(comm: pccl.Communicator, maxbytes: int) -> dict:
    """{(collective, reduction class, algorithm): [(bytes, seconds), ...]}: every candidate
    of auto (MPI's own collectives too) timed through `comm` as the self-calibration times
    them, from 4 B up to `maxbytes` with no time budget, in float32 and (for the
    reductions) bfloat16."""
    return {(collective, klass, name): points
            for collective in COLLECTIVES
            for klass in (("full",) if collective == "all_gather" else REDUCTION_CLASSES)
            for name, points in self_calibration.measure(comm, collective, comm.selector.tuner.candidates(collective),
                                                         self_calibration.DTYPE_OF[klass], math.inf, maxbytes).items()}


def write_profile(args: argparse.Namespace, world: MPI.Comm) -> None:
    """--calibrate: measure the profile (the links, then every collective auto chooses
    among) on all ranks; rank 0 writes it and shows it."""
    comm = pccl.init(ranks_per_node=args.ranks_per_node)
    topology = comm.topology
    profile = calibrate(world, topology, args.profile_name)
    profile = calibrated(profile, topology, time_candidates(comm, args.maxbytes),
                         f"pccl-bench --calibrate, {topology.describe()}: every candidate of auto through the "
                         f"Communicator ({comm.executor} executor) from 4 B to {args.maxbytes} B (x4 to 64 KiB, then "
                         f"doubling), of float32 and bfloat16, the slowest rank's time per call, median of "
                         f"{self_calibration.SHORT_ROUNDS} rounds below {self_calibration.DOUBLING_BYTES} B, "
                         f"{self_calibration.ROUNDS} from there")
    if world.rank == 0:
        print(json.dumps(profile.to_dict(), indent=1), flush=True)   # first: a failed write loses nothing
        try:
            profile.save(args.calibrate)
        except OSError as e:
            print(f"pccl-bench: could not write {args.calibrate} ({e}); the profile is above", file=sys.stderr)
            sys.exit(1)
        print(f"# wrote {args.calibrate}; use it with PCCL_PROFILE={args.calibrate} or pccl-sim --profile "
              f"{args.calibrate}", flush=True)


@quiet_when_its_reader_goes
def main(argv: Optional[list[str]] = None) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if args.calibrate:
        write_profile(args, world)
        return
    ranks, dtype = world.size, DATATYPES[args.datatype]
    show = world.rank == 0 and args.json != "-"
    say = (lambda text: print(text, flush=True)) if show else (lambda text: None)
    # what is skipped, and why: in the table, or on stderr where stdout carries the JSON
    notes = sys.stdout if show else sys.stderr
    note = (lambda text: print(text, file=notes, flush=True)) if world.rank == 0 else (lambda text: None)
    gpus = probe_gpus(world) if args.device == "cuda" else None   # before any communicator (NCCL's GPU)
    skipped = {e: why for e in args.executors if (why := executor_skip(e, args.device, gpus)) is not None}
    executors = [e for e in args.executors if e not in skipped]
    if not executors:   # decided alike on every rank, before anything is sent
        if world.rank == 0:
            print(f"pccl-bench: no executor of {','.join(args.executors)} can run {args.device} buffers here: "
                  + "; ".join(f"{e}: {why}" for e, why in skipped.items()), file=sys.stderr, flush=True)
        sys.exit(1)
    comms = {executor: make_communicator(executor, args) for executor in executors}
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor, ranks, dtype.itemsize)

    say(run_header(args, ranks, next(iter(comms.values())).topology))
    if gpus is not None:
        say(device_header(gpus))
    for executor, why in skipped.items():
        note(f"# skipped {executor}: {why}")
    rows: list[Row] = []
    for collective in args.collectives:
        say(table_header(collective))
        todo, skipped_rows = runs(collective, args, comms, gpus)
        for why, labels in skipped_rows.items():
            note(f"# skipped {', '.join(labels)}: {why}")
        if not todo and args.algorithms:
            note(f"# skipped {collective}: none of --algorithms {','.join(args.algorithms)} runs it")
        for nbytes in sizes:
            case = Case(collective, nbytes, dtype, args.op, world.rank, ranks, args.device)
            for row in measure(case, todo, args, world):
                rows.append(row)
                say(format_row(row))
    overflowed = sorted({r.size for r in rows if r.overflowed})
    if overflowed:
        note(f"# all-reduce sums of {', '.join(map(str, overflowed))} bytes reached inf within a timed loop "
             f"({args.datatype} on {ranks} ranks, {calls_a_loop(args)} calls a loop): a codec "
             "encodes inf faster than numbers, so their compressed rows are flattered; fewer -n/-w, or op avg")
    for collective in args.collectives:
        mine = [r for r in rows if r.collective == collective]
        say("#\n" + summary(collective, mine))
        say("#\n" + auto_summary(collective, mine))
        if args.compression:
            say("#\n" + compression_summary(collective, mine))
    for executor, comm in comms.items():
        say(f"# auto ({executor}): {self_calibration.basis(comm, args.device)}")
    if world.rank == 0 and args.json:
        write_json(rows, args.json)


if __name__ == "__main__":
    main()
