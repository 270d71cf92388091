"""The fork server the multi-rank tests start their ranks from (tests/support/zygote.py):
a forked rank is held to one started as its own interpreter (the reference), launched the
same way by mpiexec, in what it sees as it starts and in how it ends."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.mpirun import ROOT, fork_servers, job_env, mpiexec

pytestmark = pytest.mark.mpi

WORKER = "-m tests.support.rank_facts"


def launch(tmp_path, mode: str, forked: bool, **kw):
    out = tmp_path / ("forked" if forked else "exec") / mode
    out.mkdir(parents=True)
    return mpiexec(2, WORKER, str(out), mode, fork_server=forked, **kw), out


def test_a_forked_rank_starts_and_ends_as_an_interpreter_of_its_own(tmp_path):
    runs = {forked: launch(tmp_path, "facts", forked) for forked in (True, False)}
    facts = {}
    for forked, (run, out) in runs.items():
        assert run.returncode == 0, run.stderr[-3000:]
        facts[forked] = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
        for r in range(2):
            assert (out / f"{r}.thread").exists() and (out / f"{r}.atexit").exists()
            assert f"rank {r} unflushed" in run.stdout
    forked, started = facts[True], facts[False]
    assert [f["preloaded"] for f in forked] == [True, True], "the ranks were not forked from the server"
    assert [f["preloaded"] for f in started] == [False, False]
    same = ("argv0", "cwd", "path0", "name", "rank_env", "size")
    for a, b in zip(forked, started):
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
    # what a fresh interpreter draws from the OS (string hashing, torch's and numpy's
    # default seeds) differs between ranks, as it does there
    for key in ("hash", "torch_seed", "torch_draw", "numpy_draw"):
        assert forked[0][key] != forked[1][key] and started[0][key] != started[1][key], key


@pytest.mark.parametrize("mode", ["exit", "raise", "kill"])
def test_mpiexec_ends_as_it_does_for_ranks_started_as_their_own_interpreters(tmp_path, mode):
    (forked, _), (started, _) = launch(tmp_path, mode, True), launch(tmp_path, mode, False)
    assert forked.returncode == started.returncode != 0, (forked.stderr[-2000:], started.stderr[-2000:])
    if mode == "raise":
        assert "rank 1 fails on purpose" in forked.stderr


def test_a_killed_job_takes_its_forked_ranks_with_it(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        launch(tmp_path, "hang", True, timeout=8)
    # what the job printed before its timeout comes with the error: a hang's only clue
    assert "rank 0 hangs" in str(timed_out.value) and "rank 1 hangs" in str(timed_out.value)
    out = tmp_path / "forked" / "hang"
    pids = [int((out / f"{r}.pid").read_text()) for r in range(2)]

    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def test_a_rank_whose_interpreter_settings_differ_from_the_servers_starts_its_own(tmp_path, monkeypatch):
    """Variables an interpreter reads as it starts (here faulthandler's) cannot be
    taken over by a forked child: such a rank is started as its own interpreter."""
    fork_servers()   # started (if not yet) before the variable is set
    monkeypatch.setenv("PYTHONFAULTHANDLER", "set-by-the-test")
    run, out = launch(tmp_path, "facts", True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [json.loads((out / f"{r}.json").read_text())["preloaded"] for r in range(2)] == [False, False]


# A suite that ends (its fork servers asked to end) or whose fork servers are killed
# outright while a job's ranks still run: the ranks must not outlive them. (They did: the
# servers were SIGKILLed at the suite's exit, before they saw the job's clients go, and
# the orphaned ranks spun on the machine's cores for hours.)
SUITE_THAT_LEAVES = """
import os, pathlib, subprocess, sys, time
from tests.support.mpirun import fork_servers, job_env, launcher
out = pathlib.Path(sys.argv[1])
cmd = [*launcher(), "-n", "2", sys.executable, "-m", "tests.support.zygote", "run", fork_servers(),
       "-m", "tests.support.rank_facts", str(out), "hang"]
subprocess.Popen(cmd, env=job_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 60
while not all((out / f"{r}.pid").exists() for r in range(2)):
    if time.monotonic() > deadline:
        sys.exit("the job's ranks did not start within 60 s")
    time.sleep(0.05)
print("running", flush=True)
sys.stdin.read()   # until the test says: then this process ends, and its fork servers with it
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("servers", ["asked to end", "killed"])
def test_forked_ranks_do_not_outlive_their_fork_servers(tmp_path, servers):
    suite = subprocess.Popen([sys.executable, "-c", SUITE_THAT_LEAVES, str(tmp_path)], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=job_env())
    ranks = []
    try:
        assert suite.stdout.readline() == "running\n"
        ranks = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
        if servers == "killed":   # SIGKILL: no handler of the server's runs
            for rank in ranks:
                os.kill(parent_of(rank), signal.SIGKILL)
        suite.communicate("", timeout=60)
        deadline = time.monotonic() + 10
        while any(alive(rank) for rank in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [rank for rank in ranks if alive(rank)], "forked ranks outlived their fork servers"
    finally:
        suite.kill()
        for rank in ranks:   # (what the old code left behind)
            try:
                os.killpg(rank, signal.SIGKILL)
            except ProcessLookupError:
                pass


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])
