"""The end-to-end step-time predictor (shard/planning/predict.py, shard-sim) and what it stands on:
the dry-run communicator, the cost of concurrent groups, the engine's trace.

References: a step computed by hand for a 2-unit model (every collective's time from the
alpha-beta formula, the overlap from the engine's prefetch order); the engine's trace on
4 real ranks (the dry run must reproduce it event for event); the cost model's own
single-group prediction; FLOPs from the GPT's closed-form count.
"""
import json

import pytest
import torch
from torch import nn

from pccl.core.topology import Topology
from pccl.runtime.dry_run import DryRunCommunicator
from pccl.tuning import cost_model, profiles
from pccl.tuning.profiles import Link, Profile
from shard.models import GPT, GPTConfig
from shard.planning.predict import ComputeRate, Workload, replay, trace_step, unit_flops
from tests.support.mpirun import report_of

MS = 1e-3
BANDWIDTH = 8192e3   # bytes/s: a unit's 8 KiB block takes 1 ms
HAND = Profile("hand", 2, 1, Link(0.0, BANDWIDTH), Link(0.0, BANDWIDTH), reduce_bandwidth=1e18, copy_bandwidth=1e18)


class TwoUnits(nn.Module):
    """An embedding and a head of 64 x 64 each: two units, no root."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.embed, self.head = nn.Embedding(d, d), nn.Linear(d, d, bias=False)

    def forward(self, tokens, targets):   # the loss, as the models compute it (shard/models/loss.py)
        logits = self.head(self.embed(tokens))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_two_unit_step_matches_the_hand_computed_timeline():
    with torch.device("meta"):
        model = TwoUnits()
    trace, _ = trace_step(model, DryRunCommunicator(Topology.regular(2, 2), HAND), Workload(8, 1, 1),
                          strategy="zero3", algorithm="ring", prefetch=1)
    gather = ["world", "all_gather", 16384, "ring"]
    reduce = ["world", "reduce_scatter", 16384, "ring"]
    assert [(e[0], e[1:]) if e[0] != "submit" else ("submit", [[c.level, c.collective, c.nbytes, c.algorithm]
                                                               for c in trace.tasks[e[1]].calls])
            for e in trace.events] == [
        ("submit", [gather]), ("wait", (0,)), ("submit", [gather]), ("compute", ("forward", "embed")),
        ("wait", (1,)), ("compute", ("forward", "head")),
        ("submit", [gather]), ("wait", (2,)), ("submit", [gather]), ("compute", ("backward", "head")),
        ("submit", [reduce]), ("wait", (3,)), ("compute", ("backward", "embed")), ("submit", [reduce]),
        ("wait", (4,)), ("wait", (5,)), ("submit", [["world", "all_reduce", 4, "ring"]]), ("wait", (6,)),
        ("compute", ("update", None))]
    times = {"forward": 0.5 * MS, "backward": 1.0 * MS, "update": 0.2 * MS}
    result = replay(trace, lambda kind, unit: times[kind])
    # By hand, in ms: gather embed 0-1 (waited: 1); prefetch head 1-2 while embed computes
    # 1-1.5 (waited: 0.5); head 2-2.5. Backward: head gathered again 2.5-3.5 (waited: 1),
    # embed prefetched 3.5-4.5 while head computes 3.5-4.5; head's reduce-scatter 4.5-5.5;
    # embed computes 4.5-5.5 (no wait), its reduce-scatter 5.5-6.5 (waited: 1). The norm's
    # all-reduce of one float32 on 2 ranks: two ring steps of 2 bytes. AdamW 0.2.
    norm = 2 * 2 / BANDWIDTH
    assert result["step_s"] == pytest.approx(6.7 * MS + norm, rel=1e-9)
    assert result["exposed_s"] == pytest.approx(3.5 * MS + norm, rel=1e-9)
    assert result["compute_s"] == pytest.approx(3.2 * MS, rel=1e-12)
    assert result["comm_s"] == pytest.approx(6 * MS + norm, rel=1e-9)
    assert result["busy_s"] == pytest.approx({"gather": 4 * MS, "reduce": 2 * MS + norm}, rel=1e-9)


def test_on_shared_cores_computation_and_communication_take_turns():
    with torch.device("meta"):
        model = TwoUnits()
    trace, _ = trace_step(model, DryRunCommunicator(Topology.regular(2, 2), HAND), Workload(8, 1, 1),
                          strategy="zero3", algorithm="ring", prefetch=1)
    result = replay(trace, lambda kind, unit: {"forward": 0.5, "backward": 1.0, "update": 0.2}[kind] * MS,
                    shared_cores=True)
    # By hand, in ms: embed's gather 0-1 (waited); head's prefetch and embed's forward share
    # the cores from 1: the forward ends at 2, the gather at 2.5 (waited 0.5); head computes
    # 2.5-3; its backward gather 3-4 (waited); embed's prefetch and head's backward share
    # 4-6; head's reduce-scatter and embed's backward share 6-8; embed's reduce-scatter 8-9
    # (waited). Nothing overlaps: the step is all compute plus all communication.
    norm = 2 * 2 / BANDWIDTH
    assert result["step_s"] == pytest.approx(9.2 * MS + norm, rel=1e-9)
    assert result["step_s"] == pytest.approx(result["compute_s"] + result["comm_s"], rel=1e-12)
    assert result["exposed_s"] == pytest.approx(3.5 * MS + norm, rel=1e-9)


def test_without_prefetch_every_gather_waits_and_busy_lanes_share_the_network():
    with torch.device("meta"):
        model = TwoUnits()
    trace, _ = trace_step(model, DryRunCommunicator(Topology.regular(2, 2), HAND), Workload(8, 1, 1),
                          strategy="zero3", algorithm="ring", prefetch=0)
    result = replay(trace, lambda kind, unit: {"forward": 0.5, "backward": 1.0, "update": 0.2}[kind] * MS)
    # By hand, in ms: forward gathers 0-1 and 1.5-2.5, both waited for; backward: head
    # gathered 3-4 (waited), computes 4-5; from 5 its reduce-scatter and embed's gather run
    # together, each at half speed, both ending at 7 (waited: 2); embed computes 7-8, its
    # reduce-scatter 8-9 is waited for (1); the norm, AdamW 0.2.
    norm = 2 * 2 / BANDWIDTH
    assert result["exposed_s"] == pytest.approx(6 * MS + norm, rel=1e-9)
    assert result["step_s"] == pytest.approx(9.2 * MS + norm, rel=1e-9)
    assert result["comm_s"] == pytest.approx(6 * MS + norm, rel=1e-9)


def test_concurrent_groups_share_the_nic_and_one_group_is_the_plain_prediction():
    profile = Profile("p", 4, 1, Link(2e-6, 1e9), Link(5e-6, 1e9, stream_bandwidth=2e9), 1e18, 1e18)
    topology = Topology.regular(8, 4)
    n = 1 << 20
    intra = tuple(tuple(g) for g in topology.level_groups("intra"))
    cross = tuple(tuple(g) for g in topology.level_groups("inter"))
    # a ring of 4 inside each node: 3 steps of n/4 bytes
    assert cost_model.predict_groups("all_gather", "ring", topology, intra, profile, n) == pytest.approx(
        3 * (2e-6 + n / 4 / 1e9))
    # 4 rings of 2 across the nodes at once: one step of n/2 bytes each, 4 ranks on one NIC
    assert cost_model.predict_groups("all_gather", "ring", topology, cross, profile, n) == pytest.approx(
        5e-6 + 4 * (n / 2) / 1e9)
    whole = (tuple(range(8)),)
    for algorithm in ("ring", "recursive_halving", "native"):
        assert cost_model.predict_groups("reduce_scatter", algorithm, topology, whole, profile, n) == pytest.approx(
            cost_model.predict("reduce_scatter", algorithm, topology, profile, n))
    with pytest.raises(ValueError, match="equal-sized"):
        cost_model.predict_groups("all_gather", "ring", topology, ((0, 1, 2), (3, 4, 5, 6, 7)), profile, n)


def test_dry_run_communicator_checks_like_a_real_one_and_records_what_it_would_run():
    comm = DryRunCommunicator(Topology.regular(8, 4), HAND, rank=5)
    with pytest.raises(ValueError, match="output.numel"):
        comm.all_gather(torch.empty(10), torch.empty(2))
    with pytest.raises(TypeError, match="dtypes differ"):
        comm.reduce_scatter(torch.empty(2), torch.empty(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown algorithm|algorithm"):
        comm.all_reduce(torch.empty(4), algorithm="no-such-algorithm")
    comm.all_gather(torch.empty(16, device="meta"), torch.empty(2, device="meta"), algorithm="ring")
    comm.all_reduce(torch.empty(1 << 20, dtype=torch.bfloat16, device="meta"))
    (collective, algorithm, nbytes, seconds), auto = comm.carrier.calls
    assert (collective, algorithm, nbytes) == ("all_gather", "ring", 64)
    assert seconds == pytest.approx(cost_model.predict("all_gather", "ring", comm.topology, HAND, 64))
    assert auto[1] == comm.selector.tuner.choose("all_reduce", 2 << 20) and auto[2] == 2 << 20
    child = comm.split([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert (child.rank, child.size, child.topology.num_nodes) == (1, 4, 1)
    cross = comm.split([[0, 4], [1, 5], [2, 6], [3, 7]])
    assert cross.rank == 1 and cross.carrier.predict("all_gather", "ring", 1 << 20) == pytest.approx(
        cost_model.predict_groups("all_gather", "ring", comm.topology, ((0, 4), (1, 5), (2, 6), (3, 7)), HAND,
                                  1 << 20))
    with pytest.raises(ValueError, match="symmetric"):
        comm.split([[0, 1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="rank must be"):
        DryRunCommunicator(Topology.regular(4, 2), HAND, rank=4)


def test_over_nccl_the_engines_group_lanes_are_predicted_without_plans():
    """Groups of 4 over 2 nodes of 2: over MPI the group lanes run HO-Ring, over NCCL (whose
    children cannot build plan levels) NCCL's own collective, as the engine runs them."""
    from shard.planning.predict import predict_step

    profile = profiles.load("frontier")
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt_125m"))
    rate = ComputeRate.on(profile, 1e14, "assumed")
    runs = {t: predict_step(model, Topology.regular(8, 2), profile, Workload(1024, 1, 1), rate, transport=t,
                            strategy="paro-iig", group_size=4)["algorithms"] for t in ("mpi", "nccl")}
    assert "group all_gather: HORing()" in runs["mpi"]
    assert "group all_gather: native" in runs["nccl"] and not any("HORing" in a for a in runs["nccl"])


def test_unit_flops_add_up_to_the_gpt_closed_form():
    cfg = GPTConfig.preset("tiny", context=64)
    with torch.device("meta"):
        model = GPT(cfg)
    units = ["<root>", "pos", *(f"blocks.{i}" for i in range(cfg.layers)), "norm"]
    flops = unit_flops(model, units, Workload(64, 2, 1))
    forward = sum(f for f, _ in flops.values())
    # the closed form counts 2 FLOPs per multiplying weight per token forward (3x that for
    # training) and the attention's scores and values; FlopCounterMode counts the same
    # matmuls (the attention by its operator's formula)
    assert forward == pytest.approx(cfg.flops_per_token(64) * 128 / 3, rel=0.01)
    assert sum(b for _, b in flops.values()) == pytest.approx(2 * forward, rel=0.01)
    assert flops["pos"] == (0.0, 0.0) and flops["blocks.0"][0] == flops["blocks.1"][0] > 0
    assert flops["<root>"][0] == pytest.approx(2 * cfg.width * cfg.vocab * 128)   # the tied head


def test_workload_and_rate_reject_bad_values():
    with pytest.raises(ValueError, match="micro_batches"):
        Workload(128, 1, 0)
    with pytest.raises(ValueError, match="flops_per_s"):
        ComputeRate(0.0, 1e-9)


def test_shard_sim_predicts_every_row_and_compares_with_native(tmp_path, capsys):
    from shard.tools import step_sim as sim

    out = tmp_path / "sim.json"
    sim.main(["--model", "tiny", "--profile", "frontier", "--ranks", "16:32", "--seq", "64",
              "--global-batch", str(64 * 64), "--comms", "native,hierarchical", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ranks"], r["comm"], r["micro_batches"]) for r in rows] == [
        (16, "native", 4), (16, "hierarchical", 4), (32, "native", 2), (32, "hierarchical", 2)]
    for r in rows:
        assert r["step_s"] >= max(r["compute_s"], r["comm_s"] / 2) > 0
        assert r["tokens_per_s"] == pytest.approx(r["ranks"] * r["micro_batches"] * 64 / r["step_s"])
        if r["comm"] == "native":
            assert r["speedup_vs_native"] == 1.0
    assert "vs native" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="whole number of micro-batches"):
        sim.main(["--model", "tiny", "--ranks", "16", "--seq", "64", "--global-batch", "100"])


@pytest.mark.mpi
def test_dry_run_reproduces_the_engines_trace_on_real_ranks(tmp_path):
    report = report_of({}, "trace", tmp_path, 4, "-m tests.shard.workers.run_trace")
    assert "_launch" not in report, report.get("_launch")
    for rank, runs in enumerate(report["ranks"]):
        assert len(runs) == 6
        for name, run in runs.items():
            assert "exception" not in run, f"rank {rank} {name}\n{run['exception']}"
            assert run["equal"] and run["collectives"] > 10, (rank, name, run)


@pytest.mark.parametrize("settings", [dict(strategy="zero3"), dict(strategy="IIG", prefetch=2),
                                      dict(strategy="NGG", activation_checkpointing=True), dict(strategy="mics")])
def test_many_micro_batches_replay_as_the_middle_one_repeated(settings):
    """trace_many's trace of 6 micro-batches (3 traced, the middle one repeated) replays to
    the same step, exposure and busy time as a trace of all 6."""
    from shard.planning.predict import call_seconds, trace_many
    from shard.planning.skeleton import Skeleton

    cfg = GPTConfig(vocab=512, context=64, width=64, layers=3, heads=4)
    profile = profiles.load("frontier")
    micro = Workload(32, 2, 6)

    def compute(kind, unit):
        return {"forward": 1e-3, "backward": 2e-3, "update": 5e-4}[kind]

    replays = []
    for tracer in (trace_step, trace_many):
        with torch.device("meta"):
            model = Skeleton(GPT(cfg))
        trace, _ = tracer(model, DryRunCommunicator(Topology.regular(8, 4), profile), micro, units=model.units,
                          **settings)
        assert len(trace.marks) == micro.micro_batches + 1
        replays.append(replay(trace, compute, call_seconds))
    full, repeated = replays
    for key in ("step_s", "compute_s", "exposed_s", "comm_s"):
        assert repeated[key] == pytest.approx(full[key], rel=1e-12, abs=1e-15), key
    assert repeated["busy_s"] == pytest.approx(full["busy_s"], rel=1e-12)
