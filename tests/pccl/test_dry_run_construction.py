"""The dry-run communicator is made by Communicator's own set-up (Communicator._set_up), so a
field added to every communicator is one it has; and it makes no MPI or torch.distributed
call doing so (a singleton MPI world for the real communicator: no mpiexec)."""
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import pccl
from pccl import plans
from pccl.core.topology import Topology
from pccl.runtime import communicator
from pccl.runtime.communicator import Communicator
from pccl.runtime.dry_run import DEVICES, DryRunCommunicator
from pccl.tuning import profiles
from pccl.tuning.selection import PLAN_NAMES

# The objects that move a real communicator's data: read only by the collectives and the
# split that the dry run overrides.
MOVES_DATA = {"_executor", "_native"}


def dry(size=8, per_node=4, rank=0) -> DryRunCommunicator:
    return DryRunCommunicator(Topology.regular(size, per_node), profiles.load("frontier"), rank)


@pytest.fixture
def set_up_writes(monkeypatch):
    """The names each Communicator._set_up call assigns, by the class of the communicator made."""
    written: dict[str, set] = {}
    original = Communicator._set_up

    def recording(self, *args, **kwargs):
        before = set(vars(self))
        original(self, *args, **kwargs)
        written.setdefault(type(self).__name__, set()).update(set(vars(self)) - before)
    monkeypatch.setattr(Communicator, "_set_up", recording)
    return written


def test_a_dry_run_is_made_by_the_communicators_own_set_up(set_up_writes):
    comm = dry()
    child = comm.split([[0, 1, 2, 3], [4, 5, 6, 7]])
    real = pccl.Communicator(MPI.COMM_SELF, timeout=10)
    try:
        assert set_up_writes["DryRunCommunicator"] == set_up_writes["Communicator"]
        assert "tuner" in set_up_writes["Communicator"] and "_queue" in set_up_writes["Communicator"]
        for c in (comm, child):
            assert set_up_writes["Communicator"] <= set(vars(c))
    finally:
        real.close()


def test_a_dry_run_has_every_field_a_real_communicator_has():
    """Its transport's own fields too (rank, timeout, devices...), which it sets itself: a
    field added to Communicator.__init__ outside _set_up fails here until the dry run sets it
    (or it joins MOVES_DATA, read only where the dry run overrides)."""
    real = pccl.Communicator(MPI.COMM_SELF, timeout=10)
    try:
        wanted = set(vars(real)) - MOVES_DATA
        for c in (dry(), dry(rank=5).split([[0, 4], [1, 5], [2, 6], [3, 7]])):
            assert wanted <= set(vars(c)), f"{type(c).__name__} lacks {sorted(wanted - set(vars(c)))}"
    finally:
        real.close()


def test_a_dry_runs_fields_are_a_transport_that_moves_nothing_and_plans_on_every_device(monkeypatch):
    monkeypatch.setenv("PCCL_COMPRESSION", "int8")   # read when a communicator is made
    comm = dry(rank=5)
    assert (comm.rank, comm.size, comm.topology, comm.profile) == (5, 8, Topology.regular(8, 4),
                                                                   profiles.load("frontier"))
    assert comm.transport == comm.backend == comm.executor == "dry-run" and comm.timeout == float("inf")
    assert comm.group is None and comm.mpi_comm is None and comm._root is None and comm.calls == []
    assert comm.devices == comm.plan_devices == DEVICES == ("cpu", "cuda", "meta")
    assert comm.level_transports == {"intra": "dry-run", "inter": "dry-run"}
    assert comm.default_compression == "int8" and comm.label == "" and not comm.interruptible
    assert comm._plans is None and comm._compressed is None and not comm._owns_group and comm._calls == {}
    # auto weighs the plans and the transport's own collective; the flat tuner no plans
    assert comm.tuner.with_plans and comm.tuner.natives == ("native",) and comm.tuner.plans_apply
    assert set(comm.tuner.candidates("all_reduce")) >= {"native", *PLAN_NAMES} - {"three_level"}
    assert not comm._flat_tuner.with_plans and comm._flat_tuner.natives == ("native",)
    assert comm.tuner_for("meta") is comm.tuner and comm.queues_on_device("cpu") and not comm.uses_nccl()
    assert repr(comm) == f"DryRunCommunicator(rank=5, size=8, {comm.topology.describe()})"


def test_a_dry_run_makes_no_mpi_or_torch_distributed_call(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a dry run made a collective call")
    # Communicator's collective steps (detection, rank 0's profile, the level groups) and
    # torch.distributed's group calls.
    for name in ("_topology", "_agreed_profile", "_spans_world", "_plan_executor", "_world_ranks"):
        monkeypatch.setattr(Communicator, name, refused)
    for name in ("init_process_group", "new_group", "barrier", "broadcast_object_list", "get_world_size"):
        monkeypatch.setattr(dist, name, refused)
    monkeypatch.setattr(communicator, "init_torch_distributed", refused)
    comm = dry()
    child = comm.split([[0, 1, 2, 3], [4, 5, 6, 7]])
    cross = comm.split([[0, 4], [1, 5], [2, 6], [3, 7]])
    n = 1 << 20
    for c in (comm, child, cross):
        c.all_gather(torch.empty(n, device="meta"), torch.empty(n // c.size, device="meta"))
        c.reduce_scatter(torch.empty(n // c.size, device="meta"), torch.empty(n, device="meta"))
        c.all_reduce(torch.empty(n, dtype=torch.bfloat16, device="meta"))
        c.all_reduce(torch.empty(n, device="meta"), algorithm=plans.NAMED["hierarchical"])
        assert [call[0] for call in c.calls] == ["all_gather", "reduce_scatter", "all_reduce", "all_reduce"]
        assert all(seconds > 0 for *_, seconds in c.calls)
        assert c.calls[0][1] == c.resolve("all_gather", "auto", 4 * n, "meta")
        c.close()
    assert not dist.is_initialized()
