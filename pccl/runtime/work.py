"""Async handles and the per-communicator queue that keeps collectives in issue order.

Every rank must run a communicator's collectives in the same order. A synchronous call
runs inline on the caller's thread when nothing is queued (no hand-off latency);
otherwise it queues behind the pending async calls. Async calls run on one worker
thread per communicator; the native executor releases the GIL, so they overlap with
the caller's compute. Work that only enqueues on a GPU stream (NCCL) runs inline even
when async: the CPU returns at once, and NCCL needs every rank to launch its work in one
order across all communicators, which worker threads racing each other would not keep.
"""
from __future__ import annotations

import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional


def _unseen(future: Future, sys=sys) -> None:
    """An async collective failed, and its Work was dropped without a wait: say so on
    stderr, or the error (a timeout, a lost peer) would vanish and the run end as if fine."""
    error = future.exception()
    if error is not None:
        sys.stderr.write(f"pccl: an async collective failed and its Work was dropped without wait(): "
                         f"{type(error).__name__}: {error}\n")
        sys.stderr.flush()


class Work:
    """Handle of an async collective: wait() blocks until done and re-raises its error."""

    def __init__(self, future: Future, queue: Optional["SerialQueue"] = None):
        self._future, self._queue, self._seen = future, queue, False
        # a failure nobody will see (the handle dropped unwaited) is reported, not lost
        # (`report` bound now: at interpreter exit the module's globals may be gone)
        mine = weakref.ref(self)
        future.add_done_callback(lambda f, report=_unseen: mine() is None and report(f))

    def __del__(self, report=_unseen) -> None:
        if not self._seen and self._future.done():
            report(self._future)

    def refuse_waiting_here(self) -> None:
        """RuntimeError where waiting for it on this thread would never end: it is queued
        behind this very thread (a done-callback's)."""
        if self._queue is not None and not self._future.done():
            self._queue.refuse_here("waiting for a collective queued")

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until the collective completes (re-raising its error), or `timeout` seconds: then
        TimeoutError, and the collective goes on (wait again). Not a CollectiveTimeout: the
        peers are not known to be missing, the caller only stopped waiting."""
        self.refuse_waiting_here()
        self._seen = True
        # wait(), not result(timeout): that raises a TimeoutError, as a CollectiveTimeout is one
        if not wait([self._future], timeout).done:
            raise TimeoutError(f"pccl: the collective did not complete within {timeout:g} s; it is still "
                               "running (wait() again for it)")
        self._future.result()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Optional[BaseException]], None]) -> None:
        """Call fn(error or None) when done: on the worker thread, or now if already done."""
        self._seen = True   # the callback is handed the error
        self._future.add_done_callback(lambda f: fn(f.exception()))


class SerialQueue:
    def __init__(self, name: str):
        self._name = name
        self._pool: Optional[ThreadPoolExecutor] = None
        self._last: Optional[Future] = None
        self.worker: Optional[threading.Thread] = None   # the pool's one thread, once started
        self._issuer, self._issuing, self._issuers = None, 0, threading.Lock()
        self.closed = False   # by close(): its communicator takes no more calls

    def _submit(self, fn: Callable[[], None]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name, initializer=self._started)
        self._last = self._pool.submit(fn)
        return self._last

    def _started(self) -> None:
        self.worker = threading.current_thread()

    def enter(self, what: Callable[[], str]) -> None:
        """A call starts issuing on this thread (leave() when it returns). RuntimeError where
        another thread is issuing one at this moment: the ranks' threads would interleave
        their calls in different orders, and the ranks exchange each other's data or wait
        forever (measured: a fifth of two threads' all-reduces came out wrong, silently)."""
        if self.closed:
            raise RuntimeError(f"pccl: {what()} on a communicator that was closed: make a new one")
        me = threading.get_ident()
        with self._issuers:
            if self._issuing and self._issuer != me:
                raise RuntimeError(f"pccl: {what()} issued from a second thread while another thread's call is in "
                                   "progress on the same communicator: every rank must issue a communicator's "
                                   "calls in one order, which two threads do not keep; give each thread its own "
                                   "communicator (comm.split)")
            self._issuer = me
            self._issuing += 1

    def leave(self) -> None:
        with self._issuers:
            self._issuing -= 1

    def on_worker(self) -> bool:
        """Whether this is the queue's worker thread (where done-callbacks run)."""
        return self.worker is not None and threading.current_thread() is self.worker

    def refuse_here(self, what: str) -> None:
        """RuntimeError on the worker thread (in a Work's done-callback): `what` would wait
        for work only that thread can run, forever."""
        if self.on_worker():
            raise RuntimeError(f"pccl: {what} on the communicator's worker thread (in a Work's done-callback) "
                               "would wait for that thread itself: do it from the thread that issued the calls, "
                               "or issue the collective async (async_op=True)")

    def idle(self) -> bool:
        """Whether nothing queued is still running: a synchronous call may run at once."""
        return self._last is None or self._last.done()

    def drain(self) -> None:
        """Wait until everything queued has run, its completion callbacks too (its failures
        stay with its Work): a no-op queued behind it runs once the worker thread has called
        back for the last call, which a wait on that call's future does not promise."""
        if self._pool is None or self._last is None:
            return
        self.refuse_here("draining the queue")
        try:   # (a done future may still be calling back)
            wait([self._submit(lambda: None)])
        except RuntimeError:   # the pool no longer takes work (the interpreter is exiting)
            wait([self._last])

    def run(self, fn: Callable[[], None], async_op: bool, enqueued: Optional[Callable[[], Any]] = None):
        """Run `fn` after what is queued. `enqueued` given: `fn` only enqueues GPU work, so it
        runs now on this thread, and an async call returns enqueued(), its handle (a
        pccl.executors.streams.StreamWork)."""
        if enqueued is not None:
            if self._last is not None:
                self.refuse_here("a collective")
                self._last.result()   # threaded work queued before it comes first
            fn()
            return enqueued() if async_op else None
        if async_op:
            return Work(self._submit(fn), self)
        self.refuse_here("a blocking collective")
        if not self.idle():
            self._submit(fn).result()
        else:
            fn()
        return None

    def close(self) -> None:
        self.closed = True
        if self._pool is not None:
            self.refuse_here("closing the communicator")
            self._pool.shutdown(wait=True)
            self._pool = None
