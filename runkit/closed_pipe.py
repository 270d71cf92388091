"""A command-line tool whose reader goes away (`pccl-sim | head -3`) ends quietly, as a
Unix tool does, instead of printing Python's BrokenPipeError traceback twice (the write
that failed, then the flush at exit)."""
from __future__ import annotations

import functools
import os
import select
import sys


def quiet_when_its_reader_goes(main):
    """Wraps a tool's `main`: a BrokenPipeError from standard output that lost its reader
    ends the tool with exit status 1 and nothing printed; any other broken pipe (a socket,
    a child's stdin) is raised as it was."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except BrokenPipeError:
            if not reader_gone(sys.stdout):
                raise
            # what is still buffered would fail again at exit: it goes nowhere instead
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
    return run


def reader_gone(stream) -> bool:
    """A pipe's writing end whose readers all closed polls as an error."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):   # no descriptor (a test's capture)
        return False
