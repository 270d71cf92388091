"""Side-stream bookkeeping on CPU, with stand-in streams whose "kernels" run only when the
test lets the stream advance: a buffer the side stream uses stays allocated until that
work has run, even when every Python reference to it is gone."""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from pccl.executors.streams import SideStream


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
