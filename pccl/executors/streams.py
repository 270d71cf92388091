"""Work on a side stream, safely: the one place that knows how device streams order work
and keep memory alive (the engine's lanes run their collectives this way).

Two rules make side-stream work correct under torch's caching allocator:

- **Order after the producer, and only after it.** The side stream waits on an event
  recorded on the caller's stream when the work was submitted, not on a device-wide
  synchronization; the consumer later waits on the side stream's completion event.
- **Keep every buffer until the side stream is done with it.** A tensor allocated on the
  caller's stream goes back to that stream's pool when its last reference dies, and the
  allocator may hand it to the caller's next kernel while the side stream still reads it.
  `Tensor.record_stream(side)` tells the allocator to wait for the side stream's work
  queued *so far*, so it is called after the work is enqueued, while the buffer is still
  referenced (before that, it would not cover the work).

The device calls go through `api` (torch.cuda by default), so the same bookkeeping runs on
CPU with stand-in streams and events in the tests.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class CudaApi:
    """The few torch.cuda calls side-stream work makes."""

    current_stream = staticmethod(torch.cuda.current_stream)
    use = staticmethod(torch.cuda.stream)   # context: make a stream current
    Event = torch.cuda.Event


class StreamWork:
    """The handle of collective work that is already queued on the caller's current stream
    (NCCL only enqueues): wait() orders the then-current stream after it without blocking
    the CPU, as torch's NCCL Work does."""

    def __init__(self, api=CudaApi):
        self.api = api
        self._done = api.Event()
        self._done.record(api.current_stream())

    def wait(self, timeout=None) -> bool:
        self.api.current_stream().wait_event(self._done)
        return True

    def is_completed(self) -> bool:
        return self._done.query()

    def add_done_callback(self, fn) -> None:
        """fn(None) now: the work is queued on the stream, and stream order completes it
        before anything queued after it (what torch's async NCCL work promises too)."""
        fn(None)


class SideStream:
    def __init__(self, stream, api=CudaApi):
        self.stream, self.api = stream, api

    def mark(self):
        """An event at the end of what the caller's current stream has queued: what work
        submitted now must follow."""
        ready = self.api.Event()
        ready.record(self.api.current_stream())
        return ready

    def run(self, fn: Callable[[], None], ready, buffers: Iterable[torch.Tensor] = ()):
        """Enqueue `fn`'s device work on the side stream after `ready`; return the event
        that completes with it. `buffers`: the tensors that work reads or writes and that
        were allocated elsewhere; each stays allocated until the side stream has done."""
        with self.api.use(self.stream):
            self.stream.wait_event(ready)
            fn()
            done = self.api.Event()
            done.record(self.stream)
        for buffer in buffers:
            buffer.record_stream(self.stream)
        return done

    def wait(self, done) -> None:
        """Order the caller's current stream after `done`, without blocking the CPU."""
        self.api.current_stream().wait_event(done)
