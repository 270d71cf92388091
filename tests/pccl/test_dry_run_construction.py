"""The dry-run communicator is made by Communicator's own constructor over a transport that
moves nothing (RecordingTransport), so a field added to every communicator is one it has;
and it makes no MPI or torch.distributed call doing so (a singleton MPI world for the real
communicator: no mpiexec)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import pccl
from pccl import plans
from pccl.algorithms import NATIVES
from pccl.core.topology import Topology
from pccl.runtime import transport
from pccl.runtime.communicator import Communicator
from pccl.runtime.dry_run import DEVICES, DryRunCommunicator, RecordingTransport
from pccl.runtime.transport import Transport
from pccl.tuning import profiles
from pccl.tuning.selection import PLAN_NAMES


def dry(size=8, per_node=4, rank=0) -> DryRunCommunicator:
    return DryRunCommunicator(Topology.regular(size, per_node), profiles.load("frontier"), rank)


@pytest.fixture
def constructed(monkeypatch):
    """The transports each Communicator.__init__ call was given, by the class of the communicator made."""
    made: dict[str, list] = {}
    original = Communicator.__init__

    def recording(self, comm, *args, **kwargs):
        original(self, comm, *args, **kwargs)
        made.setdefault(type(self).__name__, []).append(type(self.carrier).__name__)
    monkeypatch.setattr(Communicator, "__init__", recording)
    return made


def test_a_dry_run_is_made_by_the_communicators_own_constructor(constructed):
    comm = dry()
    child = comm.split([[0, 1, 2, 3], [4, 5, 6, 7]])
    real = pccl.Communicator(MPI.COMM_SELF, timeout=10)
    try:
        assert constructed == {"DryRunCommunicator": ["RecordingTransport"],
                               "Communicator": ["RecordingTransport", "Transport"]}
        assert type(child) is Communicator and isinstance(child.carrier, RecordingTransport)
        assert isinstance(real.carrier, Transport)
    finally:
        real.close()


def test_a_dry_run_has_every_field_a_real_communicator_has():
    """Every field a real communicator has, and every field of its selector; and its
    transport every field a real transport's has but the executors that move data."""
    real = pccl.Communicator(MPI.COMM_SELF, timeout=10)
    try:
        for c in (dry(), dry(rank=5).split([[0, 4], [1, 5], [2, 6], [3, 7]])):
            assert set(vars(real)) == set(vars(c)), f"{type(c).__name__}: {set(vars(real)) ^ set(vars(c))}"
            assert set(vars(real.selector)) == set(vars(c.selector))
            public = {k for k in vars(real.carrier) if not k.startswith("_")} - {"runner", "native", "gpu_mpi",
                                                                                   "owns_group"}
            assert public <= set(vars(c.carrier)), sorted(public - set(vars(c.carrier)))
    finally:
        real.close()


def test_a_dry_runs_fields_are_a_transport_that_moves_nothing_and_plans_on_every_device(monkeypatch):
    monkeypatch.setenv("PCCL_COMPRESSION", "int8")   # read when a communicator is made
    comm = dry(rank=5)
    assert (comm.rank, comm.size, comm.topology, comm.selector.profile) == (
        5, 8, Topology.regular(8, 4), profiles.load("frontier"))
    assert comm.transport == comm.backend == comm.executor == "dry-run" and comm.timeout == float("inf")
    assert comm.group is None and comm.mpi_comm is None and comm.carrier.root is None and comm.carrier.calls == []
    assert comm.devices == comm.selector.plan_devices == DEVICES == ("cpu", "cuda", "meta")
    assert comm.level_transports == {"intra": "dry-run", "inter": "dry-run"}
    assert comm.default_compression == "int8" and comm.label == "" and not comm.interruptible
    assert comm._plans is None and comm._calls == {}
    # auto weighs the plans and the transport's own collective; the flat tuner no plans
    tuner, flat = comm.selector.tuner, comm.selector._flat_tuner
    # (standing for MPI: both its forms of its own collective, as a real MPI communicator's)
    assert tuner.with_plans and tuner.natives == NATIVES and tuner.plans_apply
    assert set(tuner.candidates("all_reduce")) >= {"native", *PLAN_NAMES} - {"three_level"}
    assert not flat.with_plans and flat.natives == NATIVES
    assert comm.selector.tuner_for("meta") is tuner and comm.queues_on_device("cpu") and not comm.uses_nccl()
    assert repr(comm) == f"DryRunCommunicator(rank=5, size=8, {comm.topology.describe()})"


def test_a_dry_run_makes_no_mpi_or_torch_distributed_call(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a dry run made a collective call")
    # Communicator's collective steps (detection, rank 0's profile, the level groups) and
    # torch.distributed's group calls.
    for name in ("topology", "agreed_profile", "spans_world", "world_ranks", "split"):
        monkeypatch.setattr(Transport, name, refused)
    monkeypatch.setattr(Communicator, "_plan_executor", refused)
    for name in ("init_process_group", "new_group", "barrier", "broadcast_object_list", "get_world_size"):
        monkeypatch.setattr(dist, name, refused)
    monkeypatch.setattr(transport, "init_torch_distributed", refused)
    comm = dry()
    child = comm.split([[0, 1, 2, 3], [4, 5, 6, 7]])
    cross = comm.split([[0, 4], [1, 5], [2, 6], [3, 7]])
    n = 1 << 20
    for c in (comm, child, cross):
        c.all_gather(torch.empty(n, device="meta"), torch.empty(n // c.size, device="meta"))
        c.reduce_scatter(torch.empty(n // c.size, device="meta"), torch.empty(n, device="meta"))
        c.all_reduce(torch.empty(n, dtype=torch.bfloat16, device="meta"))
        c.all_reduce(torch.empty(n, device="meta"), algorithm=plans.NAMED["hierarchical"])
        calls = c.carrier.calls
        assert [call[0] for call in calls] == ["all_gather", "reduce_scatter", "all_reduce", "all_reduce"]
        assert all(seconds > 0 for *_, seconds in calls)
        assert calls[0][1] == c.selector.resolve("all_gather", "auto", 4 * n, "meta")
        c.close()
    assert not dist.is_initialized()


def test_a_dry_run_resolves_and_predicts_as_the_mpi_communicator_it_stands_for():
    """It decided by its own transport's name ("dry-run"): over MPI its own collective was
    always the blocking one, where shard-train's interruptible communicators run MPI's
    nonblocking one (calibrated apart), and native_nonblocking asked for by name was
    refused. And it predicted every call with fp32's calibration ratios."""
    topology = Topology.regular(16, 8)
    # all-reduce's ring measured as predicted in fp32, 3x slower in 16-bit types
    profile = dataclasses.replace(profiles.load("frontier"), calibration=tuple(
        ("all_reduce", klass, "ring", ((1 << 10, ratio), (1 << 30, ratio))) for klass, ratio in (("full", 1.0),
                                                                                              ("half", 3.0))))
    comm = DryRunCommunicator(topology, profile, interruptible=True)
    assert comm.selector.own_native == "native_nonblocking" and comm.selector.tuner.natives == ("native_nonblocking",)
    comm.all_reduce(torch.empty(1 << 20, device="meta"), algorithm="native_nonblocking")
    for dtype in (torch.float32, torch.bfloat16):
        comm.all_reduce(torch.empty(1 << 22 // dtype.itemsize, dtype=dtype, device="meta"), algorithm="ring")
    (_, mine, _, _), (_, _, _, fp32), (_, _, _, bf16) = comm.carrier.calls
    assert mine == "native_nonblocking"
    assert 2.9 < bf16 / fp32 < 3.1   # (the same bytes: twice the values to reduce, a small part)


def test_over_torch_distributed_a_dry_runs_children_weigh_no_plans_as_a_real_ones():
    """A gloo or NCCL communicator's children cannot build plan levels (torch.distributed
    groups are made from the world), so their auto runs flat schedules: the engine's group
    and inter-group lanes do. The dry run weighed the plans there and predicted HO-Ring
    where NCCL ran recursive doubling."""
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for kind, children_plan in (("mpi", True), ("gloo", False), ("nccl", False)):
        comm = DryRunCommunicator(Topology.regular(8, 2), profiles.load("frontier"), transport=kind)
        child = comm.split(groups)
        assert comm.selector.plans_buildable and child.selector.plans_buildable == children_plan, kind
        assert child.selector.tuner.with_plans == children_plan
        if not children_plan:   # a plan named there is refused as it is called (it failed at an async wait())
            with pytest.raises(ValueError, match="cannot run here: plan levels over .* are torch.distributed groups"):
                child.all_reduce(torch.empty(1024, device="meta"), algorithm="hierarchical", async_op=True)
    with pytest.raises(ValueError):
        DryRunCommunicator(Topology.regular(8, 2), profiles.load("frontier"), transport="carrier-pigeon")
