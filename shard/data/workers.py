"""Tokenizing worker processes: the feeds (feed.py) of a rank, read and tokenized ahead of
the training loop.

    feeds = Feeds(workers=1)
    feeds.add(key, spec, position)     # starts reading ahead
    chunk = feeds.next(key)            # the feed's next chunk, in order

Each feed lives in one worker (key order, round robin), which keeps it open between chunks;
the rank asks for PREFETCH chunks ahead per feed. A worker is `python -m
shard.data.workers`, a fresh interpreter (not a fork of a training process that holds MPI,
threads and device state), speaking pickled messages over its stdin and stdout; it imports
no torch. The chunks a feed gives do not depend on the number of workers: workers=0 reads
in the training process itself, the same chunks. A worker that fails says why (its error is
raised by next() for its feeds), and one that dies is named with its exit status.
"""
from __future__ import annotations

import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from shard.data.feed import Feed, FeedSpec, Position
from shard.data.readers import CorpusError

PREFETCH = 4   # chunks asked for ahead, per feed


class Feeds:
    def __init__(self, workers: int = 1):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"data.workers must be an int >= 0, got {workers!r}")
        self.workers = [_Worker(i) for i in range(workers)]
        self.local: dict[Any, Feed] = {}
        self.tokenizers: dict[str, Any] = {}
        self.owner: dict[Any, _Worker] = {}
        self.waited_s = 0.0   # time next() took: blocked for a worker, or tokenizing itself (workers=0)

    def add(self, key, spec: FeedSpec, position: Position = Position(0, 0, 0)) -> None:
        if not self.workers:
            if spec.tokenizer not in self.tokenizers:
                from shard.data import tokenizer

                self.tokenizers[spec.tokenizer] = tokenizer.load(spec.tokenizer)
            self.local[key] = Feed(spec, position, self.tokenizers[spec.tokenizer])
            return
        worker = self.workers[len(self.owner) % len(self.workers)]
        self.owner[key] = worker
        worker.open(key, spec, position)

    def next(self, key):
        started = time.perf_counter()
        chunk = self.local[key].next_chunk() if key in self.local else self.owner[key].next(key)
        self.waited_s += time.perf_counter() - started
        return chunk

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.workers, self.owner, self.local = [], {}, {}


class _Worker:
    """One worker process and the thread that sorts its replies by feed."""

    def __init__(self, index: int):
        self.index = index
        self.proc = subprocess.Popen([sys.executable, "-m", "shard.data.workers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.replies: dict[Any, queue.Queue] = {}
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name=f"data worker {index}", daemon=True)
        self.reader.start()

    def _send(self, message) -> None:
        with self.lock:
            try:
                pickle.dump(message, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass   # it died: its reader thread reports that

    def _read(self) -> None:
        while True:
            try:
                key, kind, payload = pickle.load(self.proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                code = self.proc.wait()
                for q in list(self.replies.values()):
                    q.put(("died", f"data worker {self.index} exited (status {code}); its error, if any, is above"))
                return
            self.replies[key].put((kind, payload))

    def open(self, key, spec: FeedSpec, position: Position) -> None:
        self.replies[key] = queue.Queue()
        self._send(("open", key, (spec, tuple(position))))
        for _ in range(PREFETCH):
            self._send(("next", key, None))

    def next(self, key):
        kind, payload = self.replies[key].get()
        if kind != "chunk":
            raise CorpusError(payload)
        self._send(("next", key, None))
        return payload

    def close(self) -> None:
        self._send(("close", None, None))
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve(inp, out) -> None:
    """A worker's loop: open feeds, answer each request for a chunk with the chunk or the
    error that stopped its feed (which then answers every later request with it)."""
    feeds = Feeds(workers=0)   # this process's own: one tokenizer per path, whatever its feeds
    failed: dict[Any, str] = {}
    while True:
        try:
            kind, key, payload = pickle.load(inp)
        except EOFError:
            return
        if kind == "close":
            return
        if kind == "open":
            spec, position = payload
            try:
                feeds.add(key, spec, Position(*position))
            except (OSError, ValueError) as e:
                failed[key] = f"{type(e).__name__}: {e}"
            continue
        try:
            reply = (key, "chunk", feeds.next(key)) if key not in failed else (key, "error", failed[key])
        except (OSError, ValueError) as e:   # CorpusError is a ValueError
            failed[key] = f"{type(e).__name__}: {e}"
            reply = (key, "error", failed[key])
        try:
            pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
        except (BrokenPipeError, OSError):   # the training process is gone: so is the work
            return


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
