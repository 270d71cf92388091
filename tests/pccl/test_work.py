"""The per-communicator queue: issue order kept across threaded and enqueue-only calls."""
import threading
import time

import pytest

from pccl.runtime.work import SerialQueue


def test_sync_calls_queue_behind_async_ones_in_issue_order():
    queue, order = SerialQueue("test"), []
    work = queue.run(lambda: time.sleep(0.05) or order.append("async"), async_op=True)
    queue.run(lambda: order.append("sync"), async_op=False)
    work.wait()
    queue.close()
    assert order == ["async", "sync"]


def test_enqueue_only_work_runs_on_the_calling_thread_after_the_threaded_work_before_it():
    queue, order = SerialQueue("test"), []
    queue.run(lambda: time.sleep(0.05) or order.append(("threaded", threading.get_ident())), async_op=True)
    handle = queue.run(lambda: order.append(("enqueued", threading.get_ident())), async_op=True,
                       enqueued=lambda: "handle")
    queue.close()
    assert [what for what, _ in order] == ["threaded", "enqueued"]
    assert order[1][1] == threading.get_ident() != order[0][1]
    assert handle == "handle"
    assert queue.run(lambda: None, async_op=False, enqueued=lambda: "handle") is None


def test_a_wait_with_a_timeout_says_so_and_a_later_wait_gets_the_result():
    queue, release = SerialQueue("test"), threading.Event()
    work = queue.run(release.wait, async_op=True)
    with pytest.raises(TimeoutError, match=r"did not complete within 0.05 s; it is still running") as caught:
        work.wait(0.05)
    assert type(caught.value) is TimeoutError   # not CollectiveTimeout: no peer is known to be missing
    release.set()
    assert work.wait(5) and work.is_completed()
    queue.close()
