"""A run's hold on its directories (shard-train's out_dir, and train.checkpoint_dir where
set): two runs writing one directory at once would each point LATEST at its own snapshots
and delete the other's as stale, and each would rewrite the other's metrics. Two runs
started in the same second share the default out_dir (runs/<second>), so this happens
without anyone choosing it.

A claim is a POSIX lock (lockf) on DIR/.run.lock, with the holder's host and pid written
in it. The system releases it when the process ends, however it ends, so a relaunch after
a crash (RESTARTS, a requeued job) takes it again, waiting where the holder was a lost
node's (its lock outlives it until the file server notices); processes forked from the
holder (data workers) do not inherit it. Where the file system has no locks, a claim holds
nothing."""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO, Callable, Optional

LOCK = ".run.lock"
HELD = (errno.EACCES, errno.EAGAIN)


class Claimed(RuntimeError):
    """Another process holds the directory."""


def claim(directory: Path, patience: float = 0.0, waiting: Callable[[str], None] = lambda holder: None
          ) -> Optional[IO]:
    """Hold `directory` for as long as the returned file stays open (None where the file
    system cannot lock). Where another process holds it, wait up to `patience` seconds for
    it to let go (`waiting` hears who holds it, once), then raise Claimed, naming the holder:
    a relaunch after a lost node waits for the file server to let go of that node's lock
    (an NFS lease ends after 90 s by default)."""
    deadline = time.monotonic() + patience
    told = False
    while True:
        try:
            return _take(directory)
        except Claimed as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            if not told:
                waiting(str(e))
                told = True
            time.sleep(min(1.0, left))


def _take(directory: Path) -> Optional[IO]:
    handle = open(Path(directory) / LOCK, "a+")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in HELD:
            handle.close()
            return None   # no locks on this file system (some parallel file systems): nothing to hold
        handle.seek(0)
        holder = handle.read().strip() or "a process that wrote nothing"
        handle.close()
        raise Claimed(f"{directory} is in use by another run: {holder}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n")
    handle.flush()
    return handle
