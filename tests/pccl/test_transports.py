"""Transports on one rank: which backend every sub-communicator gets (recorded by a
stand-in for dist.new_group whose "NCCL" groups are gloo groups that report NCCL), which
tensors each transport and plan accepts, and the MPI thread level. The same decisions
run on GPU clusters; only the device arithmetic differs."""
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import pccl
from pccl.runtime import transport_kinds

NAMES = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
         MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}


@pytest.fixture(scope="module")
def world():
    """torch.distributed over this one process (gloo), torn down after the module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def recorded(world, monkeypatch):
    """Every backend new_group is asked for, in order. The groups are gloo groups; those
    asked for as NCCL report "nccl", and this machine is made to look as if it had a GPU."""
    asked, reported = [], {}
    real_new_group, real_get_backend = dist.new_group, dist.get_backend

    def new_group(ranks, backend=None, **kwargs):
        asked.append(backend)
        group = real_new_group(ranks, backend="gloo", **kwargs)
        reported[group] = backend
        return group

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: reported.get(group) or real_get_backend(group))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return asked


def test_every_member_takes_part_in_a_new_groups_first_operation(recorded, monkeypatch):
    barriers = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kw: barriers.append(group) or real_barrier(group, **kw))
    child = pccl.Communicator(dist.group.WORLD, timeout=10).split([[0]])
    assert barriers == [child.group]


@pytest.mark.parametrize("backend,timeout", [("gloo", True), ("nccl", False)])
def test_nccl_waits_do_not_block_the_cpu_gloo_waits_time_out(recorded, backend, timeout):
    """NCCL's wait() orders the stream; with a timeout it would poll on the CPU until done."""
    from pccl.executors.torch_p2p import TorchP2PExecutor

    class Work:
        def wait(self, *args):
            calls.append(args)

    calls = []
    executor = TorchP2PExecutor(dist.new_group([0], backend=backend), timeout=7)
    executor._wait(lambda: [Work()], "test")
    assert calls == ([(executor.timeout,)] if timeout else [()])


def test_a_broken_transport_names_the_peers_it_waited_on(recorded):
    """gloo's errors: a timeout becomes CollectiveTimeout, a broken connection (at issue or
    while waiting) PeerLost, both naming the pending peers; a bad argument at issue stays."""
    from pccl.core.errors import CollectiveTimeout, PeerLost
    from pccl.executors.torch_p2p import TorchP2PExecutor

    class Failing:
        def __init__(self, text):
            self.text = text

        def wait(self, *args):
            raise RuntimeError(self.text)

    group = dist.new_group([0], backend="gloo")
    pending = [(0, False), (0, True)]

    def executor():
        return TorchP2PExecutor(group, timeout=7)
    broken = executor()
    with pytest.raises(PeerLost, match=r"step 3: the transport failed waiting to receive from 0; send to 0 .*"
                                       r"Connection closed by peer"):
        broken._wait(lambda: [Failing("Connection closed by peer [127.0.0.1]:99")], "step 3", pending)
    # broken from then on: the next call says so, not the transport's own error for a closed pair
    with pytest.raises(RuntimeError, match="an earlier collective on this communicator timed out or failed"):
        broken._wait(lambda: [], "step 4", pending)
    with pytest.raises(CollectiveTimeout, match=r"step 3 timed out after 7 s waiting to receive from 0") as e:
        executor()._wait(lambda: [Failing("Timed out waiting 7000ms for recv operation")], "step 3", pending)
    assert not isinstance(e.value, PeerLost)

    def refused():
        raise RuntimeError("Connection reset by peer")
    with pytest.raises(PeerLost, match="Connection reset by peer"):
        executor()._wait(refused, "step 0", pending)

    def bad_argument():
        raise RuntimeError("tensors must be contiguous")
    usable = executor()
    with pytest.raises(RuntimeError, match="^tensors must be contiguous$"):
        usable._wait(bad_argument, "step 0", pending)
    usable._wait(lambda: [], "step 1", pending)   # a bad argument breaks nothing


def test_children_of_a_gloo_communicator_are_gloo(recorded):
    parent = pccl.Communicator(dist.group.WORLD, timeout=10)
    child = parent.split([[0]])
    grandchild = child.split([[0]])
    assert recorded == ["gloo", "gloo"]
    assert (parent.backend, child.backend, grandchild.backend) == ("gloo", "gloo", "gloo")
    assert child.devices == ("cpu",)


def test_children_and_plan_levels_of_an_nccl_communicator_are_nccl(recorded):
    parent = pccl.Communicator(dist.new_group([0], backend="nccl"), timeout=10)
    assert parent.backend == "nccl" and parent.devices == ("cuda",)
    assert parent.level_transports == {"intra": "nccl", "inter": "nccl"}
    child = parent.split([[0]])
    levels = parent._plan_executor().levels
    assert recorded == ["nccl", "nccl", "nccl", "nccl"]   # the parent, its child, both plan levels
    assert child.backend == "nccl" and child.level_transports == {"intra": "nccl", "inter": "nccl"}
    assert {level: c.backend for level, c in levels.items()} == {"intra": "nccl", "inter": "nccl"}


def test_an_nccl_communicator_refuses_host_tensors_before_sending(recorded):
    comm = pccl.Communicator(dist.new_group([0], backend="nccl"), timeout=10)
    with pytest.raises(ValueError, match=r"device cpu.*supports \('cuda',\)"):
        comm.all_reduce(torch.ones(4))


def test_the_papers_design_nccl_inside_mpi_across(recorded):
    comm = pccl.Communicator(MPI.COMM_SELF, intra="nccl", inter="mpi", timeout=10)
    assert comm.level_transports == {"intra": "nccl", "inter": "mpi"}
    levels = comm._plan_executor().levels
    assert (levels["intra"].backend, levels["inter"].backend) == ("nccl", "mpi")
    child = comm.split([[0]])
    assert child.transport == "mpi" and child.level_transports == {"intra": "nccl", "inter": "mpi"}
    # Without a GPU build of the native module the MPI level carries host tensors only, so
    # no device suits both levels: a plan is refused before sending, auto runs flat.
    assert comm.selector.plan_devices == ()
    with pytest.raises(ValueError, match="intra='nccl', inter='mpi' takes"):
        comm.all_gather(torch.empty(4), torch.ones(4), algorithm="hierarchical")
    x = torch.arange(4.0)
    comm.all_reduce(x, algorithm="auto")
    assert torch.equal(x, torch.arange(4.0))


def test_a_torch_child_of_an_mpi_communicator_runs_its_mpi_level_on_its_own_backend(recorded):
    comm = pccl.Communicator(MPI.COMM_SELF, intra="nccl", inter="mpi", timeout=10)
    child = comm.split([[0]], transport="gloo")
    assert recorded[-1] == "gloo" and child.level_transports == {"intra": "nccl", "inter": "gloo"}


def test_nccl_needs_a_gpu_and_says_so(world):
    assert not torch.cuda.is_available()   # this test describes a machine without a GPU
    with pytest.raises(ValueError, match="needs a GPU"):
        pccl.init(transport="nccl")
    with pytest.raises(ValueError, match="needs a GPU"):
        pccl.Communicator(MPI.COMM_SELF, intra="nccl", timeout=10)
    with pytest.raises(ValueError, match="needs a GPU"):
        pccl.Communicator(MPI.COMM_SELF, timeout=10).split([[0]], transport="nccl")


def test_unknown_transports_are_refused(world):
    with pytest.raises(ValueError, match=r"transport must be one of \('mpi', 'gloo', 'nccl'\), got 'ucc'"):
        pccl.init(transport="ucc")
    with pytest.raises(ValueError, match="intra must be one of"):
        pccl.Communicator(MPI.COMM_SELF, intra="ucc", timeout=10)
    with pytest.raises(ValueError, match="got 'ucc'"):
        pccl.Communicator(MPI.COMM_SELF, timeout=10).split([[0]], transport="ucc")


@pytest.mark.parametrize("transport,gpu_mpi,devices", [
    ("mpi", False, ("cpu",)), ("mpi", True, ("cpu", "cuda")), ("gloo", False, ("cpu",)),
    ("nccl", False, ("cuda",)), ("cpu:gloo,cuda:nccl", False, ("cpu", "cuda")),
])
def test_devices_of_each_transport(transport, gpu_mpi, devices):
    assert transport_kinds.devices_of(transport, gpu_mpi) == devices


def test_plan_devices_are_what_both_levels_carry():
    with pytest.raises(ValueError, match=r"intra='gloo', inter='nccl' takes \(\) tensors, got a cuda tensor"):
        transport_kinds.check_level_devices("cuda", {"intra": "gloo", "inter": "nccl"}, ())
    transport_kinds.check_level_devices("cuda", {"intra": "nccl", "inter": "mpi"}, ("cuda",))


@pytest.mark.parametrize("provided", [MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED, MPI.THREAD_SERIALIZED])
def test_less_than_thread_multiple_is_refused_naming_the_setting(provided):
    with pytest.raises(RuntimeError, match=f"needs MPI_THREAD_MULTIPLE.*provides {NAMES[provided]}"
                                           ".*MPICH_MAX_THREAD_SAFETY=multiple"):
        transport_kinds.check_thread_level(provided, NAMES)
    transport_kinds.check_thread_level(MPI.THREAD_MULTIPLE, NAMES)


def test_this_mpi_runs_at_thread_multiple():
    pccl.init(timeout=10)
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


def test_gpu_aware_mpi_is_the_setting_else_the_librarys_answer_else_crays_switch():
    from pccl.executors.mpi_cpp import gpu_aware_mpi

    def says(answer):
        return lambda platform: answer

    assert gpu_aware_mpi({"PCCL_GPU_AWARE_MPI": "1"}, says(0)) is True
    assert gpu_aware_mpi({"PCCL_GPU_AWARE_MPI": "0", "MPICH_GPU_SUPPORT_ENABLED": "1"}, says(1)) is False
    assert gpu_aware_mpi({}, says(1)) is True
    assert gpu_aware_mpi({"MPICH_GPU_SUPPORT_ENABLED": "1"}, says(0)) is False   # the library knows better
    assert gpu_aware_mpi({"MPICH_GPU_SUPPORT_ENABLED": "1"}, says(-1)) is True   # no query: Cray's switch
    assert gpu_aware_mpi({}, says(-1)) is False
    with pytest.raises(ValueError, match="PCCL_GPU_AWARE_MPI must be 0 or 1, got 'yes'"):
        gpu_aware_mpi({"PCCL_GPU_AWARE_MPI": "yes"}, says(1))


def test_this_mpi_answers_the_gpu_query():
    """MPICH >= 4 and Open MPI with its extension answer; the MPI wheel here has no GPU build."""
    from pccl import _native
    assert _native.mpi_gpu_support("cuda") in (0, -1) and _native.mpi_gpu_support("hip") in (0, -1)
    with pytest.raises(ValueError, match="platform must be 'cuda' or 'hip'"):
        _native.mpi_gpu_support("xpu")


def test_only_nccl_all_the_way_down_queues_on_the_device(recorded):
    nccl = pccl.Communicator(dist.new_group([0], backend="nccl"), timeout=10)
    gloo = pccl.Communicator(dist.group.WORLD, timeout=10)
    mixed = pccl.Communicator(MPI.COMM_SELF, intra="nccl", inter="mpi", timeout=10)
    assert nccl.queues_on_device("cuda") and not nccl.queues_on_device("cpu")
    assert not gloo.queues_on_device("cuda") and not gloo.uses_nccl()
    assert not mixed.queues_on_device("cuda") and mixed.uses_nccl()   # its MPI level blocks the CPU


def test_close_destroys_the_groups_a_communicator_made_and_only_those(recorded, monkeypatch):
    destroyed = []
    monkeypatch.setattr(dist, "destroy_process_group", destroyed.append)
    parent = pccl.Communicator(dist.new_group([0], backend="nccl"), timeout=10)
    child = parent.split([[0]])
    levels = parent._plan_executor().levels
    parent.close()
    assert destroyed == [levels["intra"].group, levels["inter"].group]   # not the caller's own group
    child.close()
    child.close()   # twice is harmless
    assert destroyed[2:] == [child.group]


def test_closing_frees_the_mpi_communicators_a_communicator_made():
    """An MPI library holds a few thousand communicators (MPICH 2,048 context ids): each
    made and closed communicator, its Python executor and an MPI sub-communicator kept
    their duplicates, and a process that made some hundreds ran out (MPICH: "Cannot
    allocate context ID"). 1,000 turns here made 5,000 before."""
    for _ in range(1000):
        comm = pccl.Communicator(MPI.COMM_WORLD, executor="python", timeout=10)
        child = comm.split([[0]], "mpi")
        executors = (comm.carrier.runner, child.carrier.runner)
        t = torch.ones(3)
        child.all_reduce(t, algorithm="ring")
        child.close()
        comm.close()
        assert all(e.comm == MPI.COMM_NULL for e in executors) and comm.mpi_comm == MPI.COMM_NULL
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_async_nccl_calls_are_issued_on_the_calling_thread(recorded, monkeypatch):
    """NCCL only enqueues: an async call runs at once on the caller's thread (one launch
    order on every rank) and hands back a stream handle, not a worker thread's future."""
    import threading

    from pccl.runtime import communicator

    comm = pccl.Communicator(dist.new_group([0], backend="nccl"), timeout=10)
    threads, handles = [], []
    monkeypatch.setattr(communicator, "StreamWork", lambda: handles.append("stream") or "stream")
    monkeypatch.setattr(comm.carrier.native, "native_all_reduce", lambda t, op: threads.append(threading.get_ident()))
    cuda_like = torch.ones(4)
    monkeypatch.setattr(comm, "queues_on_device", lambda device: True)
    monkeypatch.setattr(communicator.validation, "check_tensor", lambda *args: None)
    assert comm.all_reduce(cuda_like, algorithm="native", async_op=True) == "stream"
    assert threads == [threading.get_ident()]


def test_a_default_group_on_another_backend_is_refused_not_taken(world):
    """pccl.init(transport=...) and pccl.distributed.init_process_group() run over
    torch.distributed's default group: one already made on another backend (gloo here) was
    taken silently, and a pccl-backend call then ran gloo's collectives, whose max keeps
    neither a NaN nor pccl's signed zeros. Its own backend is still taken."""
    import pccl.distributed

    with pytest.raises(ValueError, match="default group is already on backend 'gloo', and this asks for 'pccl'"):
        pccl.distributed.init_process_group()
    pccl.init(transport="gloo", timeout=10).close()
