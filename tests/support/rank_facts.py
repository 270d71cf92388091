"""mpiexec worker for tests/test_fork_server.py: what a rank sees of its own start, and ways
for it to end, so that a rank forked by the fork server (tests/support/zygote.py) can be held
to one started as its own interpreter.

Usage: mpiexec -n P python -m tests.support.rank_facts DIR MODE
MODE: facts (each rank writes DIR/RANK.json), exit (rank 1 exits 3), raise (rank 1 raises),
kill (rank 1 kills itself with SIGKILL), hang (each rank writes DIR/RANK.pid, says so, then sleeps).
"""
import sys

PRELOADED = "torch" in sys.modules   # before this module imports it: forked from a server

import atexit  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = MPI.COMM_WORLD.rank
    if mode == "facts":
        facts = {"preloaded": PRELOADED, "argv0": sys.argv[0], "cwd": os.getcwd(), "path0": sys.path[0],
                 "name": __name__, "rank_env": os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")),
                 "torch_seed": torch.initial_seed(), "torch_draw": torch.rand(1).item(),
                 "numpy_draw": float(numpy.random.rand()), "hash": hash("a string"),
                 "size": MPI.COMM_WORLD.allreduce(1)}
        (out / f"{rank}.json").write_text(json.dumps(facts))
        # what only an interpreter's end does: wait for a non-daemon thread, run atexit,
        # flush a line that was never flushed
        threading.Thread(target=lambda: (time.sleep(0.3), (out / f"{rank}.thread").touch())).start()
        atexit.register(lambda: (out / f"{rank}.atexit").touch())
        print(f"rank {rank} unflushed", end="")
    elif mode == "exit":
        MPI.COMM_WORLD.Barrier()
        sys.exit(3 if rank == 1 else 0)
    elif mode == "raise":
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")
    elif mode == "kill":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        MPI.COMM_WORLD.Barrier()
    elif mode == "hang":
        (out / f"{rank}.pid").write_text(str(os.getpid()))
        print(f"rank {rank} hangs", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
