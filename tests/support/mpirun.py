"""Launch an mpiexec job from pytest and return its output (multi-rank tests)."""
from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Optional

from runkit.mpirun import MPIEXEC, launcher  # noqa: F401 - MPIEXEC is used by tests

ROOT = Path(__file__).resolve().parents[2]


def job_env() -> dict:
    """This environment without a surrounding MPI job's variables (pytest may itself run
    under mpiexec), one compute thread per rank."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@lru_cache(maxsize=1)
def fork_servers() -> Optional[str]:
    """The directory of this process's fork servers (tests/support/zygote.py), started at
    the first launch (which waits until they listen) and ended with this process; None
    where SUITE_FORK_SERVER=0 asks for every rank to start its own interpreter."""
    if os.environ.get("SUITE_FORK_SERVER", "1") == "0":
        return None
    from tests.support.zygote import SERVERS

    directory = tempfile.mkdtemp(prefix="zygote-")
    if len(directory) > 90:   # a socket's path holds at most 107 bytes
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="zygote-", dir="/tmp")
    servers = []
    for index in range(SERVERS):
        env = dict(job_env(), PYTHONHASHSEED=str(random.randrange(1, 2**32)))
        with open(os.path.join(directory, f"{index}.log"), "w") as log:
            servers.append(subprocess.Popen([sys.executable, "-m", "tests.support.zygote", "serve", directory,
                                             str(index)], env=env, cwd=ROOT, stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL))

    def end() -> None:   # a server asked to end kills its ranks first (see zygote.serve)
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(directory, ignore_errors=True)
    atexit.register(end)
    # ready once each listens (its imports done, a few seconds); one that ended says why
    while not all(os.path.exists(os.path.join(directory, f"{i}.sock")) for i in range(SERVERS)):
        ended = [i for i, server in enumerate(servers) if server.poll() is not None]
        if ended:
            log = Path(directory, f"{ended[0]}.log").read_text()
            raise RuntimeError(f"the suite's fork server {ended[0]} ended as it started:\n{log[-3000:]}")
        time.sleep(0.05)
    return directory


def mpiexec(ranks: int, script: str, *args: str, timeout: float = 600,
            fork_server: bool = True) -> subprocess.CompletedProcess:
    """Run `script` (a path under the repository, or "-m module") on `ranks` ranks, each
    forked from a fork server with torch imported (fork_servers; with `fork_server=False`
    each its own interpreter). Past `timeout` seconds the whole job (mpiexec and every
    rank: its own session) is killed and JobTimedOut (a subprocess.TimeoutExpired with
    what the job printed) raised."""
    target = list(script.split()) if script.startswith("-m ") else [str(ROOT / script)]
    servers = fork_servers() if fork_server else None
    start = ["-m", "tests.support.zygote", "run", servers] if servers else []
    cmd = [*launcher(), "-n", str(ranks), sys.executable, *start, *target, *args]
    with subprocess.Popen(cmd, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          start_new_session=True) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate()
            raise JobTimedOut(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, job.returncode, out, err)


class JobTimedOut(subprocess.TimeoutExpired):
    """A job killed at its timeout, with what it had printed by then (a hang's only clue
    to where it stopped)."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{tails(self.output, self.stderr)}"


def tails(out: Optional[str], err: Optional[str], chars: int = 3000) -> str:
    return f"stdout (its end):\n{(out or '')[-chars:]}\nstderr (its end):\n{(err or '')[-chars:]}"


def report_of(cache: dict, key, tmp_dir: Path, ranks: int, script: str, *args: str, timeout: float = 600) -> dict:
    """The JSON report a worker writes (its last argument; launched once per key and
    cached); on a failed launch or one past `timeout` seconds, {"_launch": its output}."""
    if key not in cache:
        path = tmp_dir / "report.json"
        try:
            run = mpiexec(ranks, script, *args, str(path), timeout=timeout)
        except subprocess.TimeoutExpired as e:   # once: the next test of the key must not wait again
            cache[key] = {"_launch": f"no report after {e.timeout:.0f} s (a hang)\n{tails(e.output, e.stderr)}"}
            return cache[key]
        if run.returncode != 0 or not path.exists():
            cache[key] = {"_launch": f"exit {run.returncode}\n{tails(run.stdout, run.stderr)}"}
        else:
            cache[key] = json.loads(path.read_text())
    return cache[key]


def check_group(report: dict, key: str) -> None:
    """A group of a report passed: the launch worked and no case of the group failed."""
    assert "_launch" not in report, report.get("_launch")
    assert key in report, f"no result for {key}"
    assert report[key] == [], "\n".join(report[key][:20])
