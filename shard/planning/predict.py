"""The engine's step time at any scale, predicted from the engine itself.

1. Trace: the engine trains one step of the real model on the meta device (no memory, no
   values) over a dry-run communicator of the target world (pccl/runtime/dry_run.py), so
   its actual sequence of collectives (sizes, levels, algorithms as its tuner resolves
   them), its lane tasks, its prefetches and the points where it waits are recorded
   (shard/engine/trace.py). A first step runs untraced, as in training: backward prefetch follows
   the order the previous backward took.
2. Cost: each collective's time from the cost model on the machine profile (every group of
   a split running at once, sharing the nodes' NICs); each unit's forward and backward time
   from its FLOPs, counted by torch's FlopCounterMode on the meta device, over a compute
   rate (peak x an assumed compute efficiency, or a rate measured on this machine); the
   optimizer's time from its elements (a measured or a bandwidth-bound cost per element).
3. Replay: the loop runs its computations one after another; a task starts when submitted
   or when its lane is free, and needs its collectives' time of network; lanes busy at
   the same time share the network evenly; a wait stalls the loop until the task is done
   (exposed communication). The step ends when the loop and both lanes are done.

Assumed, and said where results are printed: communication does not slow computation (on
GPUs it does a little), unless `shared_cores` says the two share one resource (CPU ranks,
whose cores both compute and drive MPI's progress); compute runs at one rate for every unit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pccl import DryRunCommunicator, Topology
from pccl.tuning.profiles import Profile
from shard.engine.trace import StepTrace, TracedCall
from shard.models.loss import next_token_loss

ROOT = "<root>"


@dataclass(frozen=True)
class Workload:
    """What one rank computes per step."""

    seq: int               # tokens per sequence
    micro_batch: int       # sequences per micro-batch
    micro_batches: int     # micro-batches per step (gradient accumulation)

    def __post_init__(self) -> None:
        for name in ("seq", "micro_batch", "micro_batches"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def tokens(self) -> int:
        """Tokens per rank and step."""
        return self.seq * self.micro_batch * self.micro_batches


def unit_flops(model: torch.nn.Module, units: list[str], micro: Workload) -> dict[str, tuple[float, float]]:
    """{unit: (forward FLOPs, backward FLOPs)} of one micro-batch of `model` (on the meta
    device), counted by torch's FlopCounterMode; the root unit gets what no other unit's
    module counts (the head of a tied model). The forward is counted without gradients:
    the fused loss (shard/models/loss.py) makes the head's gradient products in its forward
    pass when a backward follows, and those count as backward here."""
    from torch.utils.flop_counter import FlopCounterMode

    tokens = torch.zeros(micro.micro_batch, micro.seq + 1, dtype=torch.long, device="meta")
    prefix = type(model).__name__

    def counted(with_backward: bool) -> dict[str, float]:
        with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(with_backward):
            loss = next_token_loss(model, tokens)
            if with_backward:
                loss.backward()
        counts = counter.get_flop_counts()
        out = {u: float(sum(counts.get(f"{prefix}.{u}", {}).values())) for u in units if u != ROOT}
        out[ROOT] = float(sum(counts.get("Global", {}).values())) - sum(out.values())
        return out

    forward, both = counted(False), counted(True)
    for p in model.parameters():
        p.grad = None
    return {u: (forward[u], both[u] - forward[u]) for u in forward}


def trace_step(model: torch.nn.Module, comm, micro: Workload, **settings) -> tuple[StepTrace, object]:
    """(the trace of one step, the engine) of `model` over `comm`: a dry-run communicator
    with a model on the meta device (nothing is computed or sent), or a real one (the
    trace the dry run must reproduce); `settings` as Engine's keywords (strategy=, ...)."""
    from shard.engine.engine import Engine
    from shard.engine.optimizer import ShardedAdamW

    device = next(model.parameters()).device
    meta = {"device": "meta", "init": lambda name, tensor: None} if device.type == "meta" else {}
    engine = Engine(model, comm, **meta, **settings)
    optimizer = ShardedAdamW(engine)
    tokens = torch.zeros(micro.micro_batch, micro.seq + 1, dtype=torch.long, device=device)

    def step(trace: Optional[StepTrace] = None) -> None:
        for _ in range(micro.micro_batches):
            if trace is not None:
                trace.micro_batch()
            engine.backward(next_token_loss(engine, tokens))
        if trace is not None:
            trace.micro_batch()   # the step's own part begins
        optimizer.step()

    try:
        step()   # the backward order prefetch follows is learned here
        with engine.traced() as trace:
            step(trace)
    finally:
        engine.close()
    return trace, engine


def trace_many(model: torch.nn.Module, comm, micro: Workload, **settings) -> tuple[StepTrace, object]:
    """trace_step's result for any number of micro-batches, from a trace of at most three:
    every micro-batch after the first makes the engine do the same, so the middle one is
    repeated (StepTrace.repeated; tests/shard/test_predict.py holds the replay of the two
    equal)."""
    if micro.micro_batches <= 3:
        return trace_step(model, comm, micro, **settings)
    trace, engine = trace_step(model, comm, Workload(micro.seq, micro.micro_batch, 3), **settings)
    return trace.repeated(1, micro.micro_batches - 2), engine


def call_seconds(call: TracedCall) -> float:
    """The dry-run transport's prediction (it remembers them, by value)."""
    return call.comm.carrier.predict(call.collective, call.algorithm, call.nbytes, call.dtype)


def replay(trace: StepTrace, compute_seconds: Callable[[str, Optional[str]], float],
           seconds: Callable[[TracedCall], float] = call_seconds, shared_cores: bool = False) -> dict:
    """The step's time with the engine's overlap: {"step_s", "compute_s", "exposed_s",
    "comm_s" (every collective's time, back to back), "busy_s" per lane}.

    Each lane runs its tasks in order; lanes busy at the same time share the network
    evenly (k busy lanes each progress at 1/k of their own speed), as the engine's two
    lanes share a node's links. A collective the loop issues itself is a task it waits for.
    shared_cores: computation shares that one resource with communication, as on CPU ranks,
    whose cores both compute and drive MPI's progress (on GPUs, NICs and copy engines move
    data while the SMs compute: False)."""
    lanes = _Lanes()
    clock = compute = exposed = comm = 0.0
    busy: dict[str, float] = {}
    for index, event in enumerate(trace.events):
        kind = event[0]
        if kind == "compute":
            t = compute_seconds(event[1], event[2])
            compute += t
            if not shared_cores:
                clock = lanes.run(clock, clock + t)
                continue
            lanes.submit("compute", ("compute", index), t)
            clock = lanes.run(clock, float("inf"), until=("compute", index))
            continue
        if kind == "wait":
            task = event[1]
        else:
            task, lane = (event[1], trace.tasks[event[1]].lane) if kind == "submit" else (("loop", index), "loop")
            length = sum(seconds(c) for c in trace.tasks[event[1]].calls) if kind == "submit" else seconds(event[1])
            busy[lane], comm = busy.get(lane, 0.0) + length, comm + length
            lanes.submit(lane, task, length)
            if kind == "submit":
                continue
        end = lanes.run(clock, float("inf"), until=task)
        exposed, clock = exposed + end - clock, end
    end = lanes.run(clock, float("inf"))
    busy.pop("loop", None)
    return {"step_s": end, "compute_s": compute, "exposed_s": exposed, "comm_s": comm, "busy_s": busy}


class _Lanes:
    """Queues of (task, seconds of work left), the heads of all queues progressing at once
    at an even share of the network (processor sharing)."""

    EPS = 1e-15

    def __init__(self) -> None:
        self.queues: dict[str, list] = {}
        self.done: set = set()

    def submit(self, lane: str, task, seconds: float) -> None:
        self.queues.setdefault(lane, []).append([task, seconds])
        self._retire()

    def _retire(self) -> None:
        for queue in self.queues.values():
            while queue and queue[0][1] <= self.EPS:
                self.done.add(queue.pop(0)[0])

    def run(self, now: float, to: float, until=None) -> float:
        """Progress from `now` to `to`, or until `until` is done, or (to = inf) until every
        queue is empty; returns the time reached."""
        while until is None or until not in self.done:
            heads = [q[0] for q in self.queues.values() if q]
            if not heads:
                return now if to == float("inf") else to
            share = len(heads)
            step = min(h[1] for h in heads) * share   # until the first head finishes
            if now + step >= to:
                for h in heads:
                    h[1] -= (to - now) / share
                self._retire()
                return to
            now += step
            for h in heads:
                h[1] -= step / share
            self._retire()
        return now


@dataclass(frozen=True)
class ComputeRate:
    """How fast one rank computes: FLOP/s for forward and backward, seconds per optimizer
    element for the update."""

    flops_per_s: float
    update_s_per_element: float
    source: str = ""

    def __post_init__(self) -> None:
        if not self.flops_per_s > 0 or not self.update_s_per_element >= 0:
            raise ValueError(f"a compute rate needs flops_per_s > 0 and update_s_per_element >= 0, got {self}")

    @classmethod
    def on(cls, profile: Profile, flops_per_s: float, source: str) -> "ComputeRate":
        """`flops_per_s` for forward and backward, and AdamW's update at 32 bytes per element
        of the profile's copy bandwidth (the predictor's one assumption for the update)."""
        return cls(flops_per_s, 32 / profile.copy_bandwidth,
                   f"{source}; AdamW at 32 bytes per element of copy bandwidth")


def predict_step(model: torch.nn.Module, topology: Topology, profile: Profile, micro: Workload,
                 rate: ComputeRate, shared_cores: bool = False, flops: Optional[dict] = None, transport: str = "mpi",
                 **settings) -> dict:
    """The predicted step of `model` (meta device) on `topology`: replay() of its trace
    (shared_cores as there), plus tokens/s over all ranks, the collectives the step ran,
    and the model-state bytes. The trace is taken of the model's skeleton (shard/planning/skeleton.py:
    the same trace, without the model's computation); `flops`: unit_flops of the model for
    `micro`, where the caller has them already; `transport`: the ranks' (over gloo or NCCL
    the engine's group lanes run no plans: DryRunCommunicator)."""
    from shard.engine.units import split_units
    from shard.planning.skeleton import Skeleton

    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("predict_step needs a model built on the meta device (with torch.device('meta'))")
    if flops is None:
        flops = unit_flops(model, [u.name for u in split_units(model, settings.get("units"))], micro)
    skeleton = Skeleton(model, settings.pop("units", None))
    # interruptible, as shard-train's communicators are: over MPI their own collective is the
    # nonblocking one, calibrated apart from the blocking one
    comm = DryRunCommunicator(topology, profile, transport=transport, interruptible=True)
    trace, engine = trace_many(skeleton, comm, micro, units=skeleton.units, **settings)
    update = rate.update_s_per_element * engine.master.numel()

    def compute_seconds(kind: str, unit: Optional[str]) -> float:
        if kind == "update":
            return update
        return flops[unit][0 if kind == "forward" else 1] / rate.flops_per_s

    out = replay(trace, compute_seconds, shared_cores=shared_cores)
    out["tokens_per_s"] = topology.size * micro.tokens / out["step_s"]
    out["collectives"] = len(trace.calls())
    out["algorithms"] = sorted({f"{c.level} {c.collective}: {c.algorithm}" for c in trace.calls()})
    out["memory"] = {k: engine.memory_report()[k] for k in ("parameters", "gradients", "optimizer")}
    return out
