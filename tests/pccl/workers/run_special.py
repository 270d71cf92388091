"""mpiexec worker for behaviours beyond results: async handles, timeouts, huge buffers.

Usage: mpiexec -n P python -m tests.pccl.workers.run_special SCENARIO
Prints "OK <scenario>" on rank 0 when every check passed; raises otherwise.
"""
from __future__ import annotations

import sys
import threading
import time

import torch
from mpi4py import MPI

import pccl
from pccl.compression.codecs import codec

torch.set_num_threads(1)
world = MPI.COMM_WORLD
p, rank = world.size, world.rank
EXECUTORS = {"cpp": dict(executor="cpp"), "python": dict(executor="python"), "gloo": dict(transport="gloo")}


def scenario_async() -> None:
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=60, **kwargs)
        x = torch.full((1000,), float(rank + 1))
        out = torch.empty(1000 * p)
        world.Barrier()
        if rank == 1:
            world.recv(source=0)   # a late peer: it joins only once rank 0's async call has returned
        work = comm.all_gather(out, x, algorithm="ring", async_op=True)
        if rank == 0:   # (had the call waited for rank 1, it would have timed out instead)
            assert not work.is_completed(), f"{name}: completed before the late peer arrived"
            world.send("go", dest=1)
        # Queued behind the async one: a sync call and a second async call, in issue order.
        y = torch.full((10,), float(rank))
        comm.all_reduce(y, algorithm="recursive_doubling")
        z = torch.full((7,), float(rank))
        w2 = comm.all_reduce(z, op="max", algorithm="rabenseifner", async_op=True)
        assert work.wait() is True and work.is_completed()
        w2.wait()
        expected = torch.cat([torch.full((1000,), float(r + 1)) for r in range(p)])
        assert torch.equal(out, expected), f"{name}: async all_gather result wrong"
        assert torch.equal(y, torch.full((10,), float(sum(range(p))))), f"{name}: queued sync call wrong"
        assert torch.equal(z, torch.full((7,), float(p - 1))), f"{name}: second async call wrong"


def scenario_shaped() -> None:
    """Tensors of any shape are flat buffers to every executor and plan: a 2-D all-gather,
    reduce-scatter and all-reduce (4 ranks as 2 nodes of 2) against the 1-D results."""
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=60, ranks_per_node=2, **kwargs)
        for algorithm in ("ring", "hierarchical", "ho_ring"):
            x = torch.arange(12.0).view(4, 3) + 100 * rank
            out = torch.empty(4 * p, 3)
            comm.all_gather(out, x, algorithm=algorithm)
            expected = torch.cat([torch.arange(12.0).view(4, 3) + 100 * r for r in range(p)])
            assert torch.equal(out, expected), f"{name} {algorithm}: 2-D all_gather wrong"
            got = torch.empty(4, 3)
            comm.reduce_scatter(got, expected, algorithm=algorithm)
            assert torch.equal(got, p * expected.view(p, 4, 3)[rank]), f"{name} {algorithm}: 2-D reduce_scatter wrong"
            y = torch.ones(5, 3)
            comm.all_reduce(y, algorithm=algorithm)
            assert torch.equal(y, torch.full((5, 3), float(p))), f"{name} {algorithm}: 2-D all_reduce wrong"


def scenario_in_place() -> None:
    """A reduce-scatter whose output is its input's block `rank` (as NCCL allows), and an
    all-gather whose input is its output's block `rank`, or overlaps it elsewhere: every
    algorithm, MPI's own and the plans (4 ranks as 2 nodes of 2; three_level needs groups
    of nodes, so it is left out) on every executor, against the out-of-place result."""
    from pccl.algorithms import NATIVES

    n = 3
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=60, ranks_per_node=2, **kwargs)
        natives = ("native",) if name == "gloo" else NATIVES
        for algorithm in (*pccl.algorithms_for("reduce_scatter"), *natives, "hierarchical", "ho_ring"):
            data = torch.arange(n * p, dtype=torch.float32) * 3 + 100 * rank
            reference = torch.empty(n)
            comm.reduce_scatter(reference, data.clone(), algorithm=algorithm)
            assert torch.equal(reference, sum(torch.arange(n * p) * 3.0 + 100 * r for r in range(p))[rank * n:][:n])
            comm.reduce_scatter(data[rank * n:(rank + 1) * n], data, algorithm=algorithm)
            assert torch.equal(data[rank * n:(rank + 1) * n], reference), f"{name} {algorithm}: in-place reduce-scatter"
        for algorithm in (*pccl.algorithms_for("all_gather"), *natives, "hierarchical", "ho_ring"):
            expected = torch.cat([torch.arange(n) + 10.0 * r for r in range(p)])
            out = torch.full((n * p,), -1.0)
            out[rank * n:(rank + 1) * n] = torch.arange(n) + 10.0 * rank
            comm.all_gather(out, out[rank * n:(rank + 1) * n], algorithm=algorithm)
            assert torch.equal(out, expected), f"{name} {algorithm}: in-place all-gather"
            shifted = (rank + 1) % p   # the input lies in another rank's block of the output
            out = torch.full((n * p,), -1.0)
            out[shifted * n:(shifted + 1) * n] = torch.arange(n) + 10.0 * rank
            comm.all_gather(out, out[shifted * n:(shifted + 1) * n], algorithm=algorithm)
            assert torch.equal(out, expected), f"{name} {algorithm}: all-gather from inside another block"


def scenario_misuse() -> None:
    """2 ranks. With check_calls, a call another rank makes otherwise (a size, a skipped
    call, an algorithm, a codec) is a CallMismatch on both, naming both calls, and the communicator
    goes on; without it, the Python executor is broken after an MPI error, as the C++ one
    is, instead of matching the next call's messages with the failed one's. A leaf that
    requires grad is written like any tensor; gloo refuses a group not in rank order."""
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=60, check_calls=True, **kwargs)
        calls = {"size": lambda: comm.all_reduce(torch.ones(4 if rank == 0 else 6)),
                 "skipped": lambda: (rank == 0 and comm.all_reduce(torch.ones(4)), comm.all_gather(torch.empty(8),
                                                                                                   torch.ones(4))),
                 "algorithm": lambda: comm.reduce_scatter(torch.empty(2), torch.ones(4),
                                                          algorithm="ring" if rank else "pairwise"),
                 # bf16 and fp16 encode 4 values in the same bytes: unchecked, the sum was wrong and differed
                 "codec": lambda: comm.all_reduce(torch.ones(4), algorithm="ring",
                                                  compression="fp16" if rank else "bf16")}
        for case, call in calls.items():
            try:
                call()
                raise AssertionError(f"{name} {case}: no CallMismatch")
            except pccl.CallMismatch as e:
                assert "rank 0: call" in str(e) and "; rank 1: call" in str(e), f"{name} {case}: {e}"
        x = torch.ones(4, requires_grad=True)
        comm.all_reduce(x)
        assert torch.equal(x.detach(), torch.full((4,), 2.0)), f"{name}: after the mismatches, or with requires_grad"
        y = torch.ones(4)   # one codec, named two ways: the same call
        comm.all_reduce(y, algorithm="ring", compression=" INT8" if rank else codec("int8"))
        assert torch.equal(y, torch.full((4,), 2.0)), f"{name}: int8 named two ways"
    try:
        pccl.init(transport="gloo").split([[1, 0]])
        raise AssertionError("gloo split out of rank order: accepted")
    except ValueError as e:
        assert "in ascending order" in str(e), e
    for executor in ("python", "cpp"):
        comm = pccl.init(timeout=3, executor=executor)
        try:   # rank 0 receives 3 elements into 2 (MPI_ERR_TRUNCATE); rank 1 receives 2 of 3 and waits
            comm.all_reduce(torch.ones(4 if rank == 0 else 6), algorithm="ring")
            raise AssertionError(f"{executor} executor: other sizes on the ranks ran")
        except (RuntimeError, pccl.CollectiveTimeout) as e:   # named, not MPI's "see the MPI_ERROR field"
            expected = "a message from rank 1 was longer than its receive" if rank == 0 else "timed out"
            assert expected in str(e) and "PCCL_CHECK_CALLS" in str(e) or rank == 1, (executor, e)
            assert expected in str(e), (executor, e)
        try:
            comm.all_reduce(torch.ones(6), algorithm="ring")
            raise AssertionError(f"{executor} executor: a call after a failed one returned")
        except (RuntimeError, pccl.CollectiveTimeout) as e:
            assert "earlier collective" in str(e) or "timed out" in str(e), e


def scenario_layouts() -> None:
    """Ranks given other node layouts (an environment set on some nodes only) built other
    topologies and waited on each other: now every rank names each rank's, over MPI and gloo."""
    for kwargs in EXECUTORS.values():
        try:
            pccl.init(ranks_per_node=2 if rank < 2 else None, timeout=20, **kwargs)
            raise AssertionError("ranks disagreeing on the layout: accepted")
        except pccl.TopologyError as e:
            assert "do not agree on the node layout" in str(e) and "ranks 0, 1: ranks_per_node=2" in str(e), e
            assert "ranks 2, 3: ranks_per_node=None" in str(e), e


def scenario_timeout() -> None:
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=1.5, **kwargs)
        world.Barrier()
        if rank == 0:
            t0 = time.perf_counter()
            try:
                comm.all_gather(torch.empty(4 * p), torch.ones(4), algorithm="ring")
                raise AssertionError(f"{name}: no timeout")
            except pccl.CollectiveTimeout as e:
                took = time.perf_counter() - t0
                assert 1.4 < took < 10, f"{name}: timed out after {took:.1f} s, expected ~1.5 s"
                # the ring's rank 0 receives from the last rank and sends to the next, at its first step
                assert f"waiting to receive from {p - 1}; send to 1" in str(e), f"{name}: {e}"
            # the communicator is broken from then on, on every executor and for every call
            # (the Python executor's barrier, broadcast and MPI's own collective ran), and says so at once
            for what, call in (("ring", lambda: comm.all_gather(torch.empty(4 * p), torch.ones(4), algorithm="ring")),
                               ("barrier", comm.barrier), ("broadcast", lambda: comm.broadcast(torch.ones(2))),
                               ("native", lambda: comm.all_reduce(torch.ones(2), algorithm="native"))):
                try:
                    call()
                    raise AssertionError(f"{name}: a {what} call after a timeout returned")
                except RuntimeError as e:
                    assert "earlier collective on this communicator timed out" in str(e), f"{name} {what}: {e}"
        world.Barrier()
    # On a sub-communicator (a plan's level) the rank that times out names its world rank
    for name in ("cpp", "python"):
        child = pccl.init(timeout=1.5, executor=name).split([list(reversed(range(p)))])
        world.Barrier()
        if rank == p - 1:   # the child's rank 0
            try:
                child.all_gather(torch.empty(4 * p), torch.ones(4), algorithm="ring")
                raise AssertionError(f"{name}: no timeout")
            except pccl.CollectiveTimeout as e:
                assert f"rank 0 (world rank {p - 1}) timed out" in str(e), f"{name}: {e}"
        world.Barrier()
    # Async: the error surfaces at wait().
    comm = pccl.init(timeout=1.5)
    world.Barrier()
    if rank == 0:
        work = comm.all_reduce(torch.ones(8), algorithm="ring", async_op=True)
        try:
            work.wait()
            raise AssertionError("async: no timeout")
        except pccl.CollectiveTimeout:
            pass
    world.Barrier()


def scenario_native_watchdog() -> None:
    comm = pccl.init(timeout=1.5)
    if rank == 0:
        comm.all_gather(torch.empty(4 * p), torch.ones(4), algorithm="native")
    time.sleep(3600)  # only the watchdog's abort ends the job


def scenario_native_watchdog_waits() -> None:
    """The watchdog aborts a blocking call only after the whole timeout: a peer 1.5 s late
    to a call with 4 s of it is no failure."""
    comm = pccl.init(timeout=4)
    if rank == 1:
        time.sleep(1.5)
    x = torch.full((8,), float(rank + 1))
    comm.all_reduce(x, algorithm="native")
    assert torch.equal(x, torch.full((8,), float(p * (p + 1) // 2))), x


def scenario_broadcast() -> None:
    """broadcast on every executor and form, each dtype, from every root: every rank ends
    with the root's bytes exactly (the others' overwritten), async and queued in issue
    order; broadcast_object of any value; barrier waits for the last rank; bad input is
    refused on every rank before anything is sent; a missing peer times out where the
    form is polled."""
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=60, **kwargs)
        forms = ("auto", "native") + (("native_nonblocking",) if name != "gloo" else ())
        for form in forms:
            for dtype in dtypes:
                for root in range(p):
                    g = torch.Generator().manual_seed(100 * root + 7)
                    sent = (torch.randn(1001, generator=g) * 1e3).to(dtype)
                    mine = sent.clone() if rank == root else torch.full((1001,), -1).to(dtype)
                    comm.broadcast(mine.view(7, 143), root=root, algorithm=form)
                    assert torch.equal(mine, sent), f"{name} {form} {dtype} root {root}: not the root's values"
            empty = torch.empty(0)
            comm.broadcast(empty, algorithm=form)
        # async, queued behind an async all-reduce and before a sync one, in issue order
        x = torch.full((64,), float(rank + 1))
        w1 = comm.all_reduce(x, algorithm="ring", async_op=True)
        y = torch.full((1000,), float(rank))
        w2 = comm.broadcast(y, root=p - 1, async_op=True)
        comm.all_reduce(y, op="max", algorithm="ring")
        w1.wait(), w2.wait()
        assert torch.equal(x, torch.full((64,), float(p * (p + 1) / 2))), f"{name}: async all_reduce wrong"
        assert torch.equal(y, torch.full((1000,), float(p - 1))), f"{name}: async broadcast wrong"
        value = {"rank": rank, "text": "x" * 10000 + str(rank), "nested": [1.5, None, (rank,)]}
        got = comm.broadcast_object(value if rank == 1 else None, root=1)
        assert got == {"rank": 1, "text": "x" * 10000 + "1", "nested": [1.5, None, (1,)]}, f"{name}: object wrong"
        assert comm.broadcast_object(None) is None and comm.broadcast_object(b"") == b""
        # barrier: nobody leaves before the last rank arrives
        world.Barrier()
        t0 = time.perf_counter()
        if rank == p - 1:
            time.sleep(0.5)
        comm.barrier()
        assert time.perf_counter() - t0 >= 0.45, f"{name}: barrier returned before the last rank arrived"
        # refused before anything is sent, alike on every rank (a hang here would time out the job)
        for bad, match in (((torch.ones(3), p), "root must be a rank"), ((torch.ones(3), -1), "root must be a rank"),
                           ((torch.ones(3).t()[None].expand(2, 3), 0), "contiguous"),
                           ((torch.ones(3, dtype=torch.uint8), 0), "dtype")):
            try:
                comm.broadcast(*bad)
                raise AssertionError(f"{name}: {bad} accepted")
            except (ValueError, TypeError) as e:
                assert match in str(e), e
        try:
            comm.broadcast(torch.ones(3), algorithm="ring")
            raise AssertionError(f"{name}: a schedule accepted for broadcast")
        except ValueError as e:
            assert "does not implement broadcast" in str(e), e
        comm.close()
    # a missing peer: polled forms and torch's time out, naming the operation (a timed-out
    # communicator is broken, and so is a torch group: one each)
    for name, kwargs in EXECUTORS.items():
        base = pccl.init(timeout=1.5, interruptible=True, **kwargs)
        fresh = {what: base.split([list(range(p))]) for what in ("broadcast", "barrier")}
        for what, comm in fresh.items():
            world.Barrier()
            if rank == 0:
                try:
                    comm.broadcast(torch.ones(4), root=1) if what == "broadcast" else comm.barrier()
                    raise AssertionError(f"{name}: {what} with a missing peer returned")
                except pccl.CollectiveTimeout as e:
                    assert what in str(e), e
            world.Barrier()


KEPT = []  # communicators that live until the interpreter exits, as in a user's script


def scenario_gloo_levels() -> None:
    """A gloo communicator with gloo sub-groups, then a normal exit: ranks leave at
    different times, which must not break a peer's connections."""
    comm = pccl.init(transport="gloo", ranks_per_node=2, timeout=60)
    KEPT.append(comm)
    # torch level groups are made with the communicator, on this thread, in one order on
    # every rank, not at the first plan call on a worker thread
    assert comm._plans is not None and set(comm._plans.levels) == {"intra", "inter"}
    out = torch.empty(2 * p)
    comm.all_gather(out, torch.full((2,), float(rank)), algorithm="hierarchical")
    assert torch.equal(out, torch.arange(p, dtype=torch.float32).repeat_interleave(2))


def scenario_large() -> None:
    # 2^30 + 1 fp16 elements per rank: inputs over 2^31 bytes, output over 2^31 elements.
    comm = pccl.init(timeout=600)
    n = (1 << 30) + 1
    x = torch.full((n,), float(rank + 1), dtype=torch.float16)
    out = torch.empty(n * p, dtype=torch.float16)
    comm.all_gather(out, x, algorithm="ring")
    del x
    for r in range(p):
        block = out[r * n:(r + 1) * n]
        assert block.min().item() == block.max().item() == r + 1, f"block {r} wrong"   # no 1 GiB mask
    assert out.numel() > 2**31


def scenario_callback() -> None:
    """A blocking call from a Work's done-callback (on the worker thread) would wait for
    that thread itself, forever, when more work is queued behind it: refused, and the
    communicator goes on (on every executor). Ring, not auto: auto's first call measures,
    and the measurement waits for the queue the gate holds."""
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=30, **kwargs)
        for blocking in ("all_reduce", "barrier", "drain", "wait"):
            a, b, c = torch.ones(4), torch.ones(4), torch.ones(4)
            errors = []
            later = []

            def callback(error, blocking=blocking, b=b):
                try:
                    if blocking == "all_reduce":
                        comm.all_reduce(b, algorithm="ring")
                    elif blocking == "wait":
                        later[0].wait()
                    else:
                        getattr(comm, blocking)()
                except RuntimeError as e:
                    errors.append(str(e))
            gate = threading.Event()   # holds the queue, so the callback runs on the worker, not at once here
            comm._queue.run(gate.wait, async_op=True)
            work = comm.all_reduce(a, algorithm="ring", async_op=True)
            later.append(comm.all_reduce(c, algorithm="ring", async_op=True))
            work.add_done_callback(callback)
            gate.set()
            work.wait()
            later[0].wait()
            comm.drain()
            assert len(errors) == 1 and "done-callback" in errors[0], (name, blocking, errors)
            assert a.tolist() == c.tolist() == [p] * 4, (name, blocking, a, c)
        x = torch.ones(3)
        comm.all_reduce(x, algorithm="ring")
        assert x.tolist() == [p] * 3, (name, x)
        comm.close()


def scenario_threads() -> None:
    """A call from a second thread while another thread's call is in progress on the same
    communicator is refused on that rank (the ranks' threads would interleave in different
    orders); the call in progress completes, and the communicator goes on."""
    for name, kwargs in EXECUTORS.items():
        comm = pccl.init(timeout=30, **kwargs)
        x = torch.ones(4)
        if rank == 0:
            first = threading.Thread(target=comm.all_reduce, args=(x,))
            first.start()   # in progress until rank 1 joins it
            time.sleep(0.5)
            try:
                comm.all_reduce(torch.ones(4))
                raise AssertionError(f"{name}: a second thread's call ran")
            except RuntimeError as e:
                assert "second thread" in str(e), (name, e)
            first.join()
        else:
            time.sleep(1.5)
            comm.all_reduce(x)
        assert x.tolist() == [p] * 4, (name, x)
        y = torch.ones(3)
        comm.all_reduce(y)
        assert y.tolist() == [p] * 3, (name, y)
        comm.close()


def scenario_closed() -> None:
    """close() finishes the work in flight; every later call on the communicator raises
    naming the closing, the same on every transport (an MPI one silently started a new
    worker, a gloo one raised torch's "not registered"), and its parent goes on."""
    for name, kwargs in EXECUTORS.items():
        parent = pccl.init(timeout=30, **kwargs)
        comm = parent.split([list(range(p))])
        x = torch.ones(1 << 16)
        work = comm.all_reduce(x, algorithm="ring", async_op=True)
        comm.close()
        assert work.is_completed() and x[0].item() == p, (name, x[0])
        for what, call in (("all_reduce", lambda: comm.all_reduce(torch.ones(4), algorithm="ring")),
                           ("async", lambda: comm.all_reduce(torch.ones(4), algorithm="ring", async_op=True)),
                           ("barrier", comm.barrier), ("broadcast", lambda: comm.broadcast(torch.ones(2))),
                           ("split", lambda: comm.split([list(range(p))]))):
            try:
                call()
                raise AssertionError(f"{name}: {what} after close ran")
            except RuntimeError as e:
                assert "closed" in str(e), (name, what, e)
        y = torch.ones(3)
        parent.all_reduce(y, algorithm="ring")
        assert y.tolist() == [p] * 3, (name, y)
        parent.close()


def scenario_dropped() -> None:
    """An async collective that fails after its Work was dropped unwaited (rank 1 never
    makes it) is reported on stderr (the test reads it), not lost."""
    comm = pccl.init(timeout=1.5, executor="python")
    if rank == 0:
        comm.all_reduce(torch.ones(8), algorithm="ring", async_op=True)   # the handle is dropped at once
        time.sleep(4)   # past the timeout: the failure happens with no Work left to hold it
    world.Barrier()


def scenario_default_codec() -> None:
    """PCCL_COMPRESSION=int8 (set by the test), a cold calibration cache, self-calibration
    on: an integer all-reduce and an exact (compression="none") float call measure the
    candidates (the transport's own among them, which cannot encode) and run exact; a call
    that takes the default is compressed, whichever of the two a same-shape call made first;
    max and min run exact."""
    comm = pccl.init(timeout=60)
    assert comm.default_compression == "int8"
    counts = torch.ones(4, dtype=torch.int32)
    comm.all_reduce(counts)
    assert counts.tolist() == [p] * 4, counts
    values = torch.linspace(-1, 1, 1000) * (rank + 1)
    exact = sum(torch.linspace(-1, 1, 1000) * (r + 1) for r in range(p))
    for order in (("none", None), (None, "none")):
        for compression in order:
            x = values.clone()
            comm.all_reduce(x, algorithm="ring", compression=compression)
            error = (x - exact).abs().max().item()
            if compression == "none":
                assert error < 1e-5, f"{order}: the exact call was compressed (error {error})"
            else:
                assert error > 1e-4, f"{order}: the default codec was dropped (error {error})"
        comm._calls.clear()
    # max and min keep their promises under the default codec (they are sent exact): a NaN
    # stays where it was and the zeros' signs follow IEEE's rule; named, a codec still applies
    values = torch.linspace(-1, 1, 1000) * (rank + 1)
    values[0], values[1] = (float("nan"), -0.0) if rank == 0 else (1.0, 0.0)
    for algorithm in ("ring", "auto"):
        for op, zero_sign in (("max", False), ("min", True)):
            x = values.clone()
            comm.all_reduce(x, op=op, algorithm=algorithm)
            reference = torch.stack([torch.linspace(-1, 1, 1000) * (r + 1) for r in range(p)])
            reference = reference.amax(0) if op == "max" else reference.amin(0)
            assert x[0].isnan() and not x[2:].isnan().any(), f"{op} {algorithm}: NaN {x[:4].tolist()}"
            assert torch.equal(x[2:], reference[2:]), f"{op} {algorithm}: not exact under the default codec"
            assert x[1] == 0 and bool(x[1].signbit()) == zero_sign, f"{op} {algorithm}: zero {x[1].item()}"
    x = values.clone()
    comm.all_reduce(x, op="max", algorithm="ring", compression="int8")
    assert x[:128].isnan().all(), "a named codec on max: its NaN group decodes as NaN, as documented"


# Scenarios about leaving the job: ranks must exit at their own pace, unsynchronized
# (mpiexec's exit status tells whether every rank left cleanly).
NO_FINAL_BARRIER = {"gloo_levels"}

if __name__ == "__main__":
    name = sys.argv[1]
    globals()[f"scenario_{name}"]()
    if name not in NO_FINAL_BARRIER:
        world.Barrier()
    if rank == 0:
        print(f"OK {name}", flush=True)
