"""Argument validation and single-rank behaviour (no mpiexec: a singleton MPI world)."""
import pytest
import torch
from mpi4py import MPI

import pccl


@pytest.fixture(scope="module")
def comm():
    return pccl.Communicator(MPI.COMM_SELF, timeout=10)


@pytest.mark.parametrize("call,error,words", [
    (lambda c: c.all_gather(torch.empty(5), torch.ones(4)), ValueError, ["output.numel()", "4", "5"]),
    (lambda c: c.reduce_scatter(torch.empty(3), torch.ones(4)), ValueError, ["input.numel()", "3", "4"]),
    (lambda c: c.all_gather(torch.empty(4), torch.ones(4, dtype=torch.float64)), TypeError,
     ["dtypes differ", "float32", "float64"]),
    (lambda c: c.all_gather(torch.empty(8)[::2], torch.ones(4)), ValueError, ["output", "contiguous"]),
    (lambda c: c.all_reduce(torch.ones(4), op="prod"), ValueError, ["op", "prod", "sum"]),
    (lambda c: c.all_reduce(torch.ones(4, dtype=torch.int64), op="avg"), ValueError, ["avg", "int64"]),
    (lambda c: c.all_reduce(torch.ones(4, dtype=torch.complex64)), TypeError, ["tensor", "complex64"]),
    (lambda c: c.all_reduce(torch.ones(4), algorithm="tree"), ValueError, ["unknown algorithm", "tree"]),
    (lambda c: c.reduce_scatter(torch.empty(4), torch.ones(4), algorithm="bruck"), ValueError,
     ["bruck", "reduce_scatter", "recursive_halving"]),
    (lambda c: c.all_gather(torch.empty(4, device="meta"), torch.ones(4)), ValueError, ["output", "meta", "cpu"]),
    (lambda c: c.all_reduce(torch.ones(4).numpy()), TypeError, ["torch.Tensor", "ndarray"]),
])
def test_bad_input_names_argument_expected_and_actual(comm, call, error, words):
    with pytest.raises(error) as info:
        call(comm)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    # Still usable afterwards.
    t = torch.arange(6.0)
    comm.all_reduce(t)
    assert torch.equal(t, torch.arange(6.0))


def test_constructor_checks(comm):
    with pytest.raises(TypeError, match="mpi4py.MPI.Comm or a torch.distributed.ProcessGroup"):
        pccl.Communicator("world")
    with pytest.raises(ValueError, match="executor 'gloo' does not run on transport 'mpi'"):
        pccl.Communicator(MPI.COMM_SELF, executor="gloo")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        pccl.Communicator(MPI.COMM_SELF, timeout=0)
    with pytest.raises(ValueError, match="transport must be"):
        pccl.init(transport="carrier-pigeon")


@pytest.mark.parametrize("executor", ["cpp", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_single_rank_collectives_are_copies(executor, dtype):
    c = pccl.Communicator(MPI.COMM_SELF, executor=executor)
    x = torch.arange(10).to(dtype)
    for algorithm in ("auto", "native", "ring"):
        out = torch.empty(10, dtype=dtype)
        c.all_gather(out, x, algorithm=algorithm)
        assert torch.equal(out, x)
        out.zero_()
        c.reduce_scatter(out, x, op="max", algorithm=algorithm)
        assert torch.equal(out, x)
        y = x.clone()
        c.all_reduce(y, algorithm=algorithm)
        assert torch.equal(y, x)


def test_async_handle_on_one_rank():
    c = pccl.Communicator(MPI.COMM_SELF)
    t = torch.ones(100)
    work = c.all_reduce(t, op="avg", async_op=True)
    assert isinstance(work, pccl.Work)
    assert work.wait() is True and work.is_completed()
    assert torch.equal(t, torch.ones(100))


def test_topology_arguments_are_checked():
    with pytest.raises(pccl.TopologyError, match="world size 1 is not divisible by ranks_per_node=2"):
        pccl.Communicator(MPI.COMM_SELF, ranks_per_node=2)
    with pytest.raises(pccl.TopologyError, match="topology has 2 ranks but the communicator 1"):
        pccl.Communicator(MPI.COMM_SELF, topology=pccl.Topology.regular(2, 1))
    with pytest.raises(ValueError, match="intra must be one of"):
        pccl.Communicator(MPI.COMM_SELF, intra="carrier-pigeon")
    c = pccl.Communicator(MPI.COMM_SELF, ranks_per_node=1)
    assert (c.topology.num_nodes, c.topology.ranks_per_node) == (1, 1)


def test_hierarchical_specs_are_checked_before_sending(comm):
    with pytest.raises(ValueError, match="no all_gather counterpart"):
        comm.all_gather(torch.empty(4), torch.ones(4), algorithm=pccl.Hierarchical(inter="rabenseifner"))
    out = torch.empty(4)
    comm.all_gather(out, torch.ones(4), algorithm="hierarchical")
    assert torch.equal(out, torch.ones(4))


def test_a_call_is_resolved_once_per_shape_and_still_checked_every_time(monkeypatch):
    """The call cache: the second call with the same collective, algorithm, op and buffers
    (dtype, element count, device) skips resolution; what a key cannot hold (contiguity,
    an unhashable argument) is checked on every call."""
    c = pccl.Communicator(MPI.COMM_SELF)
    resolved = []
    real = c.selector.resolve
    monkeypatch.setattr(c.selector, "resolve", lambda *a, **k: resolved.append(a[:3]) or real(*a, **k))
    out, x = torch.empty(4), torch.arange(4.0)
    for _ in range(3):
        c.all_gather(out, x)
        assert torch.equal(out, x)
    assert resolved == [("all_gather", "auto", 16)]
    c.all_gather(torch.empty(2, 2), x.view(2, 2))        # same element count, other shape: same call
    c.all_reduce(torch.ones(8), op="max")
    c.all_reduce(torch.ones(8), op="sum")                # another op: resolved anew
    c.all_reduce(torch.ones(8, dtype=torch.float64))     # another dtype
    assert len(resolved) == 4, resolved
    c.all_reduce(torch.ones(16), op="sum")               # another element count: resolved anew
    assert len(resolved) == 5, resolved
    for wrong in (8, 3):   # sizes that do not fit the cached call's input are still refused
        with pytest.raises(ValueError, match=rf"output.numel\(\) must be 4 .*got {wrong}"):
            c.all_gather(torch.empty(wrong), x)
    with pytest.raises(ValueError, match="output must be contiguous"):
        c.all_gather(torch.empty(8)[::2], x)
    with pytest.raises(TypeError, match="dtypes differ"):
        c.all_gather(out, x.double())
    with pytest.raises(ValueError, match="unknown algorithm"):
        c.all_gather(out, x, algorithm=["ring"])
    with pytest.raises(TypeError, match="torch.Tensor"):
        c.all_reduce([1.0, 2.0])
    t = torch.ones(4)
    c.all_gather(out, t, algorithm="ring")
    assert torch.equal(out, t)


def test_a_call_naming_its_compression_is_resolved_once_too(monkeypatch):
    """Calls naming a codec were resolved anew every time (the codecs made and checked again,
    the cost model asked again for "auto"): 100-300 us a call on 2-4 ranks here, more than a
    small message's whole all-reduce. They are kept under their compression argument; a
    per-level dict (unhashable) is resolved every time, and a codec that refuses the dtype
    still raises on every call."""
    from pccl.compression.codecs import CodecError, codec

    c = pccl.Communicator(MPI.COMM_SELF)
    resolved = []
    real = c.selector.resolve
    monkeypatch.setattr(c.selector, "resolve", lambda *a, **k: resolved.append(a[:3]) or real(*a, **k))
    int8 = codec("int8")
    for _ in range(3):
        for compression in ("int8", "bf16", "auto", int8, "none"):
            c.all_reduce(torch.ones(8), compression=compression)
            c.reduce_scatter(torch.empty(8), torch.ones(8), compression=compression)
            c.all_gather(torch.empty(8), torch.ones(8), compression=compression)
    assert len(resolved) == 15, resolved   # 5 compressions x 3 collectives, once each
    for _ in range(2):
        c.all_reduce(torch.ones(8), compression={"flat": "int8"})
    assert len(resolved) == 17, resolved
    for _ in range(2):
        with pytest.raises(CodecError, match="integer data is never compressed lossily"):
            c.all_reduce(torch.ones(8, dtype=torch.int32), compression="int8")


def test_a_kept_call_does_not_keep_its_buffers():
    """The call cache holds what a call resolved to, not the tensors of the first call
    with that key: their memory is freed when the caller drops them."""
    import gc
    import weakref

    c = pccl.Communicator(MPI.COMM_SELF)
    out, x, t = torch.empty(1024), torch.ones(1024), torch.ones(1024)
    c.all_gather(out, x)
    c.reduce_scatter(out, x)
    c.all_reduce(t)
    storages = [weakref.ref(b.untyped_storage()) for b in (out, x, t)]
    del out, x, t
    gc.collect()
    assert all(s() is None for s in storages)


def test_an_interruptible_communicator_never_lets_auto_run_mpis_own_collectives():
    """MPI's blocking collectives cannot time out: with interruptible=True (the training
    engine's communicators) auto chooses among pccl's schedules only, in its children too;
    "native" named explicitly still runs."""
    c = pccl.Communicator(MPI.COMM_SELF, interruptible=True)
    assert "native" not in c.selector.tuner.candidates("all_gather")
    assert "native" not in c.selector._flat_tuner.candidates("all_reduce")
    assert c.split([[0]]).interruptible
    t = torch.ones(4)
    c.all_reduce(t, algorithm="native")
    assert torch.equal(t, torch.ones(4))
    assert "native" in pccl.Communicator(MPI.COMM_SELF).selector.tuner.candidates("all_gather")


def test_the_own_native_of_an_interruptible_mpi_communicator_is_the_one_that_times_out():
    """What a plan's "native" phases run on each level communicator (pccl.executors.plan)."""
    c = pccl.Communicator(MPI.COMM_SELF, interruptible=True)
    assert c.selector.own_native == "native_nonblocking" and c.split([[0]]).selector.own_native == "native_nonblocking"
    assert c.selector.tuner.candidates("all_gather").count("native_nonblocking") == 1
    assert pccl.Communicator(MPI.COMM_SELF).selector.own_native == "native"


def test_split_groups_and_broadcast_roots_are_plain_integers(comm):
    """An empty group or float ranks were accepted over MPI (gloo raised pybind's TypeError);
    a broadcast root of 1.0 or True passed once the call cache held root 1 (they hash alike)."""
    for groups in ([[0], []], [[0.0]], [[True]]):
        with pytest.raises(ValueError, match="groups must be non-empty lists of int ranks"):
            comm.split(groups)
    t = torch.ones(4)
    comm.broadcast(t, root=0)
    for root in (0.0, False):
        with pytest.raises(ValueError, match="root"):
            comm.broadcast(t, root=root)
