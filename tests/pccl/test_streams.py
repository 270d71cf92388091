"""Side-stream bookkeeping on CPU, with stand-in streams whose "kernels" run only when the
test lets the stream advance: a buffer the side stream uses stays allocated until that
work has run, even when every Python reference to it is gone."""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch

from pccl.executors.streams import SideStream
from pccl.ir.plan import Concurrent


class Buffer:
    """A tensor stand-in: record_stream is the allocator's promise to keep it."""

    def __init__(self, value):
        self.value = value

    def record_stream(self, stream):
        stream.keep(self)


class Stream:
    """A device stream stand-in: kernels queue in order and run on advance()."""

    def __init__(self, name):
        self.name, self.queue, self.kept, self.done = name, [], [], 0

    def launch(self, kernel):
        self.queue.append(kernel)

    def keep(self, buffer):   # held until the work queued so far has run
        self.kept.append((self.done + len(self.queue), buffer))

    def wait_event(self, event):
        self.launch(lambda: event.check())

    def advance(self):
        while self.queue:
            self.queue[0]()   # a kernel that fails stays queued
            self.queue.pop(0)
            self.done += 1
            self.kept = [(at, b) for at, b in self.kept if at > self.done]


class Event:
    def __init__(self):
        self.stream, self.at = None, None

    def record(self, stream):
        self.stream, self.at = stream, len(stream.queue) + stream.done

    def check(self):   # a wait on an event that has not completed would hang a device
        assert self.stream.done >= self.at, f"waited on {self.stream.name} before its work ran"


class Api:
    def __init__(self):
        self.caller = Stream("caller")
        self.current = self.caller

    def current_stream(self):
        return self.current

    @contextlib.contextmanager
    def use(self, stream):
        before, self.current = self.current, stream
        yield
        self.current = before

    Event = Event


def test_a_buffer_outlives_every_reference_until_the_side_stream_has_used_it():
    api, side_stream = Api(), Stream("side")
    side = SideStream(side_stream, api)
    seen = []
    buffer = Buffer(7)
    alive = weakref.ref(buffer)
    ready = side.mark()
    done = side.run(lambda b=buffer: api.current_stream().launch(lambda: seen.append(alive() and alive().value)),
                    ready, [buffer])
    del buffer
    gc.collect()
    assert alive() is not None, "released while the side stream had not run the kernel that reads it"
    api.caller.advance()
    side_stream.advance()
    assert seen == [7]
    gc.collect()
    assert alive() is None, "kept after the side stream finished with it"
    side.wait(done)
    api.caller.advance()   # the caller's wait runs after the side stream's work: no assertion fires


def test_without_recording_the_buffer_would_be_released_early():
    """The stand-ins can see the bug the bookkeeping prevents."""
    api, side_stream = Api(), Stream("side")
    side = SideStream(side_stream, api)
    buffer = Buffer(7)
    alive = weakref.ref(buffer)
    side.run(lambda b=buffer: api.current_stream().launch(lambda: None), side.mark(), [])
    del buffer
    gc.collect()
    assert alive() is None


def test_side_work_follows_the_callers_work_submitted_before_it():
    api, side_stream = Api(), Stream("side")
    side = SideStream(side_stream, api)
    api.caller.launch(lambda: None)    # the producer of the side work's input
    done = side.run(lambda: api.current_stream().launch(lambda: None), side.mark(), [])
    with pytest.raises(AssertionError, match="waited on caller before its work ran"):
        side_stream.advance()          # the side stream may not overtake its producer
    api.caller.advance()
    side_stream.advance()
    assert side_stream.done >= done.at


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the same bookkeeping on real streams")
def test_on_a_gpu_a_delayed_side_stream_still_reads_the_callers_buffer():
    """The side stream is held back (torch.cuda._sleep) while the caller drops its buffer
    and allocates again: without record_stream the allocator hands the same memory back
    and the side stream copies garbage."""
    side = SideStream(torch.cuda.Stream())
    n = 1 << 20
    buffer = torch.arange(n, dtype=torch.float32, device="cuda")
    expected = buffer.clone()
    out = torch.empty_like(buffer)

    def work(b=buffer):
        torch.cuda._sleep(200_000_000)   # about 0.1 s of GPU cycles on the side stream
        out.copy_(b)

    done = side.run(work, side.mark(), [buffer])
    del buffer, work
    scribble = torch.full((n,), -1.0, device="cuda")   # reuses the block if it was released
    side.wait(done)
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and scribble[0].item() == -1.0


class Level:
    """A plan level's communicator stand-in: records where each phase was issued."""

    def __init__(self, name, queues, api, log):
        self.name, self.queues, self.api, self.log = name, queues, api, log

    def queues_on_device(self, device):
        return self.queues

    def _issue(self, collective, async_op):
        self.log.append((self.name, collective, threading.get_ident(), self.api.current_stream().name))
        return Done() if async_op else None

    def all_gather(self, output, input, algorithm, async_op, compression):
        return self._issue("all_gather", async_op)

    def reduce_scatter(self, output, input, op, algorithm, async_op, compression):
        return self._issue("reduce_scatter", async_op)


class Done:
    def wait(self):
        pass


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_concurrent_nccl_phases_are_issued_in_order_on_this_thread_each_on_its_side_stream(collective, monkeypatch):
    """HO-Ring's concurrent phases: with levels that only queue GPU work (NCCL), both are
    issued by the calling thread in phase order (NCCL needs one launch order on every rank),
    each on its level's side stream after the caller's work, and the caller's stream then
    waits for both."""
    from pccl import plans
    from pccl.core.topology import Topology
    from pccl.executors.plan import PlanExecutor

    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: stream.keep(self), raising=False)
    api, log = Api(), []
    levels = {name: Level(name, True, api, log) for name in ("intra", "inter")}
    sides = []
    executor = PlanExecutor(levels, new_side=lambda device: sides.append(SideStream(Stream(f"side{len(sides)}"), api))
                            or sides[-1])
    plan = plans.build(plans.spec_of("ho_ring"), collective, Topology.regular(4, 2), 0)
    n = 3
    if collective == "all_gather":
        executor.run(plan, {"input": torch.ones(n), "output": torch.empty(4 * n)}, n, "sum")
    else:
        executor.run(plan, {"input": torch.ones(4 * n), "output": torch.empty(n)}, n, "sum")
    phases = [step for step in plan.steps if isinstance(step, Concurrent)]
    expected = [(p.level, p.collective) for step in phases for p in step.phases]
    concurrent = [(name, c) for name, c, _, stream in log if stream != "caller"]
    assert phases and concurrent == expected
    assert {thread for _, _, thread, _ in log} == {threading.get_ident()}
    by_level = {name: stream for name, _, _, stream in log if stream != "caller"}
    assert len(set(by_level.values())) == 2, "each level's concurrent phase on its own stream"
    waits = len(api.caller.queue)   # the caller's stream waits once per concurrent phase
    assert waits == len(expected)


def test_concurrent_phases_of_blocking_levels_run_on_their_worker_threads(monkeypatch):
    """MPI levels block the CPU: their concurrent phases go to the levels' own threads
    (async_op=True), not to side streams."""
    from pccl import plans
    from pccl.core.topology import Topology
    from pccl.executors.plan import PlanExecutor

    api, log = Api(), []
    levels = {name: Level(name, False, api, log) for name in ("intra", "inter")}
    executor = PlanExecutor(levels, new_side=lambda device: pytest.fail("no side stream for a blocking level"))
    plan = plans.build(plans.spec_of("ho_ring"), "all_gather", Topology.regular(4, 2), 0)
    executor.run(plan, {"input": torch.ones(3), "output": torch.empty(12)}, 3, "sum")
    assert log and all(stream == "caller" for *_, stream in log)
