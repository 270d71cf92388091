"""A fork server for the suite's MPI ranks: a rank's interpreter starts with torch already
imported, forked from a server that imported it once.

A rank's Python spends about 1.2 s of a core importing torch, numpy and Hydra, and the
multi-rank tests start about 400 ranks on a 2-core machine. mpiexec starts `python -m
tests.support.zygote run DIR ARGS` in place of `python ARGS`: this client, which imports
nothing heavy, hands the server its arguments, environment, working directory and every
open file descriptor (stdio, the process manager's PMI socket), and the server forks a
child that takes them over, as exec would, then runs ARGS (`-m MODULE ...` or
`SCRIPT ...`) as __main__. The child is the rank: MPI starts in it (the server never
imports mpi4py.MPI). The client waits and ends as the child ended (its exit status, or
killed by the same signal); a signal sent to the client is passed on to the child, and a
client that dies (mpiexec killing its job) takes the child with it.

What a fresh interpreter would differ in is kept: third-party modules only are preloaded
(the project's own modules, which may read the environment as they import, import in
the child); the ranks draw their hash seeds from two servers with different seeds (rank
parity), so an order that depends on string hashing still differs between ranks; torch's
and numpy's default generators are seeded afresh in each child, as a fresh process seeds
them; a client whose interpreter start-up variables (PYTHON*) differ from the server's
is told to start its own. Without a server, or for arguments other than those two forms,
the client execs the interpreter itself.

The preloaded modules' objects (about 180,000) are frozen (gc.freeze) before the first
fork: a child's full collections would otherwise walk every one of them again, and write
to each one's header, copying the server's heap page by page (test_plans_mpi.py and
test_collectives_mpi.py side by side: 25% less user time, 12% less wall time). A child's
own objects are collected as in any interpreter; what differs is that gc.get_objects()
does not list the frozen ones and a cycle among them is never collected, which no test or
tool looks at.

    python -m tests.support.zygote serve DIR INDEX     # a server, socket DIR/INDEX.sock
    python -m tests.support.zygote run DIR ARGS...     # what mpiexec starts per rank
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import struct
import sys

SERVERS = 2                       # rank r forks from server r % SERVERS (hash seeds differ)
PRELOAD = ("torch", "numpy", "mpi4py", "hydra", "omegaconf", "yaml", "tqdm")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
HEADER = struct.Struct("!Q")      # the request's length, sent with the descriptors


# The client (imports nothing beyond the standard library's basics: it starts in ~20 ms).

def run(directory: str, args: list[str]) -> None:
    if not (len(args) >= 2 and args[0] == "-m") and not (args and not args[0].startswith("-")):
        exec_itself(args)
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    fds = open_descriptors()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.path.join(directory, f"{rank % SERVERS}.sock"))
    except OSError:
        conn.close()
        exec_itself(args)
    request = json.dumps({"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}).encode()
    socket.send_fds(conn, [HEADER.pack(len(request))], fds)
    conn.sendall(request)
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _frame: conn.sendall(f"kill {s}\n".encode()))
    status = b""
    while not status.endswith(b"\n"):
        try:
            got = conn.recv(64)
        except InterruptedError:
            continue
        if not got:
            sys.stderr.write("tests.support.zygote: the fork server went away before the rank ended\n")
            os._exit(1)
        status += got
    kind, _, value = status.decode().strip().partition(" ")
    if kind == "exec":   # the server cannot be this interpreter (see settled_at_start)
        conn.close()
        exec_itself(args)
    if kind == "signal":
        if int(value) not in (signal.SIGKILL, signal.SIGSTOP):   # (those two have no handler to reset)
            signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    os._exit(int(value))


def exec_itself(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def open_descriptors() -> list[int]:
    """This process's open descriptors (what an exec'd rank would have inherited)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:   # the listing's own descriptor, closed by now
            continue
        fds.append(int(name))
    return sorted(fds)


# The server.

def serve(directory: str, index: int) -> None:
    import importlib
    import selectors

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert "mpi4py.MPI" not in sys.modules, "a preloaded module started MPI; the ranks must start it"
    gc.freeze()   # see the module's docstring
    parent = os.getppid()
    path = os.path.join(directory, f"{index}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(256)
    os.replace(path + ".new", path)   # clients find the socket only once it listens
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    # a child's end wakes the loop at once (its status goes to its client without delay)
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    events.register(wake_read, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}     # pid -> its client's connection (None once gone)
    # asked to end (the suite's own end, fork_servers): the ranks and what they started
    # end with it (a handler, not a `finally`: a forked rank unwinds through these frames)
    signal.signal(signal.SIGTERM, lambda *_: end(children))
    while os.getppid() == parent:   # the suite's process went: so does the server
        for key, _ in events.select(timeout=0.5):
            if key.fileobj is wake_read:
                while True:
                    try:
                        wake_read.recv(4096)
                    except BlockingIOError:
                        break
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                pid = start(conn, (listener, wake_read, wake_write, *filter(None, children.values())), events)
                if pid is None:
                    continue
                children[pid] = conn
                events.register(conn, selectors.EVENT_READ, pid)
            else:
                conn = key.fileobj
                message = conn.recv(64)
                pid = key.data
                if message:   # "kill S": a signal the client got
                    for line in message.decode().split("\n"):
                        if line.startswith("kill "):
                            kill(pid, int(line.split()[1]))
                else:         # the client is gone (mpiexec killed it): so is the rank
                    kill(pid, signal.SIGKILL)
                    events.unregister(conn)
                    conn.close()
                    children[pid] = None
        reap(children, events)
    end(children)


def end(children: dict) -> None:
    for pid in list(children):
        kill(pid, signal.SIGKILL)
    os._exit(0)


def kill(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)   # the rank and what it started (its own session)
    except ProcessLookupError:
        pass


def reap(children: dict, events) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        word = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        try:
            conn.sendall(f"{word}\n".encode())
        except OSError:
            pass
        events.unregister(conn)
        conn.close()


def settled_at_start(env: dict) -> dict:
    """The variables an interpreter reads as it starts (warning filters, path, malloc, ...):
    a client whose differ from the server's must start its own (the hash seed is the
    server's own choice; unbuffered output is set up in the child)."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k not in ("PYTHONHASHSEED", "PYTHONUNBUFFERED")}


def start(conn: socket.socket, servers: tuple, events) -> int | None:
    """Fork the rank a client asked for; its pid (None where the client must exec its
    own interpreter instead). `servers`: the server's sockets, which the child closes."""
    head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 253)
    while len(head) < HEADER.size:
        head += conn.recv(HEADER.size - len(head))
    size, = HEADER.unpack(head)
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    request = json.loads(body)
    if settled_at_start(request["env"]) != settled_at_start(os.environ):
        for fd in fds:
            os.close(fd)
        conn.sendall(b"exec\n")
        conn.close()
        return None
    server = os.getpid()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    try:
        die_with(server)
        os.setsid()
        signal.set_wakeup_fd(-1)
        for open_conn in (conn, *servers):
            open_conn.close()
        events.close()
        become(request, fds)
    except BaseException:   # noqa: BLE001 - the child could not take the client's place
        import traceback

        traceback.print_exc()
        os._exit(1)
    # what the rank raises (SystemExit too) goes up through the server's frames, and the
    # interpreter ends as a script's does: not os._exit, which would skip MPI's
    # finalization (mpi4py runs it as the interpreter finalizes), and mpiexec takes a rank
    # that leaves without it for a crash and kills the job
    run_main(request["args"])
    sys.exit(0)


def die_with(server: int) -> None:
    """In the forked child: be killed when the server dies. A server killed outright
    (SIGKILL, which no handler sees) cannot kill its ranks, and a rank whose client was
    gone but not yet seen gone would outlive its job, spinning on the suite's cores."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:   # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != server:   # the server died before the signal was set
        os._exit(1)


def become(request: dict, received: list[int]) -> None:
    """In the forked child: take over the client's descriptors, environment, directory
    and standard streams."""
    import fcntl
    import io

    for signum in (signal.SIGCHLD, *FORWARDED):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, target in zip(high, request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                   errors="backslashreplace", line_buffering=True)
    # a fresh process seeds torch's and numpy's default generators from the OS (Python's
    # random is reseeded at every fork)
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def run_main(args: list[str]) -> None:
    """`python ARGS` from here on: the module or script as __main__; what it raises
    (SystemExit too) goes up and ends the interpreter, which then shuts down as any does
    (threads joined, atexit and MPI's finalization, streams flushed)."""
    import runpy

    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def main(argv: list[str]) -> None:
    if argv[0] == "serve":
        serve(argv[1], int(argv[2]))
    elif argv[0] == "run":
        run(argv[1], argv[2:])
    else:
        sys.exit(f"usage: python -m tests.support.zygote serve DIR INDEX | run DIR ARGS...; got {argv[:1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
