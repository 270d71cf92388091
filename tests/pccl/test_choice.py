"""Communicator.choose: a call's choice decided once, and what it sends."""
import torch

from pccl.compression.codecs import codec
from pccl.core.topology import Topology
from pccl.runtime.dry_run import DryRunCommunicator
from pccl.tuning import profiles


def test_a_choice_knows_its_algorithm_and_what_each_peer_receives():
    comm = DryRunCommunicator(Topology.regular(4, 2), profiles.load("frontier"), rank=1)
    buffer = torch.empty(4096, dtype=torch.bfloat16)
    ring = comm.choose("all_gather", "ring", buffer)
    assert (ring.algorithm, ring.kind, ring.nbytes) == ("ring", "schedule", 8192)
    # a ring all-gather: 3 steps, each one block (a quarter, 2048 bytes) to the next rank
    assert dict(ring.sent()) == {2: 3 * 2048}
    plan = comm.choose("reduce_scatter", "hierarchical", buffer)
    assert plan.kind == "plan" and sum(plan.sent().values()) > 0
    auto = comm.choose("all_reduce", "auto", buffer)
    assert auto.kind in ("native", "schedule", "plan") and auto.algorithm != "auto"
    assert auto.algorithm == comm.selector.resolve("all_reduce", "auto", 8192, dtype=torch.bfloat16)
    # int8 blocks: each byte count times the codec's encoded size over the exact one
    int8 = codec("int8")
    coded = comm.choose("all_gather", "ring", torch.empty(4096), int8)
    ratio = int8.encoded_nbytes(4096, torch.float32) / (4096 * 4)
    assert dict(coded.sent()) == {2: round(3 * 4096 * ratio)}


def test_auto_runs_floating_max_and_min_on_pccls_schedules_which_keep_a_nan(monkeypatch):
    """The transport's own collective (gloo's, MPI_MAX) may drop a NaN from some ranks, and
    a plan's level may run it: for floating-point max and min auto takes the fastest flat
    schedule instead (pccl's kernels keep a NaN from either side); sums, integers, a name
    asked for and PCCL_ALGO keep their choice."""
    from pccl.algorithms import NATIVES, algorithms_for

    comm = DryRunCommunicator(Topology.regular(8, 4), profiles.load("frontier"), rank=1)
    tuner = comm.selector.tuner_for("cpu")
    sizes = [1 << k for k in range(4, 30, 2)]
    for collective in ("all_reduce", "reduce_scatter"):
        summed = [comm.selector.resolve(collective, "auto", n) for n in sizes]
        assert any(isinstance(s, str) and s in NATIVES or not isinstance(s, str) for s in summed), \
            "the profile never picks the transport's own or a plan: the test shows nothing"
        for n in sizes:
            for op in ("max", "min"):
                chosen = comm.selector.resolve(collective, "auto", n, op=op)
                assert chosen in algorithms_for(collective), (collective, n, op, chosen)
                assert chosen == tuner.fastest_schedule(collective, n)
            integer = comm.selector.resolve(collective, "auto", n, dtype=torch.int32, op="max")
            assert integer == comm.selector.resolve(collective, "auto", n, dtype=torch.int32)
        assert comm.selector.resolve(collective, "native", 64, op="max") == "native"
    monkeypatch.setenv("PCCL_ALGO", "native")   # read when a communicator is made
    forced = DryRunCommunicator(Topology.regular(8, 4), profiles.load("frontier"), rank=1)
    assert forced.selector.resolve("all_reduce", "auto", 64, op="max") == "native"


def test_a_plan_level_asked_for_mpis_nonblocking_collective_on_another_transport_is_refused_first():
    """Refused as the call resolves, before the plan's other level moves anything (a gloo
    intra level refused it only when its phase ran, after the inter all-gather had run)."""
    import pytest

    import pccl

    nonblocking = pccl.Hierarchical(intra="native_nonblocking")
    over_mpi = DryRunCommunicator(Topology.regular(4, 2), profiles.load("frontier"))
    assert over_mpi.selector.resolve("all_gather", nonblocking, 1 << 20) == nonblocking
    over_nccl = DryRunCommunicator(Topology.regular(4, 2), profiles.load("frontier"), transport="nccl")
    for collective in ("all_gather", "reduce_scatter", "all_reduce"):
        with pytest.raises(ValueError, match="its intra level runs 'native_nonblocking'.*rides 'nccl', which has none"):
            over_nccl.selector.resolve(collective, nonblocking, 1 << 20)


def test_a_call_is_resolved_anew_after_its_selector_takes_another_profile():
    """A call's resolution is cached; a profile taken since (a self-calibration, use_profile)
    may decide otherwise, and the next call must follow it."""
    topology = Topology.regular(8, 4)
    comm = DryRunCommunicator(topology, profiles.load("emulated-1gbit"))
    x = torch.empty(1024)   # 4 KB: these two profiles pick apart
    picks = {name: DryRunCommunicator(topology, profiles.load(name)).selector.resolve("all_reduce", "auto", 4096)
             for name in ("emulated-1gbit", "frontier")}
    assert picks["emulated-1gbit"] != picks["frontier"]
    for name in ("emulated-1gbit", "emulated-1gbit", "frontier"):
        if name == "frontier":
            comm.selector.use_profile(profiles.load("frontier"))
        comm.all_reduce(x)
        assert comm.carrier.calls[-1][1] == picks[name], name
