"""The per-communicator queue: issue order kept across threaded and enqueue-only calls."""
import threading
import time

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
