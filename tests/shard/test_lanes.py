"""A lane task's handle: wait() orders the caller's stream after the task without blocking
the CPU; settle() also blocks the CPU until the device has run it, which is what frees its
buffers for reuse (the engine bounds the gradient buffers in flight with it). On CPU with
stand-ins for the side stream and its event."""
from shard.engine.lanes import Handle, Ledger


class Side:
    def __init__(self, calls):
        self.calls = calls

    def wait(self, done):
        self.calls.append(("stream waits", done.name))


class Event:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def synchronize(self):
        self.calls.append(("cpu waits", self.name))


def test_settle_blocks_the_cpu_until_the_device_ran_the_task_and_wait_does_not():
    calls = []
    waited = Handle(None, Side(calls), [Event("a", calls)], Ledger(None))
    waited.wait()
    waited.settle()   # waited already: nothing more
    assert calls == [("stream waits", "a")]
    calls.clear()
    settled = Handle(None, Side(calls), [Event("b", calls)], Ledger(None))
    settled.settle()
    settled.wait()
    assert calls == [("cpu waits", "b"), ("stream waits", "b")]
