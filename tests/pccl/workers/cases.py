"""The multi-rank test matrix, shared by the pytest driver and the mpiexec worker.

A group is (executor, collective, algorithm); inside a group every dtype x op x size runs,
and the group passes when every combination equals, bit for bit, the reference computed
from all ranks' inputs. Inputs are small integers, exactly representable and summed exactly
in every dtype, so sums, maxima and minima are exact, and avg is the exact sum divided by
p and rounded once: what a true division SUM / p gives in every dtype (a multiplication by
1/p is off by an ulp in about a third of the elements).
"""
from __future__ import annotations

import torch

from pccl.algorithms import algorithms_for

WORLD_SIZES = (1, 2, 3, 4, 5, 6, 8)
EXECUTORS = ("cpp", "python", "gloo")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
REDUCING = ("reduce_scatter", "all_reduce")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
OPS = ("sum", "avg", "max", "min")
MB_BYTES = 2 << 20   # the "few MB" case: full buffer of 2 MiB, float32 sum


def groups() -> list[tuple[str, str, str]]:
    # "native" is the transport's own collective: MPI's (tested once, under cpp) or gloo's;
    # "native_nonblocking" MPI's nonblocking one, polled.
    return [(e, c, a) for e in EXECUTORS for c in COLLECTIVES
            for a in algorithms_for(c) + (("native",) if e != "python" else ())
            + (("native_nonblocking",) if e == "cpp" else ())]


def group_id(executor: str, collective: str, algorithm: str) -> str:
    return f"{executor}-{collective}-{algorithm}"


def counts(collective: str, p: int) -> list[int]:
    """Element counts per call: per-rank share for all-gather/reduce-scatter, total for all-reduce.

    0, 1, odd, (all-reduce) not divisible by p, and larger.
    """
    if collective == "all_reduce":
        return [0, 1, 7, 5 * p + 3, 1001]
    return [0, 1, 7, 1001]


def cases_for(executor: str, algorithm: str, collective: str, p: int) -> list:
    """The cases a group runs: the whole matrix, except the light one for gloo's schedules,
    whose arithmetic is the Python executor's (one ScheduleExecutor) and whose every call
    costs milliseconds of TCP on shared cores (gloo's own collectives, with arithmetic of
    their own, run the whole matrix)."""
    light = executor == "gloo" and algorithm != "native"
    return list((light_combos if light else combos)(collective, p))


def combos(collective: str, p: int):
    """Yield (dtype, op, count) for one group, then the few-MB float32 case."""
    for dtype in DTYPES:
        ops = ("sum",) if collective == "all_gather" else tuple(
            o for o in OPS if o != "avg" or dtype.is_floating_point)
        for op in ops:
            for n in counts(collective, p):
                yield dtype, op, n
    elems = MB_BYTES // 4
    yield torch.float32, "sum", elems // p if collective != "all_reduce" else elems + 1


def make_input(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Small integers; in a floating-point dtype about half of the zeros are -0, so that max
    and min meet zeros of both signs."""
    g = torch.Generator().manual_seed(rank * 1_000_003 + salt)
    x = torch.randint(-16, 17, (numel,), generator=g, dtype=torch.int64).to(dtype)
    if dtype.is_floating_point:
        x[(x == 0) & (torch.rand(numel, generator=g) < 0.5)] = -0.0
    return x


def reduce_reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction over ranks in float64; a max or min of zeros is signed as IEEE 754-2019's
    maximum and minimum sign it: max is -0 only where no rank holds +0, min is -0 where any
    rank holds -0."""
    stacked = torch.stack([t.double() for t in inputs])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / len(inputs)
    result = stacked.max(0).values if op == "max" else stacked.min(0).values
    zero = stacked == 0
    negative = ~(zero & ~stacked.signbit()).any(0) if op == "max" else (zero & stacked.signbit()).any(0)
    return torch.where(result == 0, torch.where(negative, -0.0, 0.0).double(), result)


def matches(actual: torch.Tensor, expected: torch.Tensor, signs: bool = False) -> bool:
    """Bit for bit, every op: the references of reduce_reference rounded to the dtype once
    (a quotient computed in float64 and rounded to float32, fp16 or bf16 is the correctly
    rounded one, since 53 >= 2 * 24 + 2). Zeros of either sign match unless `signs`: pccl's
    max and min sign them (csrc/extrema.h), the transports' own collectives as their library
    does."""
    expected = expected.to(actual.dtype)
    return torch.equal(actual, expected) and (not signs or torch.equal(actual.signbit(), expected.signbit()))


# Two-level plans: emulated topologies (ranks, ranks per node), plan specs, level transports.
PLAN_TOPOLOGIES = ((8, 4), (8, 2), (6, 3), (6, 2), (4, 2), (1, 1))
PLAN_GROUPS = {(8, 2): 2}   # (p, ranks per node) -> nodes per network group: 2 groups x 2 nodes x 2 ranks
PLAN_SPECS = ("hierarchical", "ho_ring", "hier_ring_ring", "hier_bruck_native", "three_level")
# transport label -> (pccl.init keyword arguments, plan specs run on it, the specs that run
# the whole case matrix). The plan executor's arithmetic is one code for every spec and
# transport (its phases are the flat executors', tested on the whole matrix): the whole
# matrix runs on the default plans (two levels, and three where there are network groups),
# the light one everywhere else.
PLAN_TRANSPORTS = {
    "cpp": (dict(executor="cpp"), PLAN_SPECS, ("hierarchical", "three_level")),
    "python": (dict(executor="python"), ("hierarchical", "ho_ring"), ()),
    "mixed": (dict(executor="cpp", intra="gloo", inter="mpi"), ("hierarchical", "ho_ring"), ()),
    "gloo": (dict(transport="gloo"), ("hierarchical", "ho_ring"), ()),
}


# Plans whose every level runs a pccl schedule (native levels sum in their library's order): on
# every transport, avg is bit-identical.
AGREEING_PLANS = ("hier_ring_ring", "ho_ring")


def plan_groups() -> list[tuple[str, str, str]]:
    return [(t, c, s) for t, (_, specs, _) in PLAN_TRANSPORTS.items() for c in COLLECTIVES for s in specs]


def light_combos(collective: str, p: int):
    """A smaller matrix for the slower transports: three dtypes, two ops, three sizes."""
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        if collective == "all_gather":
            ops = ("sum",)
        else:
            ops = ("avg", "max") if dtype.is_floating_point else ("sum", "max")
        for op in ops:
            for n in (1, 7, 5 * p + 3 if collective == "all_reduce" else 129):
                yield dtype, op, n
