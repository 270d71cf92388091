"""The tracing stand-in (shard/planning/skeleton.py) makes the engine do exactly what the real model
makes it do: the same events, tasks and collectives, in the same order, and its units run
forward (and again, recomputed under activation checkpointing) as the model's do."""
import pytest
import torch

from pccl.core.topology import Topology
from pccl.runtime.dry_run import DryRunCommunicator
from pccl.tuning import profiles
from shard.engine.units import split_units
from shard.models.gpt import GPT, GPTConfig
from shard.planning.predict import Workload, trace_step
from shard.planning.skeleton import Skeleton


def events(trace) -> list:
    return [("submit", e[1], trace.tasks[e[1]].lane, tuple(trace.tasks[e[1]].calls)) if e[0] == "submit" else e
            for e in trace.events]


def counted(forward, name: str, ran: list):
    def run(*args, **kwargs):
        ran.append(name)
        return forward(*args, **kwargs)
    return run


@pytest.mark.parametrize("model,settings,micro_batches", [
    (dict(), dict(strategy="zero3"), 1),
    (dict(tied=False), dict(strategy="IIG", prefetch=2), 2),
    (dict(tied=False, positions="rotary"), dict(strategy="NGG", activation_checkpointing=True), 2),
    (dict(), dict(strategy="IGG", activation_checkpointing=True, precision="bf16"), 1),
    (dict(), dict(strategy="ddp", min_shard_numel=1 << 16), 1),
])
def test_the_skeleton_traces_what_the_model_does(model, settings, micro_batches):
    cfg = GPTConfig(vocab=512, context=64, width=64, layers=3, heads=4, **model)
    micro = Workload(32, 2, micro_batches)
    traced, runs = [], []
    for stand_in in (False, True):
        with torch.device("meta"):
            m = GPT(cfg)
        extra = {}
        if stand_in:
            m = Skeleton(m)
            extra["units"] = m.units
        ran: list[str] = []   # each unit's forwards, recomputations under activation checkpointing too
        for u in split_units(m, extra.get("units")):
            if u.name != "<root>":   # (the engine wraps what it finds, so a recomputation is counted too)
                u.module.forward = counted(u.module.forward, u.name, ran)
        comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("frontier"))
        trace, _ = trace_step(m, comm, micro, **settings, **extra)
        traced.append(events(trace))
        runs.append(ran)
    assert traced[0] == traced[1]
    assert any(e[0] == "submit" and e[3] for e in traced[0])   # collectives were traced
    assert runs[0] == runs[1]
