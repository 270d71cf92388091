"""The planner: which sharding strategy, group size and algorithms to train a GPT with, on
a given cluster, and why (shard-plan prints its table: shard/tools/strategy_plan.py), and
the engine of its choice for strategy="auto" (build_engine).

PaRO's point is that no strategy is best everywhere: the right scopes of parameters (P),
gradients (G) and optimizer state (OS), and the group size of the I scope, depend on the
model, the memory per device, the intra- and inter-node links and the batch. The planner
evaluates every strategy Principle 1 allows (the 14 of PaRO's Table 1) at every candidate
group size and collective algorithm:

- memory per rank by part, at its peak (footprint.py: the model state exactly as the
  engine holds it, activations, the gathered units of the prefetch depth, gradients being
  reduced, workspaces), against the device's memory less a headroom;
- for those that fit, the step time the engine's own trace predicts (predict.py: its
  collectives on the machine profile's cost model, compute from FLOPs at an assumed
  or measured rate, replayed with the engine's overlap), hence tokens/s, MFU and the
  communication the step waits for.

The chosen one is the fastest that fits (objective "throughput") or the one with the
smallest peak (objective "memory"); the table ranks every candidate, and those that do
not fit say by how much they miss. Nothing that fits: PlanError names the smallest device
memory that would do and the strategy that needs it.
"""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import torch

from pccl import Topology
from pccl.tuning.profiles import Profile
from shard.engine.config import OBJECTIVES, EngineConfig
from shard.engine.engine import Engine
from shard.engine.strategy import STRATEGIES, Strategy
from shard.engine.units import MIN_SHARD_NUMEL
from shard.models.gpt import GPT, GPTConfig
from shard.planning.footprint import footprint, unit_sizes
from shard.planning.predict import ComputeRate, Workload, predict_step, unit_flops
from shard.planning.throughput import DEFAULT_MFU, peak_tflops

GIB = 1 << 30
MAX_MICRO_BATCHES = 4096   # per rank and step: a plan traces every one (about 16 s for a 7B model at 4096)
# Engine's own keyword arguments (units=, device=, init=), beside its settings
ENGINE_ARGUMENTS = tuple(name for name, p in inspect.signature(Engine).parameters.items() if p.kind is p.KEYWORD_ONLY)


class PlanError(ValueError):
    """A plan that cannot be made: bad input, or a model that fits no strategy."""


@dataclass(frozen=True)
class Job:
    """What is trained, per step."""

    cfg: GPTConfig
    seq: int                     # tokens per sequence
    micro_batch: int             # sequences per rank per forward and backward
    micro_batches: int           # per rank per step (gradient accumulation)
    precision: str = "bf16"
    reduce_dtype: Optional[str] = None   # None: the precision
    checkpointing: bool = False
    prefetch: int = 1
    prefetch_bytes: Optional[int] = None
    min_shard_numel: int = MIN_SHARD_NUMEL
    reshard_after_forward: bool = True
    name: str = "model"

    def __post_init__(self) -> None:
        Workload(self.seq, self.micro_batch, self.micro_batches)   # positive integers, or a clear error
        if self.seq > self.cfg.context:
            raise PlanError(f"sequence length {self.seq} exceeds the model's context {self.cfg.context}")

    @property
    def workload(self) -> Workload:
        return Workload(self.seq, self.micro_batch, self.micro_batches)

    @property
    def reduce(self) -> str:
        return self.reduce_dtype or self.precision

    @classmethod
    def for_global_batch(cls, cfg: GPTConfig, world: int, global_batch_tokens: int, seq: int, micro_batch: int,
                         **settings) -> "Job":
        """The job whose micro-batches over `world` ranks make `global_batch_tokens` a step."""
        per_micro = world * micro_batch * seq
        if global_batch_tokens % per_micro or global_batch_tokens < per_micro:
            raise PlanError(f"a global batch of {global_batch_tokens} tokens is not a whole number of micro-batches of "
                            f"{micro_batch} x {seq} tokens on each of {world} ranks ({per_micro} tokens each); "
                            f"expected a multiple of {per_micro}")
        micro_batches = global_batch_tokens // per_micro
        if micro_batches > MAX_MICRO_BATCHES:   # each is traced: about 4 ms each for a 7B model here
            raise PlanError(f"a global batch of {global_batch_tokens} tokens is {micro_batches} micro-batches a step "
                            f"per rank, more than the {MAX_MICRO_BATCHES} a step's trace replays; raise the "
                            "micro-batch or lower the global batch")
        return cls(cfg, seq, micro_batch, micro_batches, **settings)


@dataclass(frozen=True)
class Cluster:
    """Where it is trained."""

    topology: Topology
    profile: Profile
    memory: int                  # bytes per device (rank)
    rate: ComputeRate            # how fast one rank computes
    headroom: float = 0.1        # of the memory, kept free (allocator fragmentation, library buffers)
    peak_flops: Optional[float] = None   # per rank, for MFU
    shared_cores: bool = False   # computation and communication share the cores (CPU ranks)
    transport: str = "mpi"       # the ranks' ("mpi", "gloo", "nccl"): over torch.distributed, lanes run no plans

    def __post_init__(self) -> None:
        if not (isinstance(self.memory, int) and self.memory > 0):
            raise PlanError(f"memory per device must be a positive number of bytes, got {self.memory!r}")
        if not 0 <= self.headroom < 1:
            raise PlanError(f"headroom must be a fraction in [0, 1), got {self.headroom!r}")

    @property
    def usable(self) -> int:
        return int(self.memory * (1 - self.headroom))


@dataclass
class Candidate:
    strategy: Strategy
    group: int
    algorithm: object
    memory: dict                 # bytes per rank by part, and "peak" and "moment"
    fits: bool
    miss: int                    # bytes over the usable memory (0 when it fits)
    step: Optional[dict] = None  # predict_step's result (fitting candidates, or all with predict_all)

    def row(self, job: Job, cluster: Cluster) -> dict:
        out = {"strategy": self.strategy.letters, "name": self.strategy.name,
               "group": self.group if self.strategy.uses_groups() else None,
               "algorithm": self.algorithm, "fits": self.fits, "miss_bytes": self.miss,
               "memory": dict(self.memory)}
        if self.step is not None:
            s = self.step
            flops = job.cfg.flops_per_token(job.seq) * s["tokens_per_s"] / cluster.topology.size
            out.update({"step_s": s["step_s"], "tokens_per_s": s["tokens_per_s"], "compute_s": s["compute_s"],
                        "comm_s": s["comm_s"], "exposed_s": s["exposed_s"],
                        "mfu": flops / cluster.peak_flops if cluster.peak_flops else None,
                        "collectives": s["collectives"], "algorithms": s["algorithms"]})
        return out


def group_sizes(world: int, ranks_per_node: int, every: bool = False) -> list[int]:
    """Group sizes for the I scope: half a node to four nodes (PaRO's groups are nodes),
    or every divisor of the world; never 1 or the world itself, where I is N or G."""
    if every:
        wanted = range(2, world)
    else:
        wanted = {ranks_per_node // 2, ranks_per_node, 2 * ranks_per_node, 4 * ranks_per_node}
    return sorted(g for g in wanted if 1 < g < world and world % g == 0)


def candidates(world: int, ranks_per_node: int, strategies=STRATEGIES, groups=None) -> list[tuple[Strategy, int]]:
    """(strategy, group size) pairs: strategies with an I scope at each group size, the
    others once (their group size changes nothing; the node's is kept)."""
    groups = group_sizes(world, ranks_per_node) if groups is None else list(groups)
    for g in groups:
        if not (isinstance(g, int) and 1 < g < world and world % g == 0):
            raise PlanError(f"group size {g!r} must divide the world of {world} ranks and lie strictly between 1 and "
                            f"{world}")
    out = []
    for s in strategies:
        s = Strategy.parse(s)
        if s.uses_groups():
            out += [(s, g) for g in groups]
        else:
            out.append((s, ranks_per_node if world % ranks_per_node == 0 else 1))
    return out


@dataclass
class StrategyPlan:
    job: Job
    cluster: Cluster
    objective: str
    ranked: list[Candidate]      # fitting first, best first; then the rest, nearest to fitting first
    assumptions: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> Candidate:
        return self.ranked[0]

    @property
    def runner_up(self) -> Optional[Candidate]:
        return self.ranked[1] if len(self.ranked) > 1 and self.ranked[1].fits else None

    def margin(self) -> Optional[float]:
        """How much better the choice is predicted than the runner-up, by the objective:
        its tokens/s over the runner-up's, or the runner-up's peak over its own, less 1."""
        other = self.runner_up
        if other is None:
            return None
        if self.objective == "memory":
            return other.memory["peak"] / self.chosen.memory["peak"] - 1
        return self.chosen.step["tokens_per_s"] / other.step["tokens_per_s"] - 1

    def reason(self) -> str:
        """Why the choice wins, in a sentence or three."""
        c, other = self.chosen, self.runner_up
        usable = self.cluster.usable
        lines = []
        name = label(c)
        if self.objective == "memory":
            lines.append(f"{name} needs the least memory: {in_gib(c.memory['peak'])} per rank at its peak "
                         f"({c.memory['moment']})" + (f", {self.margin():.1%} less than {label(other)}"
                                                        if other else "") + ".")
        elif other is None:
            lines.append(f"{name} is the only candidate that fits.")
        else:
            a, b = c.step, other.step
            why = (f"it waits {a['exposed_s']:.3g} s per step for communication against {b['exposed_s']:.3g} s"
                   if a["exposed_s"] < b["exposed_s"] else
                   f"its collectives take {a['comm_s']:.3g} s against {b['comm_s']:.3g} s" if a["comm_s"] < b["comm_s"]
                   else f"its step is {a['step_s']:.4g} s against {b['step_s']:.4g} s")
            lines.append(f"{name} is predicted fastest: {a['tokens_per_s']:.4g} tokens/s, {self.margin():.1%} ahead "
                         f"of {label(other)}; {why}.")
        misses = [x for x in self.ranked if not x.fits]
        if misses:
            faster = [x for x in misses if x.step is not None and c.step is not None
                      and x.step["tokens_per_s"] > c.step["tokens_per_s"]]
            lines.append(f"{len(misses)} of {len(self.ranked)} candidates do not fit {in_gib(usable)} "
                         f"({self.cluster.headroom:.0%} of {in_gib(self.cluster.memory)} kept free); the nearest, "
                         f"{label(misses[0])}, is {in_gib(misses[0].miss)} over"
                         + (f"; {label(faster[0])} would be faster but needs {in_gib(faster[0].memory['peak'])}"
                            if faster else "") + ".")
        return " ".join(lines)

    def rows(self) -> list[dict]:
        return [dict(rank=i + 1, **c.row(self.job, self.cluster)) for i, c in enumerate(self.ranked)]

    def to_json(self) -> dict:
        rows = self.rows()
        return {"chosen": rows[0], "runner_up": rows[1] if self.runner_up else None, "margin": self.margin(),
                "objective": self.objective, "reason": self.reason(),
                "job": {"model": self.job.name, "params": self.job.cfg.num_params(), **asdict(self.job.cfg),
                        "seq": self.job.seq, "micro_batch": self.job.micro_batch,
                        "micro_batches": self.job.micro_batches, "precision": self.job.precision,
                        "reduce_dtype": self.job.reduce, "checkpointing": self.job.checkpointing,
                        "prefetch": self.job.prefetch},
                "cluster": {"world": self.cluster.topology.size, "ranks_per_node": self.cluster.topology.ranks_per_node,
                            "profile": self.cluster.profile.name, "memory_bytes": self.cluster.memory,
                            "headroom": self.cluster.headroom, "usable_bytes": self.cluster.usable,
                            "compute_flops_per_s": self.cluster.rate.flops_per_s, "compute": self.cluster.rate.source},
                "assumptions": self.assumptions, "rows": rows}


def in_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.3g} GiB"


def label(c: Candidate) -> str:
    group = f" (groups of {c.group})" if c.strategy.uses_groups() else ""
    algorithm = "" if c.algorithm == "auto" else f" [{c.algorithm}]"
    return f"{c.strategy.name}{group}{algorithm}"


def _flops(job: Job) -> dict:
    """Forward and backward FLOPs per unit of one micro-batch; with activation
    checkpointing every unit but the root recomputes its forward in its backward."""
    from shard.engine.units import split_units

    with torch.device("meta"):
        model = GPT(job.cfg)
    flops = unit_flops(model, [u.name for u in split_units(model)], job.workload)
    if job.checkpointing:
        flops = {u: (f, b + (f if u != "<root>" else 0.0)) for u, (f, b) in flops.items()}
    return flops


def sized(job: Job, cluster: Cluster, *, strategies=STRATEGIES, groups=None, algorithms=("auto",)) -> list[Candidate]:
    """Every candidate with its memory per rank and whether it fits (no step predicted yet)."""
    if not algorithms:
        raise PlanError("give at least one algorithm to evaluate, such as 'auto'")
    world = cluster.topology.size
    with torch.device("meta"):
        sizes = unit_sizes(GPT(job.cfg))
    out = []
    for strategy, group in candidates(world, cluster.topology.ranks_per_node, strategies, groups):
        f = footprint(job.cfg, sizes, strategy, world, group, micro_batch=job.micro_batch, seq_len=job.seq,
                      precision=job.precision, reduce_dtype=job.reduce, checkpointing=job.checkpointing,
                      prefetch=job.prefetch, prefetch_bytes=job.prefetch_bytes, min_shard_numel=job.min_shard_numel,
                      micro_batches=job.micro_batches, reshard_after_forward=job.reshard_after_forward)
        memory = {**f.parts, "peak": f.peak, "moment": f.phase}
        for algorithm in algorithms:
            out.append(Candidate(strategy, group, algorithm, memory, f.peak <= cluster.usable,
                                 max(0, f.peak - cluster.usable)))
    return out


def make_plan(job: Job, cluster: Cluster, *, objective: str = "throughput", strategies=STRATEGIES, groups=None,
              algorithms=("auto",), predict_all: bool = False) -> StrategyPlan:
    """Every candidate evaluated and ranked (see the module's docstring); PlanError when none
    fits. predict_all: predict the step time of the candidates that do not fit too."""
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    topology, world = cluster.topology, cluster.topology.size
    evaluated = sized(job, cluster, strategies=strategies, groups=groups, algorithms=algorithms)
    fitting = [c for c in evaluated if c.fits]
    if not fitting:
        best = min(evaluated, key=lambda c: c.memory["peak"])
        needed = best.memory["peak"] / (1 - cluster.headroom)
        raise PlanError(
            f"{job.name} ({job.cfg.num_params() / 1e9:.3g}B parameters, micro-batch {job.micro_batch} x {job.seq} "
            f"tokens, {job.precision}{', activation checkpointing' if job.checkpointing else ''}) fits no strategy on "
            f"{world} ranks with {in_gib(cluster.memory)} per device ({cluster.headroom:.0%} kept free): the smallest "
            f"peak is {label(best)}'s, {in_gib(best.memory['peak'])} per rank, which needs at least "
            f"{in_gib(needed)} per device" + ("" if job.checkpointing else "; activation checkpointing, a smaller "
                                              "micro-batch or more ranks would lower it"))
    flops = _flops(job)
    with torch.device("meta"):
        model = GPT(job.cfg)   # each prediction traces its own skeleton of it
    for c in evaluated:
        if c.fits or predict_all:
            c.step = predict_step(model, topology, cluster.profile, job.workload, cluster.rate, cluster.shared_cores,
                                  flops=flops, transport=cluster.transport, strategy=c.strategy, group_size=c.group,
                                  algorithm=c.algorithm,
                                  precision=job.precision, reduce_dtype=job.reduce, prefetch=job.prefetch,
                                  prefetch_bytes=job.prefetch_bytes, min_shard_numel=job.min_shard_numel,
                                  activation_checkpointing=job.checkpointing,
                                  reshard_after_forward=job.reshard_after_forward)
    if objective == "memory":
        key = lambda c: (c.memory["peak"], -c.step["tokens_per_s"])   # noqa: E731
    else:
        key = lambda c: (-c.step["tokens_per_s"], c.memory["peak"])   # noqa: E731
    ranked = sorted(fitting, key=key) + sorted((c for c in evaluated if not c.fits), key=lambda c: c.miss)
    assumptions = [f"compute: {cluster.rate.source}",
                   "collectives: the cost model on profile " + cluster.profile.name + "; lanes share the network",
                   "communication " + ("shares the cores with computation" if cluster.shared_cores
                                       else "does not slow computation"),
                   f"memory: the engine's model (shard/planning/footprint.py) plus {cluster.headroom:.0%} headroom"]
    return StrategyPlan(job, cluster, objective, ranked, assumptions)


# strategy="auto": planned, then the engine is built.

def build_engine(model: torch.nn.Module, comm, config: Optional[EngineConfig] = None, *,
                 workload: Optional[Workload] = None, **keywords) -> tuple[Engine, Optional[StrategyPlan]]:
    """(the engine, the plan it follows): Engine(model, comm, config, ...) as it is, or, with
    strategy="auto", the engine of the strategy and group size the planner chooses for
    `workload` (Workload: sequence length, micro-batch and micro-batches per step), on this
    communicator's world, machine profile and device memory (config.auto says by which
    objective); every rank takes part. The plan is None when a strategy is named.
    `keywords`: Engine's (units=, device=, init=) and its settings (strategy=, precision=, ...)."""
    arguments = {k: keywords.pop(k) for k in ENGINE_ARGUMENTS if k in keywords}
    config = EngineConfig.given(config, keywords)
    plan = None
    if config.strategy == "auto":
        plan = plan_for(model, comm, config, workload, arguments.get("device"))
        config = replace(config, strategy=plan.chosen.strategy, group_size=plan.chosen.group)
    elif workload is not None:
        raise ValueError("workload= is for strategy='auto' (what the planner plans for)")
    return Engine(model, comm, config, **arguments), plan


def plan_for(model: torch.nn.Module, comm, config: EngineConfig, workload: Optional[Workload],
             device=None) -> StrategyPlan:
    """The plan strategy="auto" follows: for `model` (a GPT), the communicator's
    topology and machine profile, the device's memory (config.auto.memory, or what the
    device has) and a compute rate (the GPU's peak at the assumed efficiency, or measured
    on one block here); the ranks agree on the smallest memory and rate first, so all of
    them make the same plan."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, GPTConfig):
        raise PlanError("strategy='auto' plans for the GPT of shard/models/gpt.py (its memory and FLOPs are modelled); "
                        f"got a {type(model).__name__}: name a strategy instead")
    if not isinstance(workload, Workload):
        raise PlanError("strategy='auto' needs workload=Workload(seq, micro_batch, micro_batches): what each rank "
                        f"computes per step, which the choice depends on; got {workload!r}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "meta":
        raise PlanError("strategy='auto' measures the device it plans for: give the engine a real device "
                        "(device=)")
    job = Job(cfg, workload.seq, workload.micro_batch, workload.micro_batches, config.precision, config.reduce_dtype,
              config.activation_checkpointing, config.prefetch, config.prefetch_bytes, config.min_shard_numel,
              config.reshard_after_forward)
    peak, _ = peak_tflops(device, config.precision)
    memory = config.auto.memory or device_memory(device, comm.topology.ranks_per_node)
    flops = peak * 1e12 * DEFAULT_MFU if peak else measured_flops(cfg, workload, device, config.precision)
    agreed = torch.tensor([memory, flops], dtype=torch.float64, device=device)
    comm.all_reduce(agreed, op="min")
    memory, flops = int(agreed[0].item()), float(agreed[1].item())
    source = (f"{DEFAULT_MFU:.0%} of {peak} TFLOP/s" if peak
              else f"{flops / 1e9:.3g} GFLOP/s, one block's forward and backward measured on {device.type}")
    profile = comm.selector.profile
    rate = ComputeRate.on(profile, flops, source + " (the slowest rank's)")
    cluster = Cluster(comm.topology, profile, memory, rate, config.auto.headroom,
                      peak * 1e12 if peak else None, shared_cores=device.type == "cpu",
                      transport=getattr(comm.carrier, "kind", comm.backend))   # a dry run's: the one it stands for
    groups = None if config.group_size is None else [config.group_size]
    return make_plan(job, cluster, objective=config.auto.objective, groups=groups, algorithms=(config.algorithm,))


def device_memory(device: torch.device, ranks_per_node: int) -> int:
    """Bytes one rank may use: its GPU's, or on CPUs the machine's shared by its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks_per_node)


def measured_flops(cfg: GPTConfig, workload: Workload, device: torch.device, precision: str) -> float:
    """FLOP/s of one block's forward and backward at the workload's shape on `device`
    (the fastest of three runs, after one to warm up), FLOPs counted by torch."""
    import time

    from torch.utils.flop_counter import FlopCounterMode

    from shard.engine.config import PRECISIONS
    from shard.models.gpt import Block

    dtype = PRECISIONS[precision]
    block = Block(cfg).to(device, dtype)
    x = torch.randn(workload.micro_batch, workload.seq, cfg.width, device=device, dtype=dtype, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x).float().square().mean().backward()
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        block(x).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return counter.get_total_flops() / best
